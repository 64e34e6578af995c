"""Pulls: the pair's host side (prefill) asks its joined side (decode) for cached blocks.

The reverse of a transfer, over the same pair group, the same descriptors and the same
deadlines. The ask travels on the host -> joiner queue, in order with forward transfers (each
side runs its transfers with one peer on one thread, so a pull never crosses a forward
transfer on the wire):

  1. the host allocates destination blocks, then queues a PullAsk (kvtransfer.announcement):
     the token ids of the blocks (the joined side re-derives their hashes and re-checks each
     hit against its tokens), the first block it lacks, its destination block ids;
  2. the joined side pins the leading blocks it holds from there (PullServer.export), answers
     on the joiner -> host queue with an Announcement whose descriptor names them (possibly
     none), sends their payload, and unpins them (PullServer.exported);
  3. the host receives the payload into the leading destination blocks.
Every wait is bounded by `timeout`. Any failure after (1) fails the pair's epoch on the side
that sees it, as a forward transfer does; the host then frees its destination blocks without
caching them (their tokens are computed instead).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Protocol

import torch

from kvtransfer.announcement import Announcement, PullAsk, decode_frame
from kvtransfer.descriptor import TransferDescriptor
from kvtransfer.errors import DescriptorError, PeerLost, TransferError, TransferTimeout
from kvtransfer.packing import check_cache
from kvtransfer.pair import PeerGroup
from kvtransfer.transfer_stats import TransferStats, stats_of
from kvtransfer.wire import blocking

ANSWER_SLICE_S = 0.25  # longest single blocking wait for an answer


class PayloadSteps(Protocol):
    """The steps of a transfer that a pull reuses (kvtransfer.transfer.KVTransfer)."""

    def announce(
        self,
        group: PeerGroup,
        kv_cache: Sequence[torch.Tensor],
        desc: TransferDescriptor,
        epoch: int,
        timeout: float,
    ) -> Announcement:
        """Queue desc's announcement for the peer; the frame sent."""

    def send_payload(
        self,
        group: PeerGroup,
        kv_cache: Sequence[torch.Tensor],
        frame: Announcement,
        timeout: float,
    ) -> tuple[int, int]:
        """Send an announced frame's payload; (messages, payload bytes)."""

    def recv_payload(
        self,
        group: PeerGroup,
        kv_cache: Sequence[torch.Tensor],
        frame: Announcement,
        timeout: float,
        drain: bool,
    ) -> tuple[int, int]:
        """Receive an announced frame's payload into its dst blocks."""


class PullServer(Protocol):
    """The joined side's answer to pull asks (a decode worker)."""

    def export(self, ask: PullAsk) -> TransferDescriptor:
        """Pin the leading asked blocks this side holds and describe them (ask.describe);
        none is a valid answer. Their KV must not change until exported() is called."""

    def exported(self, desc: TransferDescriptor, stats: TransferStats | None) -> None:
        """The answer to desc is done (stats) or failed (None): unpin its blocks."""


def ask_pull(
    xfer: PayloadSteps,
    group: PeerGroup,
    kv_cache: Sequence[torch.Tensor],
    pull: PullAsk,
    timeout: float,
) -> tuple[TransferDescriptor, TransferStats]:
    """The host side of one pull (KVTransfer.pull): ask, wait for the answer, receive."""
    num_blocks = kv_cache[0].shape[1]
    bad = [b for b in pull.dst_block_ids if b >= num_blocks]
    if bad:
        raise DescriptorError(f"pull destination block ids {bad[:5]} are out of range")
    with group.session(timeout):
        start = time.perf_counter()
        with blocking(group, "reading the pair epoch", timeout, store=True):
            epoch = group.sync_epoch()
        pull = dataclasses.replace(pull, epoch=epoch)
        raw = pull.encode()
        try:
            with blocking(group, "asking for blocks", timeout, store=True):
                group.announce(raw)
            frame = _answer_to(group, pull, time.perf_counter() + timeout, timeout)
            desc = frame.descriptor
            _check_answer(pull, desc)
            check_cache(kv_cache, desc, desc.dst_block_ids, "receiver")
            num_messages = payload = 0
            if desc.num_blocks:
                num_messages, payload = xfer.recv_payload(
                    group, kv_cache, frame, timeout, drain=False
                )
        except DescriptorError as e:
            group.fail(epoch)
            raise TransferError(
                f"peer {group.peer_id!r} answered pull {pull.pull_id} wrongly: {e}"
            ) from e
        except BaseException:
            group.fail(epoch)
            raise
        seconds = time.perf_counter() - start
    return desc, stats_of(desc, num_messages, payload, len(raw) + frame.nbytes, seconds)


def answer_pull(
    xfer: PayloadSteps,
    group: PeerGroup,
    kv_cache: Sequence[torch.Tensor],
    pull: PullAsk,
    serve: PullServer,
    timeout: float,
) -> None:
    """The joined side of one pull (inside KVTransfer.recv): pin, answer, send, unpin."""
    try:
        desc = serve.export(pull)
    except Exception as e:  # noqa: BLE001 - unanswered: the asker times out
        raise TransferError(f"cannot answer pull {pull.pull_id}: {e}") from e
    stats = None
    try:
        start = time.perf_counter()
        with blocking(group, "reading the pair epoch", timeout, store=True):
            current = group.epoch()
        if current != pull.epoch:  # the pair failed since it was asked: the asker gave up
            return
        frame = xfer.announce(group, kv_cache, desc, pull.epoch, timeout)
        num_messages = payload = 0
        if desc.num_blocks:
            num_messages, payload = xfer.send_payload(group, kv_cache, frame, timeout)
        stats = stats_of(desc, num_messages, payload, frame.nbytes, time.perf_counter() - start)
    except BaseException:
        group.fail(pull.epoch)
        raise
    finally:
        serve.exported(desc, stats)


def _answer_to(group: PeerGroup, pull: PullAsk, deadline: float, timeout: float) -> Announcement:
    """The peer's answer to `pull` (answers to earlier asks, given up on, are dropped)."""
    while True:
        if group.closed:
            raise PeerLost(f"peer {group.peer_id!r} was removed while a pull waited for it")
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            raise TransferTimeout(
                f"peer {group.peer_id!r} did not answer pull {pull.pull_id} within {timeout}s"
            )
        with blocking(group, "waiting for a pull's answer", timeout, store=True):
            raw = group.next_announcement(min(remaining, ANSWER_SLICE_S))
        if raw is None:
            continue
        frame = decode_frame(raw)
        if (
            isinstance(frame, Announcement)
            and frame.epoch == pull.epoch
            and frame.descriptor.request_id == pull.pull_id
        ):
            return frame


def _check_answer(pull: PullAsk, desc: TransferDescriptor) -> None:
    """DescriptorError unless desc answers `pull`: leading blocks from pull.start into the
    leading destination blocks, of the same token run."""
    n = desc.num_blocks
    if (
        desc.missing != tuple(range(pull.start, pull.start + n))
        or desc.dst_block_ids != pull.dst_block_ids[:n]
        or desc.num_prompt_tokens != len(pull.token_ids)
    ):
        raise DescriptorError(
            f"blocks {desc.missing} into {desc.dst_block_ids} do not fit the ask "
            f"(blocks from {pull.start} into {pull.dst_block_ids})"
        )
