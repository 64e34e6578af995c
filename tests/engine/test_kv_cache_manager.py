"""KVCacheManager: block tables, prefix hits, slot allocation, caching and freeing."""

from __future__ import annotations

import copy

import pytest

from engine.block_hash import hash_prompt_blocks, root_hash
from engine.block_pool import BlockPool, KVEvent
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams

SEED = "kv-test-seed"
BS = 4


def make(num_blocks: int, enable_caching: bool = True) -> tuple[BlockPool, KVCacheManager]:
    pool = BlockPool(num_blocks, enable_caching)
    return pool, KVCacheManager(pool, BS, SEED)


def make_request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), arrival_time=0.0, cache_salt=salt)


def run_prefill(kv: KVCacheManager, req: Request) -> None:
    """Admit req with its prefix hits and compute all of its tokens in one go."""
    hits = kv.get_computed_blocks(req)
    req.num_computed_tokens = len(hits) * BS
    assert kv.allocate_slots(req, req.num_tokens - req.num_computed_tokens, hits)
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req, req.num_computed_tokens)


def free_order(pool: BlockPool) -> list[int]:
    """Block ids in the order allocation would take them (probed on a copy of the pool)."""
    probe = copy.deepcopy(pool)
    return [b.block_id for b in probe.allocate(probe.num_free_blocks)]


def snapshot(pool: BlockPool, kv: KVCacheManager, rids: list[str]) -> tuple:
    return (
        free_order(pool),
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        {rid: kv.block_ids(rid) for rid in rids},
        kv.num_requests(),
        copy.deepcopy(pool).take_events(),
    )


# ---- get_computed_blocks -------------------------------------------------------------------
@pytest.mark.parametrize(
    "num_tokens, hit_blocks",
    [
        (4, 0),  # one full cached block, but it holds the last token
        (5, 1),
        (8, 1),  # fully cached: the last block is recomputed for its logits
        (9, 2),
        (12, 2),
        (13, 3),
    ],
)
def test_hit_is_capped_so_the_last_token_is_computed(num_tokens, hit_blocks):
    pool, kv = make(8)
    warm = make_request("warm", list(range(13)))
    run_prefill(kv, warm)
    kv.free(warm)
    assert pool.num_cached_blocks == 3
    assert (pool.stats.queries, pool.stats.hits) == (3, 0)  # warm's own lookups
    req = make_request("r", list(range(num_tokens)))
    hits = kv.get_computed_blocks(req)
    assert [b.block_id for b in hits] == [0, 1, 2][:hit_blocks]
    assert pool.stats.queries == 3 + (num_tokens - 1) // BS
    assert pool.stats.hits == hit_blocks
    pool.check_integrity()


def test_get_computed_blocks_takes_no_references_and_fills_block_hashes():
    pool, kv = make(8)
    warm = make_request("warm", list(range(10)))
    run_prefill(kv, warm)
    assert [b.ref_cnt for b in pool.blocks[:3]] == [1, 1, 1]
    req = make_request("r", list(range(8)) + [50, 51, 52])
    hits = kv.get_computed_blocks(req)
    assert [b.block_id for b in hits] == [0, 1]
    assert [b.ref_cnt for b in pool.blocks[:3]] == [1, 1, 1]
    assert req.block_hashes == hash_prompt_blocks(req.token_ids, BS, SEED)
    assert req.block_hashes[:2] == warm.block_hashes[:2]
    assert kv.block_ids("r") == []
    pool.check_integrity()


def test_hit_stops_at_the_first_missing_block():
    pool, kv = make(6)
    warm = make_request("warm", list(range(12)))
    run_prefill(kv, warm)  # blocks 0, 1, 2 cached
    kv.free(warm)  # queue [3, 4, 5, 2, 1, 0]
    taken = pool.allocate(5)  # evicts blocks 2 and 1
    assert [b.block_id for b in taken] == [3, 4, 5, 2, 1]
    # Block 2's content cached again (in block 3): unreachable past the hole at block 1.
    pool.cache_block(taken[0], warm.block_hashes[2], (warm.block_hashes[1], (8, 9, 10, 11), ()))
    pool.free(taken)
    assert pool.cached_hashes() == {warm.block_hashes[0], warm.block_hashes[2]}
    req = make_request("r", list(range(13)))
    assert [x.block_id for x in kv.get_computed_blocks(req)] == [0]
    pool.check_integrity()


def test_a_colliding_hash_with_other_tokens_is_not_a_hit():
    pool, kv = make(4)
    req = make_request("r", list(range(9)))
    kv.update_block_hashes(req)
    (b,) = pool.allocate(1)
    # Block 0's hash registered for different tokens (what a 64-bit collision would look like).
    pool.cache_block(b, req.block_hashes[0], (root_hash(SEED), (9, 9, 9, 9), ()))
    pool.free([b])
    assert pool.cached_hashes() == {req.block_hashes[0]}
    assert kv.get_computed_blocks(req) == []
    assert pool.stats.hits == 0
    pool.check_integrity()


