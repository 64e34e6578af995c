"""The tier-aware cost: a tier hit counts between a device hit and a computed token, by the
measured load bandwidth against the profiled prefill speed; pull, local or recompute by their
predicted seconds. Exact choices and exact figures."""

from __future__ import annotations

import pytest

from engine.block_pool import KVEvent
from kvtransfer.worker_api import PullResult, Role, WorkerStats
from router.kv_cost import (
    DEFAULT_PAIR_BYTES_PER_S,
    DEFAULT_PREFILL_TOKEN_S,
    LOCAL,
    MIN_TIER_COST,
    PULL,
    PULL_OVERHEAD_S,
    RECOMPUTE,
    CostBook,
    PullCase,
    WorkerRates,
    choose_pull,
)
from router.kv_index import KVIndex, PrefixHits
from router.policy import DecodeLoad, WorkerLoad, choose_decode, choose_prefill

BS = 16
PROMPT = list(range(100, 108))  # 8 block hashes; the prompt has 8 * 16 + 5 tokens
N = 8 * BS + 5
MB = 1_000_000


def stats(worker: str, *, read: int = 0, seconds: float = 0.0, role=Role.PREFILL) -> WorkerStats:
    """A worker of 1 MB blocks prefilling 1 ms per token whose tier read `read` bytes."""
    return WorkerStats(
        worker,
        role,
        free_blocks=100,
        num_blocks=100,
        kv_block_bytes=MB,
        prefill_token_seconds=0.001,
        tier_medium="disk",
        tier_bytes_read=read,
        tier_load_seconds=seconds,
    )


def index_of(device: dict[str, int], disk: dict[str, int] | None = None) -> KVIndex:
    """Workers holding PROMPT's first k blocks on device / its blocks [d, d + k) on disk."""
    index = KVIndex()
    for w in {*device, *(disk or {})}:
        index.add_worker(w)
        d = device.get(w, 0)
        index.apply(w, [KVEvent("stored", tuple(PROMPT[:d]))])
        k = (disk or {}).get(w, 0)
        index.apply(w, [KVEvent("stored", tuple(PROMPT[d : d + k]), medium="disk")])
    return index


def test_rates_come_from_stats_with_defaults_before_the_first_load():
    before = WorkerRates.of(stats("p0"))
    assert before == WorkerRates(0.001, MB, None)
    assert before.tier_block_s("disk") == MB / 2e8  # the conservative default: 5 ms a block
    assert before.tier_block_s("host") == MB / 2e9
    after = WorkerRates.of(stats("p0", read=4 * MB, seconds=0.004))  # 1 GB/s measured
    assert after.tier_bytes_per_s == 1e9
    assert after.tier_block_s("disk") == 0.001
    assert after.tier_token_cost("disk", BS) == 0.0625  # 1 ms per block / 16 ms to compute it
    assert WorkerRates().prefill_token_s == DEFAULT_PREFILL_TOKEN_S
    # A tier slower than computing counts as computing; one nearly free still costs a little.
    assert WorkerRates.of(stats("p0", read=MB, seconds=1.0)).tier_token_cost("disk", BS) == 1.0
    fast = WorkerRates.of(stats("p0", read=10**12, seconds=1.0))
    assert fast.tier_token_cost("disk", BS) == MIN_TIER_COST


def test_the_cost_book_keeps_a_tier_bandwidth_and_averages_pulls():
    book = CostBook()
    book.observe("p0", stats("p0", read=4 * MB, seconds=0.004))
    book.observe("p0", stats("p0"))  # counters read 0 again (a fresh tier): kept
    assert book.rates("p0").tier_bytes_per_s == 1e9
    assert book.pair_bytes_per_s("p0", "d0") == DEFAULT_PAIR_BYTES_PER_S
    book.observe_pull("p0", "d0", PullResult(4, 2, 2, 2 * MB, 0.01))  # 200 MB/s
    book.observe_pull("p0", "d0", PullResult(4, 4, 0, 0, 0.001))  # moved nothing: no sample
    book.observe_pull("p0", "d0", PullResult(4, 2, 2, 4 * MB, 0.01))  # 400 MB/s
    assert book.pair_bytes_per_s("p0", "d0") == 3e8  # EWMA 0.5
    book.forget("d0")
    assert book.pair_bytes_per_s("p0", "d0") == DEFAULT_PAIR_BYTES_PER_S
    assert book.rates("p0").tier_bytes_per_s == 1e9


