"""Both KV tier backends (host, disk): exact round trips, LRU eviction under a byte bound,
the bounded write queue, pinning by loads, hash-key checks, events and counters."""

from __future__ import annotations

import io

import pytest
import torch

from engine.block_pool import KVEvent
from engine.kv_tier import BlockDestination, DiskTier, HostTier, block_views
from engine.kv_tier.file_format import make_header, tensor_bytes, write_block
from tests.engine.kv_tier_helpers import (
    BLOCK_BYTES,
    IDENTITY,
    H,
    block_of,
    empty_cache,
    load,
    paged_cache,
    same_bytes,
    store,
)


def entry_bytes(kind: str) -> int:
    """What one block occupies in a tier of this kind (a disk file: header + payload)."""
    if kind == "host":
        return BLOCK_BYTES
    payload = tensor_bytes(torch.zeros(IDENTITY.block_shape))
    return write_block(io.BytesIO(), make_header(IDENTITY, H[0], payload), payload)


@pytest.fixture(params=["host", "disk"])
def make_tier(request, tmp_path):
    """make_tier(capacity in blocks, **kw) -> a tier of the parametrized kind, closed after."""
    tiers = []

    def make(blocks: int, **kw):
        capacity = blocks * entry_bytes(request.param)
        if request.param == "host":
            tier = HostTier(IDENTITY, capacity, **kw)
        else:
            tier = DiskTier(IDENTITY, capacity, tmp_path / "tier", **kw)
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        tier.close()


def test_round_trip_is_exact_bytes(make_tier):
    tier = make_tier(4)
    kv = paged_cache(seed=3)
    store(tier, kv, [(H[0], 1), (H[1], 4), (H[2], 6)])
    dst = empty_cache()
    assert load(tier, [H[0], H[1], H[2]], dst, [7, 0, 3]) == 3
    for src_id, dst_id in [(1, 7), (4, 0), (6, 3)]:
        assert same_bytes(block_of(dst, dst_id), block_of(kv, src_id))
    for untouched in (1, 2, 4, 5, 6):
        assert torch.count_nonzero(block_of(dst, untouched)) == 0
    s = tier.stats()
    size = entry_bytes(s.medium)
    assert (s.blocks_written, s.bytes_written, s.usage_bytes, s.num_blocks) == (
        3,
        3 * size,
        3 * size,
        3,
    )
    assert (s.loads, s.blocks_read, s.bytes_read) == (1, 3, 3 * BLOCK_BYTES)
    assert s.load_seconds > 0
    tier.check_integrity()


def test_stored_copy_is_a_snapshot_taken_at_offer(make_tier):
    # The device block is reused at once after eviction: what the tier stores is its KV at
    # the time of the offer, not what the block holds later.
    tier = make_tier(2)
    kv = paged_cache(seed=4)
    before = block_of(kv, 2)
    tier.pause_writes()
    assert tier.offer(H[0], block_views(kv, 2))
    for layer in kv:
        layer[:, 2].fill_(7.0)
    tier.resume_writes()
    assert tier.flush(timeout=30)
    dst = empty_cache()
    assert load(tier, [H[0]], dst, [5]) == 1
    assert same_bytes(block_of(dst, 5), before)


def test_lookup_counts_leading_held_hashes(make_tier):
    tier = make_tier(4)
    kv = paged_cache()
    store(tier, kv, [(H[0], 0), (H[1], 1), (H[3], 3)])
    assert tier.lookup([H[0], H[1], H[2], H[3]]) == 2
    assert tier.lookup([H[2], H[3]]) == 0
    assert tier.lookup([H[3]]) == 1
    assert tier.lookup([]) == 0
    s = tier.stats()
    assert (s.queries, s.hits) == (7, 3)