def test_no_hits_when_caching_is_off():
    pool, kv = make(8, enable_caching=False)
    warm = make_request("warm", list(range(10)))
    run_prefill(kv, warm)
    assert pool.num_cached_blocks == 0
    assert warm.block_hashes == []
    kv.free(warm)
    assert kv.get_computed_blocks(make_request("r", list(range(10)))) == []
    assert pool.take_events() == []
    pool.check_integrity()


# ---- allocate_slots ------------------------------------------------------------------------
def test_allocate_slots_grows_the_table_block_by_block():
    pool, kv = make(8)
    req = make_request("r", list(range(6)))
    assert kv.num_blocks_needed(req, 6) == 2
    assert kv.allocate_slots(req, 6)
    assert kv.block_ids("r") == [0, 1]
    req.num_computed_tokens = 6
    for token, expected in [(6, [0, 1]), (7, [0, 1]), (8, [0, 1, 2])]:
        req.token_ids.append(token)
        assert kv.num_blocks_needed(req, 1) == len(expected) - len(kv.block_ids("r"))
        assert kv.allocate_slots(req, 1)
        assert kv.block_ids("r") == expected
        req.num_computed_tokens += 1
    assert kv.num_requests() == 1
    assert pool.num_free_blocks == 5
    pool.check_integrity()


def test_allocate_slots_attaches_hits_before_new_blocks():
    pool, kv = make(8)
    warm = make_request("warm", list(range(9)))
    run_prefill(kv, warm)
    assert kv.block_ids("warm") == [0, 1, 2]
    req = make_request("r", list(range(8)) + [70, 71, 72, 73, 74])
    hits = kv.get_computed_blocks(req)
    req.num_computed_tokens = 8
    # In-use hits take no free-queue slot: only the 2 new blocks count.
    assert kv.num_blocks_needed(req, 5, hits) == 2
    assert kv.allocate_slots(req, 5, hits)
    assert kv.block_ids("r") == [0, 1, 3, 4]
    assert [b.ref_cnt for b in pool.blocks[:5]] == [2, 2, 1, 1, 1]
    pool.check_integrity()


def test_allocate_slots_fails_without_change_when_the_pool_is_short():
    pool, kv = make(4)
    holder = make_request("holder", list(range(100, 108)))
    assert kv.allocate_slots(holder, 8)
    req = make_request("r", list(range(9)))
    before = snapshot(pool, kv, ["holder", "r"])
    assert kv.num_blocks_needed(req, 9) == 3
    assert kv.allocate_slots(req, 9) is False
    assert snapshot(pool, kv, ["holder", "r"]) == before
    assert kv.num_requests() == 1
    assert kv.allocate_slots(req, 8)  # exactly the 2 free blocks
    assert kv.block_ids("r") == [2, 3]
    pool.check_integrity()


def test_evictable_hits_count_against_the_free_queue():
    pool, kv = make(4)
    warm = make_request("warm", list(range(9)))
    run_prefill(kv, warm)
    kv.free(warm)  # queue [3, 2, 1, 0]; blocks 0, 1 cached
    assert pool.num_free_blocks == 4
    req = make_request("r", list(range(8)) + list(range(50, 62)))  # 20 tokens
    hits = kv.get_computed_blocks(req)
    assert [b.block_id for b in hits] == [0, 1]
    req.num_computed_tokens = 8
    # 3 new blocks + 2 hits that leave the free queue = 5 > 4, although 3 <= 4.
    assert kv.num_blocks_needed(req, 12, hits) == 5
    before = snapshot(pool, kv, ["r"])
    assert kv.allocate_slots(req, 12, hits) is False
    assert snapshot(pool, kv, ["r"]) == before
    assert kv.block_ids("r") == []
    # 8 more tokens need 2 new blocks + the 2 hits = 4: fits exactly.
    assert kv.num_blocks_needed(req, 8, hits) == 4
    assert kv.allocate_slots(req, 8, hits)
    assert kv.block_ids("r") == [0, 1, 3, 2]
    assert pool.num_free_blocks == 0
    assert [b.ref_cnt for b in pool.blocks] == [1, 1, 1, 1]
    assert pool.cached_hashes() == set(warm.block_hashes[:2])
    pool.check_integrity()


