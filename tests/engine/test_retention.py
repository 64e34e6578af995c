"""Session retention: the blocks of a finished request with retention (session_id, seconds)
are evicted only when no other evictable block is left, until `seconds` after the session's
last request finished; then they are ordinary cached blocks in least-recently-freed order
again. Time is a clock injected into the block pool."""

from __future__ import annotations

import pytest

from engine import InvalidRequestError, LLMEngine, SamplingParams
from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.retention import Retention
from tests.engine.pool_probes import free_order
from tests.engine.requests import make_request
from tests.helpers import random_prompts

BS = 4


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(num_blocks: int, clock: Clock, evicted: list | None = None):
    hook = None if evicted is None else (lambda block: evicted.append(block.block_hash))
    pool = BlockPool(num_blocks, on_evict=hook, clock=clock)
    return pool, KVCacheManager(pool, BS, "retention-test")


def finish(kv: KVCacheManager, rid: str, tokens: list[int], retention=None):
    """Compute and cache `tokens` as one request, then free it as finished; its table."""
    req = make_request(rid, tokens)
    req.retention = retention
    assert kv.allocate_slots(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req, req.num_tokens)
    table = kv.block_ids(rid)
    kv.free(req, finished=True)
    return req, table


def cached(pool: BlockPool, req) -> list[bool]:
    return [h in pool.cached_hashes() for h in req.block_hashes]


def test_retained_blocks_survive_an_eviction_that_lru_would_make():
    clock = Clock()
    pool, kv = make(8, clock)
    chat, chat_ids = finish(kv, "chat", list(range(8)), Retention("s1", 10.0))
    other, other_ids = finish(kv, "other", list(range(100, 108)))
    assert (chat_ids, other_ids) == ([0, 1], [2, 3])
    # LRU order would be 4 5 6 7, then chat's 1 0 (tail first), then other's 3 2.
    assert free_order(pool) == [4, 5, 6, 7, 3, 2, 1, 0]
    assert pool.num_retained() == 2
    big = make_request("big", list(range(200, 224)))  # 6 blocks
    assert kv.allocate_slots(big, 24)
    assert kv.block_ids("big") == [4, 5, 6, 7, 3, 2]  # other's blocks went, chat's did not
    assert cached(pool, chat) == [True, True] and cached(pool, other) == [False, False]
    pool.check_integrity()


def test_after_the_deadline_retained_blocks_are_evicted_in_lru_order_again():
    clock = Clock()
    evicted: list[int] = []
    pool, kv = make(8, clock, evicted)
    chat, _ = finish(kv, "chat", list(range(8)), Retention("s1", 10.0))
    finish(kv, "other", list(range(100, 108)))
    clock.now += 9.999
    assert free_order(pool) == [4, 5, 6, 7, 3, 2, 1, 0]
    clock.now += 0.001  # 10 s after the session's request finished
    assert pool.num_retained() == 0
    assert free_order(pool) == [4, 5, 6, 7, 1, 0, 3, 2]  # exactly the LRU order
    evicted.clear()  # free_order probes a copy that shares the hook
    big = make_request("big", list(range(200, 224)))
    assert kv.allocate_slots(big, 24)
    assert kv.block_ids("big") == [4, 5, 6, 7, 1, 0]
    # chat's blocks were offered to the tier hook when finally evicted, tail first
    assert evicted == [chat.block_hashes[1], chat.block_hashes[0]]
    pool.check_integrity()


def test_retained_blocks_go_last_and_least_recently_freed_first():
    clock = Clock()
    pool, kv = make(4, clock)
    chat, _ = finish(kv, "chat", list(range(8)), Retention("s1", 10.0))  # blocks 0, 1
    req = make_request("r", list(range(300, 312)))  # 3 blocks: 2 free, then 1 retained
    assert kv.allocate_slots(req, 12)
    assert kv.block_ids("r") == [2, 3, 1]  # chat's tail block 1 goes, its head stays
    assert cached(pool, chat) == [True, False]
    pool.check_integrity()


def test_the_sessions_last_request_moves_its_deadline():
    clock = Clock()
    pool, kv = make(8, clock)
    turn1, _ = finish(kv, "t1", list(range(8)), Retention("s1", 10.0))
    clock.now += 8
    # turn 2 starts with turn 1's blocks (hits) and adds one; it finishes now
    turn2 = make_request("t2", list(range(12)))
    hits = kv.get_computed_blocks(turn2)
    turn2.num_computed_tokens = len(hits) * BS
    assert kv.allocate_slots(turn2, turn2.num_tokens - turn2.num_computed_tokens, hits)
    turn2.num_computed_tokens = turn2.num_tokens
    kv.cache_blocks(turn2, 12)
    turn2.retention = Retention("s1", 10.0)
    kv.free(turn2, finished=True)
    clock.now += 5  # 13 s after turn 1, 5 s after turn 2: still retained
    assert pool.num_retained() == 3
    clock.now += 5
    assert pool.num_retained() == 0


