"""Pulls over a pair, both sides in this process: the host asks, the joined side answers inside
recv() from the blocks it holds; block contents arrive exactly, in order with forward
transfers on the same pair; an unanswered ask times out and leaves the pair usable."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from kvtransfer import (
    DescriptorError,
    PeerLost,
    PullAsk,
    TransferDescriptor,
    TransferError,
    TransferStats,
    TransferTimeout,
)
from kvtransfer.announcement import decode_frame
from tests.helpers import wait_until
from tests.kvtransfer.peer import BLOCK_SHAPE, LAYERS, make_cache, make_descriptor
from tests.kvtransfer.test_group import Background, Pair

BS = BLOCK_SHAPE[0]
NUM_BLOCKS = 6  # blocks of the token run in these tests
TOKENS = tuple(range(100, 100 + NUM_BLOCKS * BS))
HASHES = tuple(0xABC0 + i for i in range(NUM_BLOCKS))


class Holder:
    """The joined side's answers: it holds blocks `held` (block index -> its block id) and
    records what it exported and when it was told the answer ended."""

    def __init__(self, held: dict[int, int]) -> None:
        self.held = held
        self.pinned: set[int] = set()
        self.done: list[tuple[TransferDescriptor, TransferStats | None]] = []

    def export(self, ask: PullAsk) -> TransferDescriptor:
        ids = []
        for i in range(ask.start, ask.start + len(ask.dst_block_ids)):
            if i not in self.held:
                break
            ids.append(self.held[i])
        self.pinned |= set(ids)
        return ask.describe(ids, (0, LAYERS), "float32", BLOCK_SHAPE)

    def exported(self, desc: TransferDescriptor, stats: TransferStats | None) -> None:
        self.pinned -= set(desc.src_block_ids)
        self.done.append((desc, stats))


def ask(start: int, dst: list[int], pull_id: str = "pull-1") -> PullAsk:
    return PullAsk(pull_id, HASHES, TOKENS, None, start, dst)


@pytest.fixture(params=["packed", "runs"])
def pair(request) -> Iterator[Pair]:
    p = Pair(min_run_bytes=0) if request.param == "runs" else Pair()
    if request.param == "runs":  # head-major caches, as the engine's: regions go zero-copy
        p.src = make_cache(16, seed=1, head_major=True)
        p.dst = make_cache(12, seed=2, head_major=True)
    yield p
    p.close()


def serve(pair: Pair, holder: Holder, wait: float = 3.0) -> Background:
    """The joined side's receive loop for `wait` seconds (answers asks meanwhile)."""
    return Background(lambda: pair.rx.recv("P", pair.dst, wait=wait, serve=holder))


def assert_pulled(pair: Pair, desc: TransferDescriptor) -> None:
    """The host's destination blocks hold the joined side's source blocks, bit for bit."""
    for layer in range(LAYERS):
        for s, d in zip(desc.src_block_ids, desc.dst_block_ids, strict=True):
            assert torch.equal(
                pair.src[layer][:, d].view(torch.int32), pair.dst[layer][:, s].view(torch.int32)
            )


def test_a_pull_moves_the_leading_held_blocks_exactly(pair):
    holder = Holder({2: 7, 3: 1, 4: 2})  # blocks 2..4 of the run (block 5 not held)
    answering = serve(pair, holder, wait=2.0)
    before = [layer.clone() for layer in pair.src]
    desc, stats = pair.tx.pull("D", pair.src, ask(2, [10, 11, 12, 13]))
    assert (desc.missing, desc.src_block_ids, desc.dst_block_ids) == (
        (2, 3, 4),
        (7, 1, 2),
        (10, 11, 12),
    )
    assert stats.num_blocks == 3 and stats.payload_bytes == desc.payload_bytes
    assert_pulled(pair, desc)
    for layer, old in zip(pair.src, before, strict=True):  # no other block was written
        keep = [b for b in range(16) if b not in (10, 11, 12)]
        assert torch.equal(layer[:, keep], old[:, keep])
    with pytest.raises(TransferTimeout):  # no forward transfer came in the wait
        answering.result()
    assert holder.pinned == set()
    ((done, done_stats),) = holder.done
    assert done == desc and done_stats.payload_bytes == stats.payload_bytes


