"""The scheduler with a KV tier, driven without a model: exact block ids of evictions offered
to the tier, of the blocks a tier hit loads into, and of the wait for them."""

from __future__ import annotations

from engine.block_hash import hash_prompt_blocks
from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.kv_tier import HostTier
from engine.kv_tier.connector import TierConnector
from engine.request import RequestStatus
from engine.scheduler import Scheduler, SchedulerConfig
from tests.engine.kv_tier_helpers import (
    BLOCK_BYTES,
    IDENTITY,
    block_of,
    empty_cache,
    load,
    paged_cache,
    same_bytes,
)
from tests.engine.test_scheduler import OUTPUT_TOKEN, check, make_request, step

BS = IDENTITY.block_size  # 4


def make(num_blocks: int = 8, chunk: int = 16):
    kv_caches = paged_cache(num_blocks, seed=9)  # stands in for the model's KV writes
    tier = HostTier(IDENTITY, 16 * BLOCK_BYTES)
    connector = TierConnector(tier, kv_caches)
    pool = BlockPool(num_blocks, on_evict=connector.on_evict)
    kv = KVCacheManager(pool, BS, IDENTITY.hash_seed)
    sched = Scheduler(SchedulerConfig(64, chunk, 16), kv, tier=connector)
    return sched, tier, kv_caches


def run(sched: Scheduler) -> None:
    while sched.has_unfinished():
        step(sched)


def test_evicted_blocks_go_to_the_tier_and_a_hit_loads_into_fresh_blocks():
    sched, tier, kv_caches = make()
    a_tokens = list(range(1, 14))  # 13 tokens: 3 full blocks before the last token
    sched.add(make_request("a", a_tokens, max_tokens=1))
    run(sched)
    hashes = hash_prompt_blocks(a_tokens, BS, IDENTITY.hash_seed)
    assert sorted(sched.kv.pool.cached_hashes()) == sorted(hashes)  # blocks 0, 1, 2
    a_kv = {h: block_of(kv_caches, i) for i, h in enumerate(hashes)}

    # b takes all 8 blocks: the free queue is [4..7, 3, 2, 1, 0] (a freed tail first), so
    # a's blocks 2, 1, 0 are evicted in that order and offered to the tier.
    sched.add(make_request("b", range(100, 131), max_tokens=1))
    out, _ = step(sched)
    assert sched.kv.block_ids("b") == [4, 5, 6, 7]
    run(sched)
    assert tier.flush(timeout=30)
    assert tier.held_hashes() == [hashes[2], hashes[1], hashes[0]]
    copy = empty_cache()
    assert load(tier, hashes, copy, [0, 1, 2]) == 3
    for i, h in enumerate(hashes):
        assert same_bytes(block_of(copy, i), a_kv[h])

    # a2 repeats a: no device hit, 3 tier hits, loaded into the first blocks off the queue.
    tier.pause_loads()
    a2 = make_request("a2", a_tokens, max_tokens=2)
    c = make_request("c", [500, 501], max_tokens=1)
    sched.add(a2)
    sched.add(c)
    out, sampled = step(sched)  # c runs (and finishes) while a2 waits
    assert out.num_tokens == {"c": 2} and sampled == ["c"]
    assert a2.status == RequestStatus.WAITING_FOR_TIER_KV and a2.num_computed_tokens == 0
    # b freed its table [4, 5, 6, 7, 3, 2, 1, 0] tail first: a2 takes 0, 1, 2; c took 3.
    dst = sched.kv.block_ids("a2")
    assert dst == [0, 1, 2] and sched.kv.pool.num_free_blocks == 5
    assert all(sched.kv.pool.blocks[b].block_hash is None for b in dst)  # not cached yet
    assert sched.has_unfinished() and not sched.waiting and sched.running == []
    tier.resume_loads()
    sched.tier.wait_any(timeout=30)
    out, sampled = step(sched)
    assert out.num_tokens == {"a2": 1} and sampled == ["a2"]  # 12 tokens loaded, 1 computed
    assert a2.num_cached_tokens == 12
    assert sched.kv.block_ids("a2")[:3] == dst
    for i, h in enumerate(hashes):
        assert sched.kv.pool.blocks[dst[i]].block_hash == h
        assert same_bytes(block_of(kv_caches, dst[i]), a_kv[h])
    out, sampled = step(sched)
    assert out.num_tokens == {"a2": 1} and a2.status == RequestStatus.FINISHED_LENGTH
    assert a2.output_token_ids == [OUTPUT_TOKEN, OUTPUT_TOKEN + 1]
    check(sched)
    tier.close()


def test_tier_hits_that_do_not_fit_the_free_blocks_are_computed_instead():
    sched, tier, _ = make(num_blocks=6, chunk=4)
    a_tokens = list(range(1, 14))
    sched.add(make_request("a", a_tokens, max_tokens=1))
    run(sched)
    sched.add(make_request("b", range(100, 121), max_tokens=1))  # 6 blocks: evicts a's 3
    run(sched)
    assert tier.flush(timeout=30)
    hashes = hash_prompt_blocks(a_tokens, BS, IDENTITY.hash_seed)
    assert set(hashes) <= set(tier.held_hashes())
    hog = make_request("hog", range(200, 212), max_tokens=50)  # 12 tokens: 3 blocks, then 4
    sched.add(hog)
    for _ in range(4):
        step(sched)
    assert len(sched.kv.block_ids("hog")) == 4  # 2 blocks free: fewer than a2's 3 tier hits
    a2 = make_request("a2", a_tokens, max_tokens=1)
    sched.add(a2)
    out, _ = step(sched)
    assert out.num_tokens == {"hog": 1, "a2": 4}  # admitted as without a tier: one chunk
    assert a2.status == RequestStatus.RUNNING and a2.num_cached_tokens == 0
    assert tier.stats().loads == 0
    check(sched)
    tier.close()