# ---- cache_blocks --------------------------------------------------------------------------
def test_cache_blocks_registers_only_full_computed_blocks():
    pool, kv = make(8)
    req = make_request("r", list(range(10)))
    assert kv.allocate_slots(req, 10)
    kv.cache_blocks(req, 3)
    assert pool.take_events() == []
    kv.cache_blocks(req, 5)
    h = hash_prompt_blocks(req.token_ids, BS, SEED)
    assert pool.take_events() == [KVEvent("stored", (h[0],), root_hash(SEED))]
    kv.cache_blocks(req, 10)
    assert pool.take_events() == [KVEvent("stored", (h[1],), h[0])]
    kv.cache_blocks(req, 10)  # idempotent
    assert pool.take_events() == []
    assert [b.block_hash for b in kv.blocks("r")] == [h[0], h[1], None]
    # Decoded tokens fill block 2; it is cached once they are computed.
    req.num_computed_tokens = 10
    req.token_ids += [10, 11]
    assert kv.allocate_slots(req, 2)
    kv.cache_blocks(req, 11)
    assert pool.take_events() == []
    kv.cache_blocks(req, 12)
    h2 = hash_prompt_blocks(list(range(12)), BS, SEED)[2]
    assert pool.take_events() == [KVEvent("stored", (h2,), h[1])]
    assert req.block_hashes == [h[0], h[1], h2]
    pool.check_integrity()


def test_concurrent_duplicate_blocks_stay_unhashed():
    pool, kv = make(8)
    a = make_request("a", list(range(8)))
    b = make_request("b", list(range(8)))
    assert kv.allocate_slots(a, 8) and kv.allocate_slots(b, 8)
    kv.cache_blocks(a, 8)
    kv.cache_blocks(b, 8)
    assert [x.block_hash for x in kv.blocks("a")] == a.block_hashes
    assert [x.block_hash for x in kv.blocks("b")] == [None, None]
    assert len(pool.take_events()) == 2
    kv.free(b)
    kv.free(a)
    assert free_order(pool) == [4, 5, 6, 7, 3, 2, 1, 0]
    assert pool.num_cached_blocks == 2
    pool.check_integrity()


# ---- free ----------------------------------------------------------------------------------
def test_free_releases_tail_first_and_drops_shared_references():
    pool, kv = make(8)
    a = make_request("a", list(range(10)))
    run_prefill(kv, a)
    b = make_request("b", list(range(8)) + [40, 41])
    run_prefill(kv, b)
    assert kv.block_ids("a") == [0, 1, 2]
    assert kv.block_ids("b") == [0, 1, 3]
    kv.free(a)
    assert kv.block_ids("a") == []
    assert [x.ref_cnt for x in pool.blocks[:4]] == [1, 1, 0, 1]
    assert free_order(pool) == [4, 5, 6, 7, 2]
    kv.free(b)
    assert free_order(pool) == [4, 5, 6, 7, 2, 3, 1, 0]
    assert kv.num_requests() == 0
    kv.free(b)  # unknown request: nothing to do
    assert pool.num_free_blocks == 8
    pool.check_integrity()


def test_freed_request_starts_over_with_a_fresh_table():
    pool, kv = make(8)
    a = make_request("a", list(range(9)))
    run_prefill(kv, a)
    kv.free(a)
    a.num_computed_tokens = 0  # preempted: recompute from its own cached blocks
    hits = kv.get_computed_blocks(a)
    assert [b.block_id for b in hits] == [0, 1]
    a.num_computed_tokens = 8
    assert kv.allocate_slots(a, 1, hits)
    assert kv.block_ids("a") == [0, 1, 3]
    a.num_computed_tokens = 9
    kv.cache_blocks(a, 9)
    assert [b.ref_cnt for b in pool.blocks[:4]] == [1, 1, 0, 1]
    pool.check_integrity()


# ---- fork (sampling n > 1) -----------------------------------------------------------------
def test_fork_shares_full_blocks_and_copies_the_partial_one():
    pool, kv = make(8)
    parent = make_request("p", list(range(10)))  # blocks: [0..3] [4..7] [8, 9]
    run_prefill(kv, parent)
    assert kv.block_ids("p") == [0, 1, 2]
    assert kv.fork("p", "c1", 10) == [(2, 3)]
    assert kv.fork("p", "c2", 10) == [(2, 4)]
    assert (kv.block_ids("c1"), kv.block_ids("c2")) == ([0, 1, 3], [0, 1, 4])
    assert [b.ref_cnt for b in pool.blocks] == [3, 3, 1, 1, 1, 0, 0, 0]
    pool.check_integrity()
    for rid in ("c2", "p", "c1"):
        kv.free_table(rid)
    assert pool.num_free_blocks == 8
    assert [b.ref_cnt for b in pool.blocks] == [0] * 8
    pool.check_integrity()


def test_fork_of_full_blocks_copies_nothing():
    pool, kv = make(4)
    run_prefill(kv, make_request("p", list(range(8))))
    assert kv.fork("p", "c", 8) == []
    assert kv.block_ids("c") == [0, 1] and [b.ref_cnt for b in pool.blocks] == [2, 2, 0, 0]
    pool.check_integrity()


def test_fork_without_a_free_block_changes_nothing():
    pool, kv = make(3)
    run_prefill(kv, make_request("p", list(range(10))))
    before = snapshot(pool, kv, ["p"])
    assert kv.fork("p", "c", 10) is None
    assert snapshot(pool, kv, ["p"]) == before and kv.block_ids("c") == []