def test_lru_eviction_order_under_the_byte_bound(make_tier):
    tier = make_tier(3)
    kv = paged_cache()
    store(tier, kv, [(H[0], 0), (H[1], 1), (H[2], 2)])
    assert tier.held_hashes() == [H[0], H[1], H[2]]
    assert load(tier, [H[0]], empty_cache(), [0]) == 1  # H0 becomes most recently used
    assert tier.held_hashes() == [H[1], H[2], H[0]]
    store(tier, kv, [(H[3], 3)])
    assert tier.held_hashes() == [H[2], H[0], H[3]]
    store(tier, kv, [(H[4], 4)])
    assert tier.held_hashes() == [H[0], H[3], H[4]]
    m = tier.medium
    assert tier.take_events() == [
        KVEvent("stored", (H[0],), medium=m),
        KVEvent("stored", (H[1],), medium=m),
        KVEvent("stored", (H[2],), medium=m),
        KVEvent("removed", (H[1],), medium=m),
        KVEvent("stored", (H[3],), medium=m),
        KVEvent("removed", (H[2],), medium=m),
        KVEvent("stored", (H[4],), medium=m),
    ]
    s = tier.stats()
    assert (s.evictions, s.num_blocks, s.usage_bytes) == (2, 3, 3 * entry_bytes(m))
    assert tier.lookup([H[1]]) == 0 and tier.lookup([H[0]]) == 1
    tier.check_integrity()


def test_a_load_marks_its_blocks_used_tail_first(make_tier):
    # The head of a prefix is the most shareable: after a load it is evicted last.
    tier = make_tier(4)
    kv = paged_cache()
    store(tier, kv, [(H[0], 0), (H[1], 1), (H[2], 2), (H[3], 3)])
    assert load(tier, [H[0], H[1]], empty_cache(), [4, 5]) == 2
    assert tier.held_hashes() == [H[2], H[3], H[1], H[0]]


def test_a_full_write_queue_drops_the_block_and_counts_it(make_tier):
    tier = make_tier(8, write_queue_blocks=2)
    kv = paged_cache()
    tier.pause_writes()
    assert tier.offer(H[0], block_views(kv, 0))
    assert tier.offer(H[1], block_views(kv, 1))
    assert not tier.offer(H[2], block_views(kv, 2))  # returns at once: the queue is full
    assert tier.stats().dropped_writes == 1
    assert tier.held_hashes() == []  # nothing stored while paused
    assert not tier.flush(timeout=0.05)
    tier.resume_writes()
    assert tier.flush(timeout=30)
    assert tier.held_hashes() == [H[0], H[1]]
    assert tier.offer(H[2], block_views(kv, 2))  # room again
    assert tier.flush(timeout=30)
    s = tier.stats()
    assert (s.dropped_writes, s.blocks_written) == (1, 3)


def test_offering_a_held_block_marks_it_used_and_writes_nothing(make_tier):
    tier = make_tier(3)
    kv = paged_cache()
    store(tier, kv, [(H[0], 0), (H[1], 1)])
    assert not tier.offer(H[0], block_views(kv, 5))
    assert tier.flush(timeout=30)
    assert tier.held_hashes() == [H[1], H[0]]
    assert tier.stats().blocks_written == 2
    dst = empty_cache()
    assert load(tier, [H[0]], dst, [0]) == 1
    assert same_bytes(block_of(dst, 0), block_of(kv, 0))  # the first copy, not block 5


def test_blocks_of_a_pending_load_are_not_evicted(make_tier):
    tier = make_tier(2)
    kv = paged_cache()
    store(tier, kv, [(H[0], 0), (H[1], 1)])
    tier.pause_loads()
    dst = empty_cache()
    handle = tier.load_async([H[0], H[1]], BlockDestination(dst, [6, 7]))
    assert handle.num_blocks == 2 and not handle.done()
    store(tier, kv, [(H[2], 2)])  # no room: both held blocks are pinned
    assert tier.stats().rejected_writes == 1
    assert tier.held_hashes() == [H[1], H[0]]
    tier.resume_loads()
    assert handle.wait(timeout=30) and handle.num_loaded == 2
    assert same_bytes(block_of(dst, 6), block_of(kv, 0))
    store(tier, kv, [(H[2], 2)])  # unpinned now: H1 (least recently used) goes
    assert tier.held_hashes() == [H[0], H[2]]


