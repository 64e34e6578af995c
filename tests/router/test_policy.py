"""Prefill and decode worker choice: exact picks for every policy, LoadTracker."""

from __future__ import annotations

import threading

import pytest

from engine.block_hash import hash_prompt_blocks
from engine.block_pool import KVEvent
from router.kv_index import KVIndex
from router.policy import (
    DEFAULT_POLICY,
    POLICIES,
    DecodeLoad,
    LoadTracker,
    NoWorkerAvailable,
    PrefillChoice,
    WorkerLoad,
    choose_decode,
    choose_prefill,
    make_policy,
)

SEED = "router-test-seed"
BS = 16
SYSTEM_TOKENS = 1024  # 64 blocks


def system_prompt(family: int) -> list[int]:
    return [family * 100_000 + t for t in range(SYSTEM_TOKENS)]


def request(family: int, user: int, n_user: int = 40) -> tuple[list[int], int]:
    """(block hashes, prompt length) of a system prompt of `family` + a distinct user turn."""
    tokens = system_prompt(family) + [50_000 + user * 1000 + t for t in range(n_user)]
    return hash_prompt_blocks(tokens, BS, SEED), len(tokens)


def index_with(**workers: list[int]) -> KVIndex:
    index = KVIndex()
    for w, hashes in workers.items():
        index.add_worker(w)
        index.apply(w, [KVEvent("stored", tuple(hashes))])
    return index


def loads(**queued: int) -> list[WorkerLoad]:
    return [WorkerLoad(w, queued_prefill_tokens=q) for w, q in queued.items()]


def pick(policy, hashes, n_tokens, workers, index) -> str:
    return choose_prefill(policy, hashes, BS, workers, index, num_prompt_tokens=n_tokens).worker_id


SYS0 = hash_prompt_blocks(system_prompt(0), BS, SEED)
SYS1 = hash_prompt_blocks(system_prompt(1), BS, SEED)


# ---- cache_aware ---------------------------------------------------------------------------
def test_cache_aware_is_the_default_and_registry_is_explicit():
    assert DEFAULT_POLICY == "cache_aware"
    assert sorted(POLICIES) == ["cache_aware", "least_loaded", "random", "round_robin"]
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'.*cache_aware"):
        make_policy("fastest")


def test_two_system_prompts_split_across_two_workers():
    """Cold start: the two families land on different workers, then stick to them."""
    index, tracker = index_with(a=[], b=[]), LoadTracker()
    workers = ["a", "b"]

    def route(family: int, user: int) -> PrefillChoice:
        hashes, n = request(family, user)
        current = [WorkerLoad(w, tracker.queued(w)) for w in workers]
        choice = choose_prefill("cache_aware", hashes, BS, current, index, num_prompt_tokens=n)
        tracker.dispatched(choice.worker_id, n - choice.cached_tokens)
        return choice

    # Nothing cached: a wins the tie on id; b then wins because a has a queue.
    assert route(0, 0) == ("a", 0)
    assert route(1, 0) == ("b", 0)
    # Both prefills finish; each worker publishes the blocks it now caches.
    for w, fam in (("a", 0), ("b", 1)):
        index.apply(w, [KVEvent("stored", tuple(request(fam, 0)[0]))])
        tracker.prefilled(w, tracker.queued(w))
    # A burst of both families with nothing finishing: every request goes to its family's
    # worker, and both workers stay busy.
    picks = [route(fam, user) for user in range(1, 6) for fam in (0, 1)]
    assert picks == [("a", SYSTEM_TOKENS), ("b", SYSTEM_TOKENS)] * 5
    assert tracker.snapshot() == {"a": 5 * 40, "b": 5 * 40}


@pytest.mark.parametrize("queued_b", [0, 100, 700])
def test_hot_prompt_moves_off_the_cache_holder_when_its_queue_exceeds_the_savings(queued_b):
    hashes, n = request(0, 1)
    index = index_with(a=SYS0, b=[])
    saved = SYSTEM_TOKENS  # the 64 system blocks cached on a
    assert choose_prefill(
        "cache_aware", hashes, BS, loads(a=0, b=queued_b), index, num_prompt_tokens=n
    ) == ("a", saved)
    # score(a) = n - saved + qa, score(b) = n + qb: a wins while qa < saved + qb, and the
    # tie at equality goes to the shorter queue (b).
    switch = next(
        q
        for q in range(0, 4 * SYSTEM_TOKENS)
        if pick("cache_aware", hashes, n, loads(a=q, b=queued_b), index) == "b"
    )
    assert switch == saved + queued_b
    assert choose_prefill(
        "cache_aware", hashes, BS, loads(a=switch, b=queued_b), index, num_prompt_tokens=n
    ) == ("b", 0)