def test_a_tier_hit_is_dearer_than_a_device_hit_and_cheaper_than_prefill():
    book = CostBook()
    for w in ("p0", "p1", "p2"):
        book.observe(w, stats(w, read=4 * MB, seconds=0.004))
    index = index_of({"p0": 4, "p1": 0, "p2": 0}, {"p1": 4})
    loads = [WorkerLoad("p0"), WorkerLoad("p1"), WorkerLoad("p2")]

    def chosen(loads) -> str:
        return choose_prefill(
            "cache_aware", PROMPT, BS, loads, index, num_prompt_tokens=N, costs=book
        ).worker_id

    assert chosen(loads) == "p0"  # 64 device-hit tokens beat 64 tier-hit ones
    assert chosen(loads[1:]) == "p1"  # ... which beat none
    # The tier saves 64 * (1 - 0.0625) = 60 tokens: worth a queue of 59 tokens, not of 61.
    assert chosen([WorkerLoad("p1", 59), WorkerLoad("p2")]) == "p1"
    assert chosen([WorkerLoad("p1", 61), WorkerLoad("p2")]) == "p2"
    choice = choose_prefill(
        "cache_aware", PROMPT, BS, loads[1:], index, num_prompt_tokens=N, costs=book
    )
    assert choice.cached_tokens == 64  # tier hits are cached tokens (the engine loads them)


def test_a_measured_slow_tier_loses_where_the_default_would_win():
    slow, default = CostBook(), CostBook()
    slow.observe("p1", stats("p1", read=MB, seconds=0.01))  # 100 MB/s: 10 ms a block
    default.observe("p1", stats("p1"))  # before any load: disk 200 MB/s, 5 ms a block
    for book in (slow, default):
        book.observe("p2", stats("p2"))
    index = index_of({"p1": 0, "p2": 0}, {"p1": 4})
    loads = [WorkerLoad("p1", 30), WorkerLoad("p2")]
    # default: 64 tier tokens cost 64 * 5/16 = 20, + 30 queued = 50 < 64 -> p1
    # measured: 64 * 10/16 = 40, + 30 = 70 > 64 -> p2
    for book, want in ((default, "p1"), (slow, "p2")):
        got = choose_prefill(
            "cache_aware", PROMPT, BS, loads, index, num_prompt_tokens=N, costs=book
        )
        assert got.worker_id == want


def test_the_decode_choice_counts_its_tier_hits_and_their_cost():
    book = CostBook()
    book.observe("d1", stats("d1", read=4 * MB, seconds=0.004, role=Role.DECODE))
    index = index_of({"d0": 3, "d1": 0}, {"d1": 4})
    loads = [DecodeLoad("d0", 100), DecodeLoad("d1", 100)]
    # d0 saves 48 tokens; d1's 4 tier blocks save 64 * (1 - 0.0625) = 60
    choice = choose_decode(PROMPT, N, BS, loads, index, costs=book)
    assert (choice.worker_id, choice.hit_blocks) == ("d1", 4)
    book.observe("d1", stats("d1", read=MB, seconds=1.0, role=Role.DECODE))  # 1 MB/s: cost 1
    choice = choose_decode(PROMPT, N, BS, loads, index, costs=book)
    assert (choice.worker_id, choice.hit_blocks) == ("d0", 3)


def case(**changes) -> PullCase:
    """Turn N+1 of 8 full blocks + 5: the prefill worker holds 5 blocks, the decode worker
    7; 1 ms per token on both, 1 MB blocks, 1 GB/s between them."""
    base = dict(
        num_tokens=N,
        block_size=BS,
        prefill_hits=PrefixHits(5),
        prefill_queued=0,
        prefill=WorkerRates(0.001, MB),
        source_blocks=7,
        pair_bytes_per_s=1e9,
        decode=WorkerRates(0.001, MB),
        local_tail=None,
    )
    return PullCase(**{**base, **changes})


def test_pull_beats_recomputing_the_blocks_the_prefill_worker_lacks():
    plan = choose_pull(case())
    assert plan.decision == PULL and plan.pull_blocks == 2
    assert plan.seconds[PULL] == pytest.approx(PULL_OVERHEAD_S + 2 * 0.001 + (N - 7 * BS) * 0.001)
    assert plan.seconds[RECOMPUTE] == pytest.approx((N - 5 * BS) * 0.001)
    assert LOCAL not in plan.seconds  # not allowed: the tail is past local_prefill_tokens


def test_recompute_wins_over_a_slow_pair_and_local_over_both_when_allowed():
    # 2 MB at 50 MB/s = 40 ms > 32 tokens of prefill
    assert choose_pull(case(pair_bytes_per_s=5e7)).decision == RECOMPUTE
    plan = choose_pull(case(local_tail=N - 7 * BS))
    assert (plan.decision, plan.pull_blocks) == (LOCAL, 0)
    assert plan.seconds[LOCAL] == pytest.approx(21 * 0.001)
    # a decode worker 10x slower at prefill: its 21 tokens cost more than pull + 21 tokens
    assert choose_pull(case(local_tail=21, decode=WorkerRates(0.01, MB))).decision == PULL


def test_the_prefill_queue_counts_for_both_remote_options_and_nothing_to_pull_is_no_pull():
    plan = choose_pull(case(prefill_queued=1000, local_tail=21))
    assert plan.decision == LOCAL
    assert plan.seconds[PULL] - plan.seconds[RECOMPUTE] == pytest.approx(
        PULL_OVERHEAD_S + 0.002 - 0.032
    )
    plan = choose_pull(case(prefill_hits=PrefixHits(7)))
    assert (plan.decision, set(plan.seconds)) == (RECOMPUTE, {RECOMPUTE})