def test_cancelled_load_loads_nothing_and_unpins(make_tier):
    tier = make_tier(2)
    kv = paged_cache()
    store(tier, kv, [(H[0], 0), (H[1], 1)])
    tier.pause_loads()
    dst = empty_cache()
    handle = tier.load_async([H[0], H[1]], BlockDestination(dst, [2, 3]))
    handle.cancel()
    tier.resume_loads()
    assert handle.wait(timeout=30) and handle.num_loaded == 0
    assert torch.count_nonzero(torch.stack(dst)) == 0
    store(tier, kv, [(H[2], 2)])  # evicts: nothing is pinned any more
    assert tier.stats().evictions == 1


def test_load_takes_only_the_leading_held_blocks(make_tier):
    tier = make_tier(4)
    kv = paged_cache()
    store(tier, kv, [(H[0], 0), (H[2], 2)])
    handle = tier.load_async([H[0], H[1], H[2]], BlockDestination(empty_cache(), [0, 1, 2]))
    assert handle.num_blocks == 1 and handle.block_hashes == (H[0],)
    assert handle.wait(timeout=30) and handle.num_loaded == 1
    nothing = tier.load_async([H[5]], BlockDestination(empty_cache(), [0]))
    assert nothing.done() and nothing.num_loaded == 0


def test_hash_keys_are_rechecked(make_tier):
    tier = make_tier(2)
    kv = paged_cache()
    key = (H[9], (1, 2, 3, 4), ())
    assert tier.offer(H[0], block_views(kv, 0), parent_hash=H[9], hash_key=key)
    assert tier.flush(timeout=30)
    assert tier.lookup([H[0]], [key]) == 1
    assert tier.lookup([H[0]], [(H[9], (1, 2, 3, 5), ())]) == 0  # a collision is a miss
    assert tier.lookup([H[0]], [(H[9], (1, 2, 3, 4), ("salt",))]) == 0
    assert tier.lookup([H[0]]) == 1  # no keys given: hash only
    miss = tier.load_async([H[0]], BlockDestination(empty_cache(), [0]), [(0, (1,), ())])
    assert miss.num_blocks == 0
    assert tier.take_events() == [KVEvent("stored", (H[0],), H[9], medium=tier.medium)]


def test_a_block_over_capacity_is_rejected(make_tier):
    tier = make_tier(1)
    tier_small = tier.stats().capacity_bytes
    assert tier_small == entry_bytes(tier.medium)
    store(tier, paged_cache(), [(H[0], 0), (H[1], 1)])  # the second evicts the first
    assert tier.held_hashes() == [H[1]]


def test_offer_rejects_blocks_of_another_shape(make_tier):
    tier = make_tier(2)
    kv = paged_cache()
    with pytest.raises(ValueError, match="1 layers offered, this tier stores 2"):
        tier.offer(H[0], block_views(kv, 0)[:1])
    with pytest.raises(ValueError, match="this tier stores"):
        tier.offer(H[0], [v.to(torch.bfloat16) for v in block_views(kv, 0)])


def test_close_finishes_queued_writes(make_tier):
    tier = make_tier(4)
    kv = paged_cache()
    tier.pause_writes()
    assert tier.offer(H[0], block_views(kv, 0))
    tier.close()
    assert tier.stats().blocks_written == 1
    assert not tier.offer(H[1], block_views(kv, 1))  # closed
    assert tier.load_async([H[0]], BlockDestination(empty_cache(), [0])).num_blocks == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_cache_round_trip_orders_copies_with_the_compute_stream(make_tier):
    # Copy out, then overwrite the block at once on the compute stream (its reuse), then load
    # other blocks' KV into it: each copy must see the stream's order.
    tier = make_tier(4)
    kv = [t.cuda() for t in paged_cache(seed=6)]
    before = [block_of(kv, i).cpu() for i in range(3)]
    assert tier.offer(H[0], block_views(kv, 0))
    assert tier.offer(H[1], block_views(kv, 1))
    for layer in kv:
        layer[:, 0].fill_(3.0)  # block 0 reused right after its offer
    assert tier.flush(timeout=30)
    assert load(tier, [H[1], H[0]], kv, [0, 2]) == 2  # block 0 now gets H1's KV
    torch.cuda.synchronize()
    assert same_bytes(block_of(kv, 0).cpu(), before[1])
    assert same_bytes(block_of(kv, 2).cpu(), before[0])