def test_an_answer_with_no_blocks_moves_nothing(pair):
    holder = Holder({})
    answering = serve(pair, holder, wait=1.0)
    before = [layer.clone() for layer in pair.src]
    desc, stats = pair.tx.pull("D", pair.src, ask(0, [3, 4]))
    assert desc.num_blocks == 0 and stats.payload_bytes == 0
    assert all(torch.equal(a, b) for a, b in zip(pair.src, before, strict=True))
    with pytest.raises(TransferTimeout):
        answering.result()
    assert holder.done[0][1] is not None


def test_pulls_and_forward_transfers_share_the_pair_in_order(pair):
    holder = Holder({0: 5, 1: 6})
    answering = serve(pair, holder, wait=5.0)
    desc, _ = pair.tx.pull("D", pair.src, ask(0, [14, 15], "pull-a"))
    forward = make_descriptor("fwd", [3, 4], [8, 9])
    pair.tx.send("D", pair.src, forward)  # the same recv() call receives it after the pull
    got, _ = answering.result()
    assert got == forward
    pair.assert_moved(forward)
    assert_pulled(pair, desc)
    # and once more: the group built for the first pull serves both directions
    answering = serve(pair, holder, wait=1.0)
    again, _ = pair.tx.pull("D", pair.src, ask(1, [13], "pull-b"))
    assert again.src_block_ids == (6,)
    with pytest.raises(TransferTimeout):
        answering.result()


def test_an_unanswered_pull_times_out_and_the_pair_recovers(pair):
    start = time.perf_counter()
    with pytest.raises(TransferTimeout, match="did not answer pull pull-1"):
        pair.tx.pull("D", pair.src, ask(0, [2, 3]), timeout=0.5)  # nobody receives
    assert time.perf_counter() - start < 2.0
    # The ask still waits in the queue; its epoch failed, so the joined side skips it and the
    # next transfer goes through.
    holder = Holder({0: 1})
    sending = pair.send(make_descriptor("after", [2], [3]))
    got, _ = pair.rx.recv("P", pair.dst, wait=5.0, serve=holder)
    sending.result()
    assert got.request_id == "after" and holder.done == []


class SlowHolder(Holder):
    """A Holder whose export, once it pinned, waits for `release`."""

    def __init__(self, held: dict[int, int], release: threading.Event) -> None:
        super().__init__(held)
        self.release = release

    def export(self, ask: PullAsk) -> TransferDescriptor:
        desc = super().export(ask)
        assert self.release.wait(10)
        return desc


def test_an_answer_whose_asker_left_unpins_its_blocks(pair):
    release = threading.Event()
    holder = SlowHolder({0: 3, 1: 4}, release)
    answering = serve(pair, holder, wait=10.0)
    asking = Background(lambda: pair.tx.pull("D", pair.src, ask(0, [5, 6]), timeout=10.0))
    wait_until(lambda: holder.pinned == {3, 4})  # the ask arrived and was pinned
    pair.host.remove("D")  # the asking side leaves (its store goes with it) ...
    with pytest.raises(PeerLost, match="removed while a pull waited"):
        asking.result()
    release.set()  # ... before the answer goes out
    with pytest.raises(TransferError):
        answering.result()
    assert holder.pinned == set()
    assert [stats for _, stats in holder.done] == [None]  # told the answer failed


def test_only_the_host_pulls_and_destinations_must_fit(pair):
    with pytest.raises(TransferError, match="only the host side"):
        pair.rx.pull("P", pair.dst, ask(0, [0]))
    with pytest.raises(DescriptorError, match=r"pull destination block ids \[40\]"):
        pair.tx.pull("D", pair.src, ask(0, [40]))


def test_pull_asks_are_checked_on_both_ends():
    with pytest.raises(DescriptorError, match="must be whole blocks"):
        PullAsk("p", HASHES, TOKENS[:-1], None, 0, [1])
    with pytest.raises(DescriptorError, match="does not fit 6 blocks"):
        PullAsk("p", HASHES, TOKENS, None, 4, [1, 2, 3])
    with pytest.raises(DescriptorError, match="duplicate"):
        PullAsk("p", HASHES, TOKENS, None, 0, [1, 1])
    a = PullAsk("p", HASHES, TOKENS, "salt", 1, [4, 5], epoch=3)
    assert decode_frame(a.encode()) == a
    assert a.describe([9], (0, LAYERS), "float32", BLOCK_SHAPE).missing == (1,)
