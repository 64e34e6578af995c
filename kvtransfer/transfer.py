"""KVTransfer: move one request's KV blocks between a pair, every wait bounded by a deadline.

Protocol for one transfer (sender = host side, rank 0; receiver = joined side, rank 1):
  1. the sender pushes an Announcement (epoch, layers per message, descriptor) onto the pair
     store's queue; announcing through the store, not the group, lets a receiver wait for work
     with a timeout without breaking anything, and wakes it without polling;
  2. both sides use the backend group of that epoch, building it if needed;
  3. the payload goes in one of two modes, which the sender picks and names in the frame:
     - "packed": len(plan_messages(...)) messages of consecutive layers, in order,
       double-buffered: the sender packs message m + 1 while m is on the wire, the receiver
       has two receives posted and unpacks one while the next arrives;
     - "runs" (zero-copy): when the blocks, in wire order, form at most `max_runs` runs
       (stretches where src and dst ids both go up by one; a fresh engine allocates prompts
       this way), those regions average at least `min_run_bytes` and the sender's cache is
       head-major, every (layer, k/v, kv head, run) region of the cache storage is contiguous
       and is one message, sent straight from the cache: layers * 2 * kv_heads * runs
       messages, in that nesting order, all posted at once (up to RUN_WINDOW). A head-major
       receiver receives each straight into its cache; any other receiver (or a draining one)
       receives into SCRATCH_WINDOW scratch chunks and copies (correct, slower).
     The run cap and the region floor bound the message count and keep messages large: each
     message has a fixed cost (gloo: ~45 us of CPU per side on the 2-CPU box, about what
     copying 350 KiB costs), so more scattered ids or small regions go packed, where one
     gather + scatter is cheaper than many small sends.
Any failure after (1) tears the group down and advances the pair's epoch (kvtransfer.pair).
Deadlines: `timeout` bounds each blocking step (a store call, the group rendezvous, each
message), so a dead or hung peer fails a transfer within about `timeout` of its last progress.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from kvtransfer.announcement import MODE_PACKED, MODE_RUNS, Announcement
from kvtransfer.descriptor import TransferDescriptor
from kvtransfer.errors import (
    DescriptorError,
    PeerLost,
    TransferError,
    TransferRejected,
    TransferTimeout,
)
from kvtransfer.group import GroupRegistry
from kvtransfer.packing import (
    DEFAULT_MESSAGE_BYTES,
    Staging,
    check_cache,
    is_head_major,
    layers_per_message,
    pack,
    plan_messages,
    run_region,
    run_slices,
    runs,
    unpack,
    wire_order,
)
from kvtransfer.pair import PeerGroup

TAG = 0  # NCCL ignores tags: the protocol relies on per-pair message order only
ANNOUNCE_SLICE_S = 0.25  # longest single blocking wait for an announcement
MAX_RUNS = 8  # default cap on runs for the zero-copy mode (0 disables it)
# Default floor on the average run-mode message: below it, the fixed cost per message exceeds
# what zero-copy saves (2-CPU box, SmolLM2 shapes, ratio to a plain send: 128 KiB regions
# packed 0.57 vs runs 0.49; 256 KiB runs 0.65 vs 0.56; 512 KiB runs 0.73 vs 0.57). SmolLM2
# regions are 4 KiB per block, so 256 KiB at 1k tokens.
MIN_RUN_BYTES = 256 << 10
# Run-mode messages in flight (1 without pipelining). A gloo send waits for its receive to be
# posted, so receives must be posted ahead; posting all of them at once beat a window of 64 by
# ~10-20% at 1k tokens. Sends and direct receives cost no memory, scratch receives one chunk
# each; the cap only bounds outstanding work objects.
RUN_WINDOW = 4096
# NCCL launches a kernel per posted send/recv; past ~1k pending launches posting blocks in the
# driver where no deadline applies, so NCCL pairs keep at most this many in flight.
NCCL_RUN_WINDOW = 64
SCRATCH_WINDOW = 8


@dataclass(frozen=True, slots=True)
class TransferStats:
    """What one transfer moved and how long it took (measured on the side that reports it)."""

    request_id: str
    num_blocks: int
    num_layers: int
    num_messages: int
    payload_bytes: int  # KV bytes through the backend group
    control_bytes: int  # announcement frame through the pair store
    seconds: float

    @property
    def wire_bytes(self) -> int:
        """All bytes the transfer put on the wire."""
        return self.payload_bytes + self.control_bytes

    @property
    def gb_per_s(self) -> float:
        """Effective payload throughput in GB/s (1e9 bytes)."""
        return self.payload_bytes / max(self.seconds, 1e-9) / 1e9


@contextmanager
def _blocking(group: PeerGroup, what: str, timeout: float, *, store: bool) -> Iterator[None]:
    """Turn a backend/store failure of one blocking step into a TransferError subclass.

    `store`: the step talks to the pair store, which lives in the host's process, so an error
    there means the host is gone (PeerLost; a store call that hangs is cut off by the group as
    TransferTimeout). A broken data connection only means the peer reset the group or died.
    """
    start = time.perf_counter()
    try:
        yield
    except TransferError:
        raise
    except RuntimeError as e:  # torch.distributed errors (DistError is a RuntimeError)
        elapsed = time.perf_counter() - start
        peer = group.peer_id
        if group.closed:
            raise PeerLost(f"{what}: peer {peer!r} was removed during the transfer") from e
        if store:
            raise PeerLost(
                f"{what}: the store of peer {peer!r} is unreachable, its process is "
                f"gone; remove() it [{e}]"
            ) from e
        if elapsed >= 0.9 * timeout:
            raise TransferTimeout(
                f"{what}: no progress from peer {peer!r} for {elapsed:.1f}s "
                f"(deadline {timeout}s); the group was torn down and the next "
                f"transfer rebuilds it [{e}]"
            ) from e
        raise TransferError(
            f"{what}: the connection to peer {peer!r} broke after "
            f"{elapsed:.2f}s (it reset the group or died); the group was torn "
            "down and the next transfer rebuilds it, or raises PeerLost if the "
            f"peer is gone [{e}]"
        ) from e


def _wait(work: Any, timeout: float) -> None:
    # work.wait(timeout) blocks the CPU thread and raises once the deadline passes, for gloo and
    # NCCL alike; on CUDA it also orders the current stream after the operation. Wait for works
    # in the order they were posted: with gloo (torch 2.13, TCP), waiting for a later send or
    # receive before an earlier one hangs until the deadline.
    if not work.wait(timedelta(seconds=timeout)):
        raise RuntimeError("backend operation did not complete")


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
        lpm = layers_per_message(desc, self.message_bytes)
        mode = self.payload_mode(kv_cache, desc)
        with group.session(timeout):
            start = time.perf_counter()
            with _blocking(group, "reading the pair epoch", timeout, store=True):
                epoch = group.sync_epoch()
            frame = Announcement(epoch, lpm, desc, mode).encode()
            try:
                with _blocking(group, "announcing the transfer", timeout, store=True):
                    group.announce(frame)
                with _blocking(group, "building the group", timeout, store=False):
                    pg = group.connect(epoch)
                if mode == MODE_RUNS:
                    num_messages, payload = self._send_runs(pg, group, kv_cache, desc, timeout)
                else:
                    num_messages, payload = self._send_payload(
                        pg, group, kv_cache, desc, lpm, timeout
                    )
            except BaseException:
                group.fail(epoch)
                raise
            seconds = time.perf_counter() - start
        return TransferStats(
            desc.request_id,
            desc.num_blocks,
            desc.num_layers,
            num_messages,
            payload,
            len(frame),
            seconds,
        )

    def payload_mode(self, kv_cache: Sequence[torch.Tensor], desc: TransferDescriptor) -> str:
        """The mode send() uses for desc from kv_cache: MODE_RUNS if desc's blocks form
        1..max_runs runs whose regions average at least min_run_bytes, and the cache is
        head-major; else MODE_PACKED."""
        if not (self.max_runs and desc.num_blocks and is_head_major(kv_cache, desc.layers)):
            return MODE_PACKED
        num_runs = len(runs(*wire_order(desc)))
        block_size, _, head_dim = desc.block_shape
        region_bytes = desc.num_blocks * block_size * head_dim * desc.torch_dtype.itemsize
        if num_runs <= self.max_runs and region_bytes >= num_runs * self.min_run_bytes:
            return MODE_RUNS
        return MODE_PACKED

    def _send_runs(
        self,
        pg: Any,
        group: PeerGroup,
        kv_cache: Sequence[torch.Tensor],
        desc: TransferDescriptor,
        timeout: float,
    ) -> tuple[int, int]:
        """Zero-copy: each (layer, k/v, head, run) region of the cache is one message."""
        window = _run_window(group) if self.pipeline else 1
        inflight: deque[Any] = deque()  # send works, message order
        payload = count = 0
        with _blocking(group, f"sending request {desc.request_id}", timeout, store=False):
            for wire in run_slices(kv_cache, desc, runs(*wire_order(desc)), 0):
                if len(inflight) >= window:
                    _wait(inflight.popleft(), timeout)
                inflight.append(pg.send([wire], 1 - group.rank, TAG))
                payload += wire.numel()
                count += 1
            while inflight:
                _wait(inflight.popleft(), timeout)
        return count, payload

    def _send_payload(
        self,
        pg: Any,
        group: PeerGroup,
        kv_cache: Sequence[torch.Tensor],
        desc: TransferDescriptor,
        lpm: int,
        timeout: float,
    ) -> tuple[int, int]:
        staging = self._staging(group)
        src = torch.tensor(wire_order(desc)[0], dtype=torch.long, device=group.device)
        plan = _plan(desc, lpm)
        slots = 2 if self.pipeline else 1
        inflight: list[Any] = [None] * slots  # send work per staging slot
        payload = 0
        with _blocking(group, f"sending request {desc.request_id}", timeout, store=False):
            for m, layers in enumerate(plan):
                slot = m % slots
                if inflight[slot] is not None:
                    _wait(inflight[slot], timeout)  # the slot's previous message has left
                buf = staging.view(slot, desc, layers[1] - layers[0])
                pack(kv_cache, layers, src, buf)
                wire = buf.view(-1).view(torch.uint8)
                inflight[slot] = pg.send([wire], 1 - group.rank, TAG)
                payload += wire.numel()
            for work in inflight:
                if work is not None:
                    _wait(work, timeout)
        return len(plan), payload

    # ---- receiver -----------------------------------------------------------------------
    def pending(self, peer_id: str) -> int:
        """Announced transfers from `peer_id` not yet received (stale ones included)."""
        group = self.registry.get(peer_id)
        timeout = self.registry.timeout
        with group.session(timeout), _blocking(group, "reading announcements", timeout, store=True):
            return group.num_announcements()

    def recv(
        self,
        peer_id: str,
        kv_cache: Sequence[torch.Tensor],
        *,
        wait: float,
        timeout: float | None = None,
        accept: Callable[[TransferDescriptor], bool] | None = None,
    ) -> tuple[TransferDescriptor, TransferStats]:
        """Receive the next transfer from `peer_id` into its dst_block_ids of `kv_cache`.

        Waits up to `wait` seconds for an announcement (TransferTimeout otherwise; the group
        stays intact). `accept(desc)` may refuse a transfer (e.g. its request was aborted):
        its payload is then drained and TransferRejected raised, the cache untouched. On any
        other TransferError the dst blocks may hold part of the payload: do not use them.
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
            with _blocking(group, "reading the pair epoch", timeout, store=True):
                group.publish_failure()
            frame, mode = self._next_frame(group, start + wait, timeout)
            desc = frame.descriptor
            try:
                refusal = _refusal(kv_cache, desc, accept)
                with _blocking(group, "building the group", timeout, store=False):
                    pg = group.connect(frame.epoch)
                recv_payload = self._recv_runs if mode == MODE_RUNS else self._recv_payload
                num_messages, payload = recv_payload(
                    pg, group, kv_cache, frame, timeout, drain=refusal is not None
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
        return desc, TransferStats(
            desc.request_id,
            desc.num_blocks,
            desc.num_layers,
            num_messages,
            payload,
            frame.nbytes,
            seconds,
        )

    def _next_frame(
        self, group: PeerGroup, deadline: float, timeout: float
    ) -> tuple[Announcement, str]:
        """Pop announcements until one of the current epoch arrives or the deadline passes."""
        while True:
            if group.closed:
                raise PeerLost(f"peer {group.peer_id!r} was removed while waiting")
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                raise TransferTimeout(
                    f"no transfer announced by peer {group.peer_id!r} in time; "
                    "the group is intact, call recv() again to keep waiting"
                )
            with _blocking(group, "waiting for an announcement", timeout, store=True):
                # Short slices, so that a concurrent remove() is noticed promptly.
                raw = group.next_announcement(min(remaining, ANNOUNCE_SLICE_S))
                if raw is None:
                    continue
                try:
                    frame = Announcement.decode(raw)
                    mode = frame.mode
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
                    return frame, mode

    def _recv_payload(
        self,
        pg: Any,
        group: PeerGroup,
        kv_cache: Sequence[torch.Tensor],
        frame: Announcement,
        timeout: float,
        drain: bool,
    ) -> tuple[int, int]:
        desc = frame.descriptor
        staging = self._staging(group)
        dst = torch.tensor(wire_order(desc)[1], dtype=torch.long, device=group.device)
        plan = _plan(desc, frame.layers_per_message)
        slots = 2 if self.pipeline else 1
        posted: deque[tuple[torch.Tensor, Any]] = deque()  # (buffer, recv work), message order
        payload = 0

        def post(m: int) -> None:
            a, b = plan[m]
            buf = staging.view(m % slots, desc, b - a)
            posted.append((buf, pg.recv([buf.view(-1).view(torch.uint8)], 1 - group.rank, TAG)))

        with _blocking(group, f"receiving request {desc.request_id}", timeout, store=False):
            for m in range(min(slots, len(plan))):
                post(m)
            for m, layers in enumerate(plan):
                buf, work = posted.popleft()
                _wait(work, timeout)
                if not drain:
                    unpack(buf, kv_cache, layers, dst)
                payload += buf.numel() * buf.element_size()
                if m + slots < len(plan):
                    post(m + slots)  # reuses buf's slot: on CUDA the recv is stream-ordered
                    # after the unpack above, on CPU the unpack is already done
        return len(plan), payload

    def _recv_runs(
        self,
        pg: Any,
        group: PeerGroup,
        kv_cache: Sequence[torch.Tensor],
        frame: Announcement,
        timeout: float,
        drain: bool,
    ) -> tuple[int, int]:
        """Receive a "runs" payload: straight into a head-major cache, else (or when draining)
        into SCRATCH_WINDOW scratch chunks of one staging slot, copying each into the cache."""
        desc = frame.descriptor
        messages = list(_run_messages(desc))
        block_size, _, head_dim = desc.block_shape
        block_bytes = block_size * head_dim * desc.torch_dtype.itemsize  # one head, K or V
        direct = not drain and is_head_major(kv_cache, desc.layers)
        window = (_run_window(group) if direct else SCRATCH_WINDOW) if self.pipeline else 1
        chunk = max(n for _, _, _, (_, _, n) in messages) * block_bytes if messages else 0
        scratch = None if direct else self._staging(group).raw(0, window * chunk)
        # Direct: the cache's own regions, taken in message order as receives are posted.
        regions = run_slices(kv_cache, desc, runs(*wire_order(desc)), 1) if direct else None
        posted: deque[tuple[torch.Tensor, Any]] = deque()  # (buffer, recv work), message order
        payload = 0

        def post(i: int) -> None:
            if regions is not None:
                buf = next(regions)  # post(i) runs for i = 0, 1, 2, ... in order
            else:
                _, _, _, (_, _, n) = messages[i]
                offset = (i % window) * chunk
                buf = scratch[offset : offset + n * block_bytes]
            posted.append((buf, pg.recv([buf], 1 - group.rank, TAG)))

        with _blocking(group, f"receiving request {desc.request_id}", timeout, store=False):
            for i in range(min(window, len(messages))):
                post(i)
            for i, (layer, k, head, (_, d0, n)) in enumerate(messages):
                buf, work = posted.popleft()
                _wait(work, timeout)
                if scratch is not None and not drain:
                    run_region(kv_cache[layer], k, head, d0, n).copy_(
                        buf.view(desc.torch_dtype).view(n, block_size, head_dim)
                    )
                payload += buf.numel()
                if i + window < len(messages):
                    post(i + window)  # reuses buf's chunk: stream-ordered after the copy
        return len(messages), payload

    @staticmethod
    def _staging(group: PeerGroup) -> Staging:
        if group.staging is None:
            group.staging = Staging(group.device)
        return group.staging


def _plan(desc: TransferDescriptor, lpm: int) -> list[tuple[int, int]]:
    """Message layer ranges; none when no block moves (the announcement alone suffices)."""
    return plan_messages(desc, lpm) if desc.num_blocks else []


def _run_messages(
    desc: TransferDescriptor,
) -> Iterator[tuple[int, int, int, tuple[int, int, int]]]:
    """(layer, k/v, kv head, (src start, dst start, n)) of each "runs" message, in wire order."""
    spans = runs(*wire_order(desc))
    for layer in range(*desc.layers):
        for k in range(2):
            for head in range(desc.block_shape[1]):
                for span in spans:
                    yield layer, k, head, span


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


def _run_window(group: PeerGroup) -> int:
    """How many run-mode messages may be in flight on this pair's backend."""
    return NCCL_RUN_WINDOW if group.backend == "nccl" else RUN_WINDOW
