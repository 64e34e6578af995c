"""BlockPool: ids, reference counts, free order, the prefix-cache map, LRU eviction, events
and check_integrity."""

from __future__ import annotations

import pytest

from engine.block_hash import hash_block
from engine.block_pool import BlockPool, KVBlock, KVEvent
from engine.kv_cache_manager import KVCacheManager
from tests.engine.pool_probes import ROOT, SEED, cache, compute, free_order
from tests.engine.requests import make_request


# ---- allocation, reference counts, free order ---------------------------------------------
def test_pool_needs_a_block():
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        BlockPool(0)


def test_allocate_takes_ids_in_free_queue_order():
    pool = BlockPool(5)
    a = pool.allocate(2)
    assert [b.block_id for b in a] == [0, 1]
    assert [b.ref_cnt for b in a] == [1, 1]
    assert pool.num_free_blocks == 3
    assert pool.usage() == pytest.approx(0.4)
    b = pool.allocate(3)
    assert [x.block_id for x in b] == [2, 3, 4]
    assert pool.num_free_blocks == 0
    assert pool.usage() == 1.0
    assert pool.allocate(0) == []
    pool.check_integrity()


def test_freed_blocks_go_to_the_back_in_the_order_given():
    pool = BlockPool(6)
    blocks = pool.allocate(4)  # 0..3; queue [4, 5]
    pool.free([blocks[2], blocks[0]])
    assert free_order(pool) == [4, 5, 2, 0]
    assert [b.block_id for b in pool.allocate(4)] == [4, 5, 2, 0]
    assert [b.ref_cnt for b in pool.blocks] == [1, 1, 1, 1, 1, 1]
    pool.check_integrity()


def test_touch_and_free_reference_counts():
    pool = BlockPool(4)
    (b0,) = pool.allocate(1)
    pool.touch([b0])
    assert b0.ref_cnt == 2
    pool.free([b0])
    assert b0.ref_cnt == 1
    assert pool.num_free_blocks == 3  # still held: not back in the queue
    assert free_order(pool) == [1, 2, 3]
    pool.free([b0])
    assert b0.ref_cnt == 0
    assert free_order(pool) == [1, 2, 3, 0]
    pool.check_integrity()


def test_touch_pulls_a_cached_block_off_the_free_queue():
    pool = BlockPool(4)
    (b0,) = pool.allocate(1)
    h = cache(pool, b0, ROOT, (1, 2, 3, 4))
    pool.free([b0])
    assert free_order(pool) == [1, 2, 3, 0]
    pool.touch([b0])
    assert b0.ref_cnt == 1
    assert free_order(pool) == [1, 2, 3]
    # Allocating everything left cannot evict the touched block.
    assert [b.block_id for b in pool.allocate(3)] == [1, 2, 3]
    assert pool.cached_hashes() == {h}
    assert pool.lookup(h, (ROOT, (1, 2, 3, 4), ())) is b0
    pool.check_integrity()


def test_double_free_raises():
    pool = BlockPool(4)
    (b0,) = pool.allocate(1)
    pool.free([b0])
    with pytest.raises(RuntimeError, match="double free of block 0"):
        pool.free([b0])
    with pytest.raises(RuntimeError, match="double free of block 3"):
        pool.free([pool.blocks[3]])  # never allocated
    assert [b.ref_cnt for b in pool.blocks] == [0, 0, 0, 0]
    assert free_order(pool) == [1, 2, 3, 0]
    pool.check_integrity()


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(4)
    pool.allocate(1)
    with pytest.raises(RuntimeError, match="cannot allocate 4 blocks: only 3 free"):
        pool.allocate(4)
    assert free_order(pool) == [1, 2, 3]
    assert [b.ref_cnt for b in pool.blocks] == [1, 0, 0, 0]
    pool.check_integrity()