def test_partial_prefix_and_ties():
    hashes, n = request(0, 1)
    index = index_with(a=SYS0[:10], b=SYS0[:20], c=SYS0[:20])
    # b and c save 320 tokens, a saves 160: a needs queue < -160 to win, never.
    assert pick("cache_aware", hashes, n, loads(a=0, b=50, c=50), index) == "b"  # id breaks tie
    assert pick("cache_aware", hashes, n, loads(a=0, b=50, c=49), index) == "c"
    # a (160 saved, queue 0) vs b (320 saved, queue 160): equal score, a has the shorter queue.
    assert pick("cache_aware", hashes, n, loads(a=0, b=160, c=500), index) == "a"
    assert pick("cache_aware", hashes, n, loads(a=0, b=159, c=500), index) == "b"


def test_the_last_token_of_a_prompt_is_never_counted_as_cached():
    hashes = SYS0  # exactly 64 full blocks, all cached on a
    index = index_with(a=SYS0, b=[])
    assert choose_prefill(
        "cache_aware", hashes, BS, loads(a=0, b=0), index, num_prompt_tokens=SYSTEM_TOKENS
    ) == ("a", SYSTEM_TOKENS - BS)
    # Without the length the prompt is taken to end in a partial block.
    assert choose_prefill("cache_aware", hashes, BS, loads(a=0, b=0), index) == ("a", SYSTEM_TOKENS)
    with pytest.raises(ValueError, match="65 block hashes"):
        choose_prefill(
            "cache_aware", hashes + [1], BS, loads(a=0), index, num_prompt_tokens=SYSTEM_TOKENS
        )


# ---- the other policies ------------------------------------------------------------------
def test_round_robin_cycles_exactly_in_id_order():
    rr = make_policy("round_robin")
    hashes, n = request(0, 1)
    index = index_with(a=SYS0)
    workers = loads(c=0, a=0, b=0)
    assert [pick(rr, hashes, n, workers, index) for _ in range(7)] == list("abcabca")
    workers[0] = WorkerLoad("c", healthy=False)
    assert [pick(rr, hashes, n, workers, index) for _ in range(4)] == list("baba")
    # A worker joining mid-cycle takes its place in id order.
    assert [pick(rr, hashes, n, workers + loads(bb=0), index) for _ in range(4)] == [
        "b",
        "bb",
        "a",
        "b",
    ]
    with pytest.raises(ValueError, match="make_policy"):
        pick("round_robin", hashes, n, workers, index)


def test_least_loaded_picks_min_queued_tokens():
    hashes, n = request(0, 1)
    index = index_with(a=SYS0)  # the cache is ignored
    assert pick("least_loaded", hashes, n, loads(a=10, b=3, c=7), index) == "b"
    busy = [WorkerLoad("a", 10, running_requests=0), WorkerLoad("b", 3, running_requests=5)]
    assert pick("least_loaded", hashes, n, busy, index) == "b"  # tokens before requests
    tied = [
        WorkerLoad("a", 3, running_requests=2),
        WorkerLoad("b", 3, running_requests=1),
        WorkerLoad("c", 3, running_requests=1),
    ]
    assert pick("least_loaded", hashes, n, tied, index) == "b"
    # The returned cached tokens are still the chosen worker's real prefix hits.
    assert choose_prefill(
        "least_loaded", hashes, BS, loads(a=0, b=1), index, num_prompt_tokens=n
    ) == ("a", SYSTEM_TOKENS)


def test_random_with_a_seed_is_reproducible():
    hashes, n = request(0, 1)
    index = index_with()
    workers = loads(a=0, b=0, c=0, d=0)

    def run(seed: int, ws: list[WorkerLoad]) -> list[str]:
        policy = make_policy("random", seed=seed)
        return [pick(policy, hashes, n, ws, index) for _ in range(50)]

    first = run(7, workers)
    assert first == run(7, workers)
    assert first == run(7, list(reversed(workers)))  # independent of the input order
    assert first != run(8, workers)
    assert set(first) == {"a", "b", "c", "d"}
    assert pick("random", hashes, n, workers, index) in "abcd"  # by name: unseeded


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_unhealthy_workers_are_never_chosen(name):
    hashes, n = request(0, 1)
    index = index_with(a=SYS0, b=[], c=[])
    workers = [WorkerLoad("a", 0, healthy=False), WorkerLoad("b", 900), WorkerLoad("c", 0)]
    policy = make_policy(name)
    for _ in range(10):
        assert pick(policy, hashes, n, workers, index) != "a"


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_no_healthy_worker_raises(name):
    hashes, n = request(0, 1)
    index = index_with(a=SYS0)
    with pytest.raises(NoWorkerAvailable, match="no healthy prefill worker.*none registered"):
        pick(make_policy(name), hashes, n, [], index)
    down = [WorkerLoad("a", healthy=False), WorkerLoad("b", healthy=False)]
    with pytest.raises(NoWorkerAvailable, match=r"all 2 are unhealthy: \['a', 'b'\]"):
        pick(make_policy(name), hashes, n, down, index)


