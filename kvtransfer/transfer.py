"""KVTransfer: move one request's KV blocks between a pair, every wait bounded by a deadline.

Protocol for one transfer (sender = host side, rank 0; receiver = joined side, rank 1):
  1. the sender pushes an Announcement (epoch, layers per message, descriptor, payload mode)
     onto the pair store's queue; announcing through the store, not the group, lets a
     receiver wait for work with a timeout without breaking anything, and wakes it without
     polling;
  2. both sides use the backend group of that epoch, building it if needed;
  3. the payload goes in one of two modes, which the sender picks and names in the frame:
     "packed" (kvtransfer.packed_payload: layers gathered into double-buffered messages) or
     "runs" (kvtransfer.run_payload: zero-copy, one message per contiguous cache region,
     when the blocks form a few runs of large regions and the sender's cache is head-major).
Any failure after (1) tears the group down and advances the pair's epoch (kvtransfer.pair).
Deadlines: `timeout` bounds each blocking step (kvtransfer.wire), so a dead or hung peer fails
a transfer within about `timeout` of its last progress.

Pulls (kvtransfer.pull) run the other way over the same pair: the host asks (pull()), the
joined side answers while it waits for transfers (recv(serve=...)).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import torch

from kvtransfer import packed_payload, run_payload
from kvtransfer.announcement import MODE_PACKED, MODE_RUNS, Announcement, PullAsk, decode_frame
from kvtransfer.descriptor import TransferDescriptor
from kvtransfer.errors import (
    DescriptorError,
    PeerLost,
    TransferError,
    TransferRejected,
    TransferTimeout,
)
from kvtransfer.group import GroupRegistry
from kvtransfer.packing import DEFAULT_MESSAGE_BYTES, check_cache, layers_per_message
from kvtransfer.pair import PeerGroup
from kvtransfer.pull import PullServer, answer_pull, ask_pull
from kvtransfer.run_payload import MAX_RUNS, MIN_RUN_BYTES
from kvtransfer.transfer_stats import TransferStats, stats_of
from kvtransfer.wire import Channel, blocking

ANNOUNCE_SLICE_S = 0.25  # longest single blocking wait for an announcement


class KVTransfer:
    """Sends and receives KV blocks with the peers of a GroupRegistry, one transfer per peer at
    a time; `timeout` bounds every blocking step (no progress for that long fails the transfer).
    """

    def __init__(
        self,
        registry: GroupRegistry,
        *,
        message_bytes: int = DEFAULT_MESSAGE_BYTES,
        pipeline: bool = True,
        max_runs: int = MAX_RUNS,
        min_run_bytes: int = MIN_RUN_BYTES,
    ) -> None:
        if message_bytes < 1:
            raise ValueError(f"message_bytes must be >= 1, got {message_bytes}")
        if max_runs < 0:
            raise ValueError(f"max_runs must be >= 0, got {max_runs}")
        if min_run_bytes < 0:
            raise ValueError(f"min_run_bytes must be >= 0, got {min_run_bytes}")
        self.registry = registry
        self.message_bytes = message_bytes  # target size of one message; at least one layer
        self.pipeline = pipeline  # double-buffer (overlap pack/unpack with the wire)
        self.max_runs = max_runs  # send zero-copy when the blocks form at most this many runs
        self.min_run_bytes = min_run_bytes  # ... and those regions average at least this many

    # ---- sender -------------------------------------------------------------------------
    def send(
        self,
        peer_id: str,
        kv_cache: Sequence[torch.Tensor],
        desc: TransferDescriptor,
        *,
        timeout: float | None = None,
    ) -> TransferStats:
        """Send desc's blocks (src_block_ids, layer range) of `kv_cache` to `peer_id`.

        Returns once the payload has left this process; the receiver confirms application
        over the control plane (its recv() returning). The cache must not change meanwhile.
        """
        group = self.registry.get(peer_id)
        if not group.is_host:
            raise TransferError(
                f"peer {peer_id!r} was joined, not hosted: only the host side "
                "(prefill, rank 0) of a pair sends"
            )
        check_cache(kv_cache, desc, desc.src_block_ids, "sender")
        timeout = self.registry.timeout if timeout is None else timeout
        with group.session(timeout):
            start = time.perf_counter()
            with blocking(group, "reading the pair epoch", timeout, store=True):
                epoch = group.sync_epoch()
            try:
                frame = self.announce(group, kv_cache, desc, epoch, timeout)
                num_messages, payload = self.send_payload(group, kv_cache, frame, timeout)
            except BaseException:
                group.fail(epoch)
                raise
            seconds = time.perf_counter() - start
        return stats_of(desc, num_messages, payload, frame.nbytes, seconds)

    def announce(
        self,
        group: PeerGroup,
        kv_cache: Sequence[torch.Tensor],
        desc: TransferDescriptor,
        epoch: int,
        timeout: float,
    ) -> Announcement:
        """Queue desc's announcement for the peer (its payload follows); the frame sent.
        (This and the two payload methods are the steps kvtransfer.pull reuses.)"""
        lpm = layers_per_message(desc, self.message_bytes)
        frame = Announcement(epoch, lpm, desc, self.payload_mode(kv_cache, desc))
        raw = frame.encode()
        with blocking(group, "announcing the transfer", timeout, store=True):
            group.announce(raw)
        return dataclasses.replace(frame, nbytes=len(raw))

    def send_payload(
        self,
        group: PeerGroup,
        kv_cache: Sequence[torch.Tensor],
        frame: Announcement,
        timeout: float,
    ) -> tuple[int, int]:
        """Send an announced frame's payload over the group of its epoch."""
        with blocking(group, "building the group", timeout, store=False):
            pg = group.connect(frame.epoch)
        ch = Channel(pg, group, timeout, self.pipeline)
        if frame.mode == MODE_RUNS:
            return run_payload.send(ch, kv_cache, frame.descriptor)
        return packed_payload.send(ch, kv_cache, frame.descriptor, frame.layers_per_message)

    def recv_payload(
        self,
        group: PeerGroup,
        kv_cache: Sequence[torch.Tensor],
        frame: Announcement,
        timeout: float,
        drain: bool,
    ) -> tuple[int, int]:
        """Receive an announced frame's payload into its dst blocks (`drain`: drop it)."""
        with blocking(group, "building the group", timeout, store=False):
            pg = group.connect(frame.epoch)
        ch = Channel(pg, group, timeout, self.pipeline)
        recv_payload = run_payload.recv if frame.mode == MODE_RUNS else packed_payload.recv
        return recv_payload(ch, kv_cache, frame, drain=drain)

    def payload_mode(self, kv_cache: Sequence[torch.Tensor], desc: TransferDescriptor) -> str:
        """The mode send() uses for desc from kv_cache: MODE_RUNS if desc's blocks form
        1..max_runs runs whose regions average at least min_run_bytes, and the cache is
        head-major; else MODE_PACKED."""
        if run_payload.fits(kv_cache, desc, self.max_runs, self.min_run_bytes):
            return MODE_RUNS
        return MODE_PACKED

    # ---- receiver -----------------------------------------------------------------------
    def pending(self, peer_id: str) -> int:
        """Announced transfers from `peer_id` not yet received (stale ones included)."""
        group = self.registry.get(peer_id)
        timeout = self.registry.timeout
        with group.session(timeout), blocking(group, "reading announcements", timeout, store=True):
            return group.num_announcements()

    def recv(
        self,
        peer_id: str,
        kv_cache: Sequence[torch.Tensor],
        *,
        wait: float,
        timeout: float | None = None,
        accept: Callable[[TransferDescriptor], bool] | None = None,
        serve: PullServer | None = None,
    ) -> tuple[TransferDescriptor, TransferStats]:
        """Receive the next transfer from `peer_id` into its dst_block_ids of `kv_cache`.

        Waits up to `wait` seconds for an announcement (TransferTimeout otherwise; the group
        stays intact). `accept(desc)` may refuse a transfer (e.g. its request was aborted):
        its payload is then drained and TransferRejected raised, the cache untouched. On any
        other TransferError the dst blocks may hold part of the payload: do not use them.
        Pull asks that arrive meanwhile are answered from `kv_cache` by `serve` (without one
        they go unanswered and the asker times out); a failed answer raises its TransferError.
        """
        group = self.registry.get(peer_id)
        if group.is_host:
            raise TransferError(
                f"peer {peer_id!r} was hosted, not joined: only the joined side "
                "(decode, rank 1) of a pair receives"
            )
        timeout = self.registry.timeout if timeout is None else timeout
        with group.session(wait):
            start = time.perf_counter()
            with blocking(group, "reading the pair epoch", timeout, store=True):
                group.publish_failure()
            frame = self._next_frame(group, start + wait, timeout)
            while isinstance(frame, PullAsk):
                if serve is not None:
                    answer_pull(self, group, kv_cache, frame, serve, timeout)
                frame = self._next_frame(group, start + wait, timeout)
            desc = frame.descriptor
            try:
                refusal = _refusal(kv_cache, desc, accept)
                num_messages, payload = self.recv_payload(
                    group, kv_cache, frame, timeout, drain=refusal is not None
                )
            except BaseException:
                group.fail(frame.epoch)
                raise
            seconds = time.perf_counter() - start
        if refusal is not None:
            raise TransferRejected(
                f"request {desc.request_id} from peer {peer_id!r} refused "
                f"({refusal}); its payload was drained"
            )
        return desc, stats_of(desc, num_messages, payload, frame.nbytes, seconds)

    # ---- pulls (kvtransfer.pull) ----------------------------------------------------------
    def pull(
        self,
        peer_id: str,
        kv_cache: Sequence[torch.Tensor],
        ask: PullAsk,
        *,
        timeout: float | None = None,
    ) -> tuple[TransferDescriptor, TransferStats]:
        """Ask the joined peer for the blocks of `ask` and receive those it holds into the
        leading ask.dst_block_ids of `kv_cache`. Returns the answer's descriptor (missing:
        the block indices that arrived, from ask.start on; possibly none) once they are in
        place. Raises TransferError (TransferTimeout: no answer within `timeout`); then the
        destination blocks may hold part of the payload: do not use them."""
        group = self.registry.get(peer_id)
        if not group.is_host:
            raise TransferError(
                f"peer {peer_id!r} hosts the pair: only the host side (prefill, rank 0) pulls"
            )
        timeout = self.registry.timeout if timeout is None else timeout
        return ask_pull(self, group, kv_cache, ask, timeout)

    def _next_frame(
        self, group: PeerGroup, deadline: float, timeout: float
    ) -> Announcement | PullAsk:
        """Pop frames until one of the current epoch arrives or the deadline passes."""
        while True:
            if group.closed:
                raise PeerLost(f"peer {group.peer_id!r} was removed while waiting")
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                raise TransferTimeout(
                    f"no transfer announced by peer {group.peer_id!r} in time; "
                    "the group is intact, call recv() again to keep waiting"
                )
            with blocking(group, "waiting for an announcement", timeout, store=True):
                # Short slices, so that a concurrent remove() is noticed promptly.
                raw = group.next_announcement(min(remaining, ANNOUNCE_SLICE_S))
                if raw is None:
                    continue
                try:
                    frame = decode_frame(raw)
                except DescriptorError as e:
                    group.fail(None)  # its payload cannot be sized: the stream is lost
                    raise TransferError(
                        f"peer {group.peer_id!r} announced a malformed "
                        f"transfer ({e}); the group was reset"
                    ) from e
                # Steady state: the frame is for our live group, no further round trip. Else
                # ask the store: a frame older than the pair's epoch was announced before a
                # failure and its sender has given up on it; building a group for it would
                # wait for a peer that never comes.
                if frame.epoch == group.pg_epoch or frame.epoch >= group.epoch():
                    return frame


def _refusal(
    kv_cache: Sequence[torch.Tensor],
    desc: TransferDescriptor,
    accept: Callable[[TransferDescriptor], bool] | None,
) -> str | None:
    """Why the receiver must not apply `desc` to `kv_cache`, or None if it may."""
    try:
        check_cache(kv_cache, desc, desc.dst_block_ids, "receiver")
    except DescriptorError as e:
        return str(e)
    if accept is not None and not accept(desc):
        return "accept() returned False"
    return None