# ---- the prefix-cache map ------------------------------------------------------------------
def test_lookup_rechecks_the_hash_key():
    pool = BlockPool(4)
    (b0,) = pool.allocate(1)
    h = cache(pool, b0, ROOT, (1, 2, 3, 4))
    assert b0.block_hash == h
    assert b0.hash_key == (ROOT, (1, 2, 3, 4), ())
    assert pool.lookup(h, (ROOT, (1, 2, 3, 4), ())) is b0
    # Same hash, different content (a collision): not a hit.
    assert pool.lookup(h, (ROOT, (1, 2, 3, 5), ())) is None
    assert pool.lookup(h, (ROOT + 1, (1, 2, 3, 4), ())) is None
    assert pool.lookup(h, (ROOT, (1, 2, 3, 4), ("salt",))) is None
    assert pool.lookup(h + 1, (ROOT, (1, 2, 3, 4), ())) is None
    assert pool.num_cached_blocks == 1
    pool.check_integrity()


def test_cache_block_on_existing_hash_keeps_the_first_block_canonical():
    pool = BlockPool(4)
    first, second = pool.allocate(2)
    key = (ROOT, (5, 6, 7, 8), ())
    h = cache(pool, first, ROOT, (5, 6, 7, 8))
    pool.cache_block(second, h, key)
    assert first.block_hash == h
    assert second.block_hash is None and second.hash_key is None
    assert pool.lookup(h, key) is first
    assert pool.num_cached_blocks == 1
    assert pool.take_events() == [KVEvent("stored", (h,), ROOT)]
    # Freeing both: only the canonical one stays cached; evicting the duplicate says nothing.
    pool.free([second, first])
    assert free_order(pool) == [2, 3, 1, 0]
    assert [b.block_id for b in pool.allocate(3)] == [2, 3, 1]
    assert pool.take_events() == []
    assert pool.lookup(h, key) is first
    pool.check_integrity()


def test_cache_block_on_an_already_hashed_block_is_a_no_op():
    pool = BlockPool(2)
    (b0,) = pool.allocate(1)
    h1 = cache(pool, b0, ROOT, (1, 1, 1, 1))
    h2 = hash_block(ROOT, (2, 2, 2, 2))
    pool.cache_block(b0, h2, (ROOT, (2, 2, 2, 2), ()))
    assert b0.block_hash == h1
    assert pool.cached_hashes() == {h1}
    assert pool.lookup(h2, (ROOT, (2, 2, 2, 2), ())) is None
    assert pool.take_events() == [KVEvent("stored", (h1,), ROOT)]
    pool.check_integrity()


def test_cache_block_does_nothing_when_caching_is_off():
    pool = BlockPool(2, enable_caching=False)
    (b0,) = pool.allocate(1)
    h = cache(pool, b0, ROOT, (1, 2, 3, 4))
    assert b0.block_hash is None
    assert pool.lookup(h, (ROOT, (1, 2, 3, 4), ())) is None
    assert pool.num_cached_blocks == 0
    assert pool.take_events() == []
    pool.check_integrity()


def test_stored_and_removed_events_in_exact_order():
    pool = BlockPool(3)
    b0, b1 = pool.allocate(2)
    h0 = cache(pool, b0, ROOT, (1, 2, 3, 4))
    h1 = cache(pool, b1, h0, (5, 6, 7, 8))
    assert pool.take_events() == [KVEvent("stored", (h0,), ROOT), KVEvent("stored", (h1,), h0)]
    assert pool.take_events() == []
    pool.free([b1, b0])  # tail first: queue [2, 1, 0]
    assert pool.take_events() == []  # freeing keeps them cached
    assert [b.block_id for b in pool.allocate(1)] == [2]
    assert pool.take_events() == []  # block 2 carried no hash
    assert [b.block_id for b in pool.allocate(2)] == [1, 0]
    assert pool.take_events() == [KVEvent("removed", (h1,)), KVEvent("removed", (h0,))]
    assert pool.stats.evictions == 2
    assert pool.num_cached_blocks == 0
    assert all(b.block_hash is None and b.hash_key is None for b in pool.blocks)
    pool.check_integrity()