def test_duplicate_worker_ids_are_rejected():
    hashes, n = request(0, 1)
    with pytest.raises(ValueError, match="duplicate prefill worker ids"):
        pick("cache_aware", hashes, n, loads(a=0) + loads(a=1), index_with())


# ---- decode ------------------------------------------------------------------------------
def test_decode_choice_order():
    hashes, n = request(0, 1)  # 1064 tokens: 67 blocks needed
    index = index_with(d0=[], d1=SYS0[:10], d2=SYS0, d3=SYS0[:10])

    def choose(*ws: DecodeLoad):
        return choose_decode(hashes, n, BS, list(ws), index)

    # Room first: d2 holds the most but has too few free blocks.
    assert choose(
        DecodeLoad("d0", 500), DecodeLoad("d1", 67, running_requests=9), DecodeLoad("d2", 66)
    ) == ("d1", 10, True, True)
    # Then own prefix hits, then fewer running requests, then id.
    assert choose(DecodeLoad("d0", 500), DecodeLoad("d2", 67, 30)) == ("d2", 64, True, True)
    assert choose(DecodeLoad("d1", 500, 4), DecodeLoad("d3", 500, 3)) == ("d3", 10, True, True)
    assert choose(DecodeLoad("d3", 500, 3), DecodeLoad("d1", 500, 3)) == ("d1", 10, True, True)
    # No hits anywhere: the worker caching fewer blocks (a new family spreads), then id.
    other, n_other = request(family=7, user=1)
    assert choose_decode(
        other, n_other, BS, [DecodeLoad("d1", 500), DecodeLoad("d0", 500)], index
    ) == ("d0", 0, True, True)
    assert choose_decode(
        other, n_other, BS, [DecodeLoad("d2", 500), DecodeLoad("d3", 500)], index
    ) == ("d3", 0, True, True)
    # None fits: the best of the rest, flagged.
    assert choose(DecodeLoad("d0", 5), DecodeLoad("d2", 5, 8)) == ("d2", 64, False, True)
    # A worker whose whole cache is big enough can take it later; none: it never fits.
    assert choose(
        DecodeLoad("d0", 5, total_blocks=67), DecodeLoad("d2", 5, 8, total_blocks=66)
    ) == ("d2", 64, False, True)
    assert choose(
        DecodeLoad("d0", 5, total_blocks=66), DecodeLoad("d2", 5, 8, total_blocks=66)
    ) == ("d2", 64, False, False)
    # Unhealthy skipped; none healthy raises.
    assert choose(DecodeLoad("d2", 500, healthy=False), DecodeLoad("d0", 500)) == (
        "d0",
        0,
        True,
        True,
    )
    with pytest.raises(NoWorkerAvailable, match="no healthy decode worker"):
        choose(DecodeLoad("d2", 500, healthy=False))


# ---- LoadTracker -------------------------------------------------------------------------
def test_load_tracker_counts_from_dispatch_to_prefill():
    t = LoadTracker()
    t.dispatched("a", 100)
    t.dispatched("a", 50)
    t.dispatched("b", 7)
    assert (t.queued("a"), t.queued("b"), t.queued("c")) == (150, 7, 0)
    t.prefilled("a", 120)
    assert t.queued("a") == 30
    t.prefilled("a", 1000)  # never negative
    t.prefilled("c", 5)
    assert t.snapshot() == {"a": 0, "b": 7, "c": 0}
    t.forget("b")
    assert t.queued("b") == 0
    with pytest.raises(ValueError, match="n_tokens"):
        t.dispatched("a", -1)
    with pytest.raises(ValueError, match="n_tokens"):
        t.prefilled("a", -1)


def test_load_tracker_is_thread_safe():
    t = LoadTracker()
    barrier = threading.Barrier(8)

    def work(i: int) -> None:
        barrier.wait()
        for _ in range(2000):
            t.dispatched(f"w{i % 2}", 3)
            t.prefilled(f"w{i % 2}", 1)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert t.snapshot() == {"w0": 4 * 2000 * 2, "w1": 4 * 2000 * 2}