def test_a_preempted_request_is_not_retained_and_no_hint_is_plain_lru():
    clock = Clock()
    pool, kv = make(8, clock)
    req = make_request("p", list(range(8)))
    req.retention = Retention("s1", 10.0)
    assert kv.allocate_slots(req, 8)
    req.num_computed_tokens = 8
    kv.cache_blocks(req, 8)
    kv.free(req)  # preempted: not finished
    assert pool.num_retained() == 0
    assert free_order(pool) == [2, 3, 4, 5, 6, 7, 1, 0]


def test_retention_fields_are_checked():
    assert Retention.of(None, None) is None
    assert Retention.of("s", None) is None  # a session id alone asks for nothing here
    with pytest.raises(InvalidRequestError, match="retention_seconds needs a session_id"):
        Retention.of(None, 5.0)
    with pytest.raises(InvalidRequestError, match="retention_seconds=0 is invalid"):
        Retention("s", 0)
    with pytest.raises(InvalidRequestError, match="session_id='' is invalid"):
        Retention("", 5.0)
    with pytest.raises(InvalidRequestError, match="session_id=.* is invalid"):
        Retention("x" * 257, 5.0)
    with pytest.raises(
        InvalidRequestError,
        match="retention_seconds=900 is invalid: at most max_retention_seconds=600",
    ):
        Retention("s", 900).check(600.0)


OPTS = dict(skip_tokenizer_init=True, block_size=BS, chunk_size=16, num_kv_blocks=20)
A, OTHER, B = random_prompts([27, 19, 40], seed=21)
GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)


def computed(engine: LLMEngine, rid: str) -> int:
    """Run to completion; the tokens the model computed for `rid`."""
    n = 0
    while engine.has_unfinished():
        n += engine.step().scheduled.get(rid, 0)
    engine.check_integrity()
    return n


def session_then_traffic(
    engine: LLMEngine, clock: Clock, retention, prefill_only: bool, wait: float
) -> int:
    """a (with `retention`), o, `wait` seconds, then b (whose 11 blocks take a's under LRU);
    returns the tokens a2, a's prompt again, computes."""
    engine.pool.clock = clock
    engine.add_request("a", A, GREEDY, prefill_only=prefill_only, retention=retention)
    computed(engine, "a")
    if prefill_only:  # a prefill worker releases the blocks once the decode side has them
        assert engine.release_held("a")
    engine.add_request("o", OTHER, SHORT)
    computed(engine, "o")
    clock.now += wait
    engine.add_request("b", B, SHORT)
    computed(engine, "b")
    engine.add_request("a2", A, GREEDY)
    return computed(engine, "a2")


@pytest.mark.parametrize("prefill_only", [False, True], ids=["colocated", "prefill-role"])
def test_an_engine_keeps_a_sessions_prefix_through_other_traffic(tiny_llama, prefill_only):
    kept = LLMEngine(tiny_llama, **OPTS)
    lru = LLMEngine(tiny_llama, **OPTS)
    session = Retention("chat", 60.0)
    with_retention = session_then_traffic(kept, Clock(), session, prefill_only, wait=59.0)
    without = session_then_traffic(lru, Clock(), None, prefill_only, wait=59.0)
    assert with_retention == 27 - 24 + 2  # a's 6 full prompt blocks were kept (o's went)
    assert without > with_retention  # plain LRU took a's older blocks


def test_once_retention_ended_an_engine_evicts_exactly_as_lru(tiny_llama):
    expired = LLMEngine(tiny_llama, **OPTS)
    lru = LLMEngine(tiny_llama, **OPTS)
    session = Retention("chat", 60.0)
    assert session_then_traffic(expired, Clock(), session, False, wait=60.0) == (
        session_then_traffic(lru, Clock(), None, False, wait=60.0)
    )
    assert expired.pool.num_retained() == 0
    assert free_order(expired.pool) == free_order(lru.pool)


def test_the_engine_bounds_retention_by_max_retention_seconds(tiny_llama):
    engine = LLMEngine(tiny_llama, **OPTS, max_retention_seconds=30)
    with pytest.raises(
        InvalidRequestError,
        match="retention_seconds=31 is invalid: at most max_retention_seconds=30",
    ):
        engine.add_request("a", A, GREEDY, retention=Retention("chat", 31))
    with pytest.raises(InvalidRequestError, match="max_retention_seconds=30"):
        engine.reserve_remote("r", A, GREEDY, seed=1, retention=Retention("chat", 31))
    assert not engine.has_unfinished() and engine.pool.num_free_blocks == 20
    engine.check_integrity()
    with pytest.raises(InvalidRequestError, match="max_retention_seconds=-1 is invalid"):
        LLMEngine(tiny_llama, **OPTS, max_retention_seconds=-1)