def test_reset_prefix_cache():
    pool = BlockPool(4)
    b0, b1, b2 = pool.allocate(3)
    h0 = cache(pool, b0, ROOT, (1, 2, 3, 4))
    h1 = cache(pool, b1, h0, (5, 6, 7, 8))
    pool.take_events()
    pool.free([b1, b2])  # b0 (hashed) still in use
    assert pool.reset_prefix_cache() is False
    assert pool.cached_hashes() == {h0, h1}
    assert pool.take_events() == []
    assert pool.stats.evictions == 0
    pool.free([b0])
    assert free_order(pool) == [3, 1, 2, 0]
    assert pool.reset_prefix_cache() is True
    assert pool.cached_hashes() == set()
    assert pool.take_events() == [KVEvent("removed", (h0,)), KVEvent("removed", (h1,))]
    assert pool.lookup(h0, (ROOT, (1, 2, 3, 4), ())) is None
    assert free_order(pool) == [3, 1, 2, 0]  # queue order untouched
    assert pool.num_free_blocks == 4
    assert pool.reset_prefix_cache() is True  # nothing left: still succeeds
    assert pool.take_events() == []
    pool.check_integrity()


def test_eviction_follows_free_order_tail_first_through_the_manager():
    pool = BlockPool(6)
    kv = KVCacheManager(pool, 2, SEED)
    req = make_request("a", [1, 2, 3, 4, 5, 6])
    compute(kv, req)
    assert kv.block_ids("a") == [0, 1, 2]
    h0, h1, h2 = req.block_hashes
    assert pool.cached_hashes() == {h0, h1, h2}
    kv.free(req)
    assert free_order(pool) == [3, 4, 5, 2, 1, 0]
    pool.take_events()
    assert [b.block_id for b in pool.allocate(4)] == [3, 4, 5, 2]
    assert pool.cached_hashes() == {h0, h1}  # the tail went first
    assert [b.block_id for b in pool.allocate(1)] == [1]
    assert pool.cached_hashes() == {h0}
    assert pool.take_events() == [KVEvent("removed", (h2,)), KVEvent("removed", (h1,))]
    # The head is still a hit for a request sharing the first two tokens.
    other = make_request("b", [1, 2, 9, 9, 9])
    assert [b.block_id for b in kv.get_computed_blocks(other)] == [0]
    pool.check_integrity()


# ---- check_integrity -----------------------------------------------------------------------
def _pool_with_every_state() -> tuple[BlockPool, list[KVBlock]]:
    """Block 0 cached, block 1 in use and hashed, block 2 in use, block 3 free."""
    pool = BlockPool(4)
    b0, b1, b2 = pool.allocate(3)
    h0 = cache(pool, b0, ROOT, (1, 2, 3, 4))
    cache(pool, b1, h0, (5, 6, 7, 8))
    pool.free([b0])
    return pool, [b0, b1, b2, pool.blocks[3]]


def test_check_integrity_passes_on_a_consistent_pool():
    pool, _ = _pool_with_every_state()
    pool.check_integrity()


def _ref_on_free_block(pool: BlockPool, b: list[KVBlock]) -> None:
    b[3].ref_cnt = 1


def _negative_ref(pool: BlockPool, b: list[KVBlock]) -> None:
    b[3].ref_cnt = -1


def _in_use_swapped_with_free(pool: BlockPool, b: list[KVBlock]) -> None:
    b[2].ref_cnt, b[3].ref_cnt = 0, 1  # counts still add up; the queue holds the wrong block


def _stray_hash(pool: BlockPool, b: list[KVBlock]) -> None:
    b[3].block_hash = 12345


def _map_points_elsewhere(pool: BlockPool, b: list[KVBlock]) -> None:
    pool._cached[b[0].block_hash] = b[2]


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (_ref_on_free_block, "free queue holds 2 blocks, expected 1"),
        (_negative_ref, r"free 0 \+ cached 1 \+ in use 2 != total 4"),
        (_in_use_swapped_with_free, "a block with ref_cnt 0 is missing from the free queue"),
        (_stray_hash, "3 blocks carry a hash, map has 2"),
        (_map_points_elsewhere, "cache map entry .* points at block 2"),
    ],
)
def test_check_integrity_raises_on_corruption(corrupt, message):
    pool, blocks = _pool_with_every_state()
    corrupt(pool, blocks)
    with pytest.raises(AssertionError, match=message):
        pool.check_integrity()
