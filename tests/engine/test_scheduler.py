"""Scheduler driven without a model: exact tokens per request per step.

A simulated step is schedule() -> update_after_step() -> append one token to every request
that sampled, finishing it once it has max_tokens outputs.
"""

from __future__ import annotations

from collections import Counter

from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.request import RequestStatus
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tests.engine.requests import make_request

OUTPUT_TOKEN = 90_000  # the i-th generated token (from 0) is OUTPUT_TOKEN + i


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 64,
    chunk: int = 16,
    max_seqs: int = 16,
    prefill_batch: int | None = None,
    spacing: int = 0,
) -> Scheduler:
    pool = BlockPool(num_blocks)
    kv = KVCacheManager(pool, block_size, "scheduler-test")
    return Scheduler(SchedulerConfig(budget, chunk, max_seqs, prefill_batch, spacing), kv)


def step(sched: Scheduler) -> tuple[SchedulerOutput, list[str]]:
    """One simulated engine step; returns the output and the ids that sampled, in order."""
    out = sched.schedule()
    sampled = sched.update_after_step(out)
    for req in sampled:
        req.token_ids.append(OUTPUT_TOKEN + req.num_output_tokens)
        if req.num_output_tokens >= req.params.max_tokens:
            sched.finish(req, RequestStatus.FINISHED_LENGTH)
    check(sched)
    return out, [r.request_id for r in sampled]


def check(sched: Scheduler) -> None:
    """Pool invariants, and each block's ref count == the live tables holding it."""
    pool = sched.kv.pool
    pool.check_integrity()
    holders = Counter(b for rid in sched.requests for b in sched.kv.block_ids(rid))
    assert [b.ref_cnt for b in pool.blocks] == [holders[i] for i in range(pool.num_blocks)]


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> list[dict[str, int]]:
    steps = []
    while sched.has_unfinished():
        assert len(steps) < max_steps, "scheduler made no progress"
        steps.append(step(sched)[0].num_tokens)
    return steps


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


# ---- SchedulerOutput -----------------------------------------------------------------------
def test_empty_scheduler_yields_an_empty_output():
    sched = make_scheduler()
    out = sched.schedule()
    assert out.is_empty()
    assert (out.requests, out.num_tokens, out.preempted, out.total_tokens) == ([], {}, [], 0)
    assert sched.update_after_step(out) == []
    assert not sched.has_unfinished()


# ---- chunked prefill and budgets -----------------------------------------------------------
def test_chunked_prefill_splits_the_prompt_then_decodes_one_token():
    sched = make_scheduler(chunk=4)
    a = make_request("a", range(10), max_tokens=3)
    sched.add(a)
    trace = []
    for _ in range(5):
        out, sampled = step(sched)
        trace.append((out.num_tokens, sampled, sched.kv.block_ids("a")))
    assert trace == [
        ({"a": 4}, [], [0]),
        ({"a": 4}, [], [0, 1]),
        ({"a": 2}, ["a"], [0, 1, 2]),
        ({"a": 1}, ["a"], [0, 1, 2]),
        ({"a": 1}, ["a"], []),  # third output: finished and freed
    ]
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert a.output_token_ids == [OUTPUT_TOKEN, OUTPUT_TOKEN + 1, OUTPUT_TOKEN + 2]
    assert a.num_cached_tokens == 0
    assert not sched.has_unfinished()
    assert sched.schedule().is_empty()
    assert sched.kv.pool.num_free_blocks == 64


def test_budget_goes_to_decodes_then_prefills_then_waiting_in_arrival_order():
    sched = make_scheduler(budget=8, chunk=4)
    for req in (make_request("B", range(30)), make_request("X1", [100]), make_request("X2", [101])):
        sched.add(req)
    out, sampled = step(sched)
    assert ids(out.requests) == ["B", "X1", "X2"]
    assert out.num_tokens == {"B": 4, "X1": 1, "X2": 1}
    assert sampled == ["X1", "X2"]
    sched.add(make_request("W1", range(200, 205)))
    sched.add(make_request("W2", [300]))
    # Decodes first although B was admitted first; W1 gets what is left; W2 may not overtake.
    out, _ = step(sched)
    assert ids(out.requests) == ["X1", "X2", "B", "W1"]
    assert out.num_tokens == {"X1": 1, "X2": 1, "B": 4, "W1": 2}
    assert ids(sched.waiting) == ["W2"]
    # Prefills in admission order: B before W1, W1 gets only the rest of the budget.
    out, _ = step(sched)
    assert ids(out.requests) == ["X1", "X2", "B", "W1"]
    assert out.num_tokens == {"X1": 1, "X2": 1, "B": 4, "W1": 2}
    # W1 has one prompt token left: it counts as a decode; W2 gets the last token.
    out, sampled = step(sched)
    assert ids(out.requests) == ["X1", "X2", "W1", "B", "W2"]
    assert out.num_tokens == {"X1": 1, "X2": 1, "W1": 1, "B": 4, "W2": 1}
    assert sampled == ["X1", "X2", "W1", "W2"]
    out, _ = step(sched)
    assert ids(out.requests) == ["X1", "X2", "W1", "W2", "B"]
    assert out.num_tokens == {"X1": 1, "X2": 1, "W1": 1, "W2": 1, "B": 4}
    assert out.total_tokens == 8


def test_budget_caps_a_prefill_behind_decodes():
    sched = make_scheduler(budget=6, chunk=8)
    for rid in ("X1", "X2", "X3"):
        sched.add(make_request(rid, [7]))
    sched.add(make_request("B", range(20)))
    assert step(sched)[0].num_tokens == {"X1": 1, "X2": 1, "X3": 1, "B": 3}
    assert step(sched)[0].num_tokens == {"X1": 1, "X2": 1, "X3": 1, "B": 3}
    sched.finish(sched.requests["X1"], RequestStatus.FINISHED_STOPPED)
    assert step(sched)[0].num_tokens == {"X2": 1, "X3": 1, "B": 4}


def test_prompts_arriving_together_are_prefilled_one_after_another():
    # prefill_batch 8: once a step carries 8 prompt tokens no other prompt joins; the next
    # prompt gets what is left of the 8. Decodes are not counted.
    sched = make_scheduler(budget=64, chunk=16, prefill_batch=8)
    for i, rid in enumerate(("A", "B", "C")):
        sched.add(make_request(rid, range(100 * i, 100 * i + 10), max_tokens=3))
    trace = [step(sched) for _ in range(5)]
    assert [(out.num_tokens, sampled) for out, sampled in trace] == [
        ({"A": 10}, ["A"]),  # the first prompt is not held back: its whole chunk
        ({"A": 1, "B": 10}, ["A", "B"]),  # its first token comes one step before B's
        ({"A": 1, "B": 1, "C": 10}, ["A", "B", "C"]),
        ({"B": 1, "C": 1}, ["B", "C"]),
        ({"C": 1}, ["C"]),
    ]
    sched.add(make_request("D", range(20, 26), max_tokens=1))
    sched.add(make_request("E", range(30, 50), max_tokens=1))
    sched.add(make_request("F", range(60, 70), max_tokens=1))
    # short prompts share a step up to the limit: D (6) and 2 of E; then E's chunk of 16
    # (a running prefill, first in its step) and none of F
    assert step(sched)[0].num_tokens == {"D": 6, "E": 2}
    assert step(sched)[0].num_tokens == {"E": 16}
    assert step(sched)[0].num_tokens == {"E": 2, "F": 6}
    assert step(sched)[0].num_tokens == {"F": 4}
    assert not sched.has_unfinished()


def test_while_requests_decode_prompt_steps_alternate_with_decode_steps():
    # decode_steps_between_prompts 1: while requests decode, a waiting prompt starts only after
    # one decode-only step since the last step with prompt tokens; with nothing decoding it
    # starts at once
    sched = make_scheduler(budget=64, chunk=16, prefill_batch=8, spacing=1)
    for i, rid in enumerate(("A", "B", "C")):
        sched.add(make_request(rid, range(100 * i, 100 * i + 10), max_tokens=3))
    trace = [step(sched) for _ in range(7)]
    assert [(out.num_tokens, sampled) for out, sampled in trace] == [
        ({"A": 10}, ["A"]),  # nothing decodes: A starts at once
        ({"A": 1}, ["A"]),  # B waits: the last step carried A's prompt
        ({"A": 1, "B": 10}, ["A", "B"]),
        ({"B": 1}, ["B"]),
        ({"B": 1, "C": 10}, ["B", "C"]),  # C's first token two steps after B's, not one
        ({"C": 1}, ["C"]),
        ({"C": 1}, ["C"]),
    ]
    assert not sched.has_unfinished()
    sched.add(make_request("D", range(20, 26), max_tokens=5))
    assert step(sched)[0].num_tokens == {"D": 6}  # nothing decodes, though D's step follows C's
    sched.add(make_request("E", range(30, 50), max_tokens=1))
    sched.add(make_request("F", range(50, 60), max_tokens=1))
    assert step(sched)[0].num_tokens == {"D": 1}  # D decodes: E waits a step
    assert step(sched)[0].num_tokens == {"D": 1, "E": 16}
    assert step(sched)[0].num_tokens == {"D": 1, "E": 4}  # a running prefill is not held; F is
    assert step(sched)[0].num_tokens == {"D": 1}
    assert step(sched)[0].num_tokens == {"F": 10}  # D finished: nothing decodes
    assert not sched.has_unfinished()


def test_without_a_prefill_batch_limit_prompts_share_the_token_budget():
    sched = make_scheduler(budget=64, chunk=16)
    for i, rid in enumerate(("A", "B", "C")):
        sched.add(make_request(rid, range(100 * i, 100 * i + 10), max_tokens=1))
    out, sampled = step(sched)
    assert (out.num_tokens, sampled) == ({"A": 10, "B": 10, "C": 10}, ["A", "B", "C"])


def test_max_num_seqs_limits_running_requests():
    sched = make_scheduler(max_seqs=2)
    for rid in ("a", "b", "c"):
        sched.add(make_request(rid, range(3), max_tokens=2))
    assert run_to_completion(sched) == [
        {"a": 3, "b": 3},
        {"a": 1, "b": 1},
        {"c": 3},
        {"c": 1},
    ]


# ---- prefix hits ---------------------------------------------------------------------------
def test_prefix_hit_schedules_only_the_uncached_tokens():
    sched = make_scheduler()
    first = make_request("first", range(10), max_tokens=1)
    sched.add(first)
    assert run_to_completion(sched) == [{"first": 10}]
    assert first.num_cached_tokens == 0
    # first held blocks [0, 1, 2]; 0 and 1 (tokens 0..7) stay cached.
    assert sched.kv.pool.num_cached_blocks == 2
    partial = make_request("partial", [*range(8), 50, 51, 52])
    same = make_request("same", range(10))  # all but the last block's tokens hit
    exact = make_request("exact", range(8))  # fully cached: the last block is recomputed
    fresh = make_request("fresh", [60, 61, 62])
    for req in (partial, same, exact, fresh):
        sched.add(req)
    out, _ = step(sched)
    assert out.num_tokens == {"partial": 3, "same": 2, "exact": 4, "fresh": 3}
    assert [r.num_cached_tokens for r in (partial, same, exact, fresh)] == [8, 8, 4, 0]
    assert sched.kv.block_ids("partial") == [0, 1, 3]
    assert sched.kv.block_ids("same") == [0, 1, 4]
    assert sched.kv.block_ids("exact") == [0, 5]
    assert sched.kv.block_ids("fresh") == [6]
    assert [b.ref_cnt for b in sched.kv.pool.blocks[:3]] == [3, 2, 0]


# ---- preemption ----------------------------------------------------------------------------
def test_newest_running_request_is_preempted_and_later_resumes():
    sched = make_scheduler(num_blocks=6, chunk=16)
    a = make_request("A", range(8), max_tokens=7)
    b = make_request("B", range(100, 108), max_tokens=7)
    sched.add(a)
    sched.add(b)
    assert step(sched)[0].num_tokens == {"A": 8, "B": 8}
    assert (sched.kv.block_ids("A"), sched.kv.block_ids("B")) == ([0, 1], [2, 3])
    for _ in range(3):
        assert step(sched)[0].num_tokens == {"A": 1, "B": 1}
    assert (sched.kv.block_ids("A"), sched.kv.block_ids("B")) == ([0, 1, 4], [2, 3, 5])
    c = make_request("C", range(200, 203), max_tokens=2)
    sched.add(c)  # no free block: C waits
    assert step(sched)[0].num_tokens == {"A": 1, "B": 1}
    assert ids(sched.waiting) == ["C"]
    # A's 13th token needs a 4th block; none is free: B, the newest, is preempted.
    out, _ = step(sched)
    assert out.num_tokens == {"A": 1}
    assert ids(out.requests) == ["A"]
    assert out.preempted == ["B"]
    assert b.status == RequestStatus.PREEMPTED
    assert (b.num_computed_tokens, b.num_preemptions, b.num_output_tokens) == (0, 1, 5)
    assert sched.kv.block_ids("B") == []
    assert sched.kv.block_ids("A") == [0, 1, 4, 5]  # took B's tail block
    assert ids(sched.running) == ["A"]
    assert ids(sched.waiting) == ["B", "C"]
    # B needs 4 blocks (2 of them its own cached ones); only 2 are free until A finishes.
    out, sampled = step(sched)
    assert (out.num_tokens, out.preempted, sampled) == ({"A": 1}, [], ["A"])
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert ids(sched.waiting) == ["B", "C"]
    assert b.num_computed_tokens == 0  # the failed admission kept nothing
    # B resumes from its first two cached blocks and recomputes the rest, outputs included.
    out, sampled = step(sched)
    assert out.num_tokens == {"B": 5, "C": 3}
    assert b.num_computed_tokens == 13
    assert b.num_cached_tokens == 0  # set at first admission; the resume's hit is not counted
    assert sched.kv.block_ids("B") == [2, 3, 5, 4]
    assert sampled == ["B", "C"]
    assert step(sched)[0].num_tokens == {"B": 1, "C": 1}
    assert not sched.has_unfinished()
    assert b.status == RequestStatus.FINISHED_LENGTH
    assert b.output_token_ids == [OUTPUT_TOKEN + i for i in range(7)]
    assert sched.kv.pool.num_free_blocks == 6


def test_preemption_can_evict_several_requests_already_scheduled_this_step():
    sched = make_scheduler(num_blocks=6, chunk=12)
    a = make_request("A", range(24), max_tokens=1)
    sched.add(a)
    sched.add(make_request("B", [50, 51], max_tokens=3))
    sched.add(make_request("C", [60, 61], max_tokens=3))
    out, _ = step(sched)
    assert out.num_tokens == {"A": 12, "B": 2, "C": 2}
    assert sched.kv.pool.num_free_blocks == 1
    # B and C decode first; A's second chunk needs 3 blocks: C, then B, are preempted.
    out, sampled = step(sched)
    assert out.num_tokens == {"A": 12}
    assert ids(out.requests) == ["A"]
    assert out.preempted == ["C", "B"]
    assert sampled == ["A"]
    assert ids(sched.waiting) == ["B", "C"]  # admission order kept at the front
    assert run_to_completion(sched) == [{"B": 3, "C": 3}, {"B": 1, "C": 1}]


def test_a_request_that_is_itself_the_newest_preempts_itself():
    sched = make_scheduler(num_blocks=4, chunk=16)
    a = make_request("A", range(5), max_tokens=3)
    b = make_request("B", range(100, 107), max_tokens=4)
    sched.add(a)
    sched.add(b)
    assert step(sched)[0].num_tokens == {"A": 5, "B": 7}
    assert step(sched)[0].num_tokens == {"A": 1, "B": 1}
    assert (sched.kv.block_ids("A"), sched.kv.block_ids("B")) == ([0, 1], [2, 3])
    # B's 9th token needs a third block; B is the newest, so B gives way, not A.
    out, sampled = step(sched)
    assert (out.num_tokens, ids(out.requests), out.preempted) == ({"A": 1}, ["A"], ["B"])
    assert sampled == ["A"]
    assert (b.status, b.num_computed_tokens, sched.kv.block_ids("B")) == (
        RequestStatus.PREEMPTED,
        0,
        [],
    )
    assert a.status == RequestStatus.FINISHED_LENGTH
    # B comes back on its own two cached blocks and computes only its last token.
    out, sampled = step(sched)
    assert (out.num_tokens, sampled) == ({"B": 1}, ["B"])
    assert sched.kv.block_ids("B") == [2, 3, 1]
    assert run_to_completion(sched) == [{"B": 1}]
    assert b.output_token_ids == [OUTPUT_TOKEN + i for i in range(4)]


def test_no_admission_in_a_step_that_preempted():
    sched = make_scheduler(num_blocks=6, chunk=16)
    a = make_request("A", range(3))
    x = make_request("X", range(8))
    b = make_request("B", [*range(8), 99])  # same first two blocks as X
    for req in (a, x, b):
        sched.add(req)
    assert step(sched)[0].num_tokens == {"A": 3, "X": 8, "B": 9}
    # Computed in the same step: X's blocks are canonical, B's copies stay unhashed.
    assert sched.kv.block_ids("X") == [1, 2] and sched.kv.block_ids("B") == [3, 4, 5]
    assert [blk.block_hash is not None for blk in sched.kv.blocks("B")] == [False] * 3
    # X's 9th token needs a block: B is preempted. B could come straight back (X's blocks
    # hit, 2 blocks are free) but is not readmitted in the step that preempted it.
    out, _ = step(sched)
    assert (out.num_tokens, out.preempted) == ({"A": 1, "X": 1}, ["B"])
    assert sched.kv.pool.num_free_blocks == 2
    assert ids(sched.waiting) == ["B"]
    out, _ = step(sched)
    assert out.num_tokens == {"A": 1, "X": 1, "B": 2}
    assert sched.kv.block_ids("B") == [1, 2, 3]
    assert (b.num_cached_tokens, b.num_preemptions) == (0, 1)  # the first admission's hit


# ---- finish ------------------------------------------------------------------------------
def test_finish_frees_running_and_waiting_requests():
    sched = make_scheduler(num_blocks=8, chunk=8, budget=8)
    run = make_request("run", range(12))
    shared = make_request("shared", range(12))
    wait = make_request("wait", range(20, 30))
    for req in (run, shared, wait):
        sched.add(req)
    assert step(sched)[0].num_tokens == {"run": 8}
    assert step(sched)[0].num_tokens == {"run": 4, "shared": 4}
    assert sched.kv.block_ids("run") == [0, 1, 2]
    assert sched.kv.block_ids("shared") == [0, 1, 3]  # hits on run's first two blocks
    assert shared.num_cached_tokens == 8
    assert ids(sched.waiting) == ["wait"]
    sched.finish(run, RequestStatus.FINISHED_ABORTED)
    assert run.status == RequestStatus.FINISHED_ABORTED
    assert sched.kv.block_ids("run") == []
    assert [b.ref_cnt for b in sched.kv.pool.blocks[:4]] == [1, 1, 0, 1]
    assert ids(sched.running) == ["shared"]
    assert "run" not in sched.requests
    check(sched)
    sched.finish(wait, RequestStatus.FINISHED_ABORTED)
    assert list(sched.waiting) == []
    assert "wait" not in sched.requests
    sched.finish(shared, RequestStatus.FINISHED_STOPPED)
    assert sched.running == [] and sched.requests == {}
    assert not sched.has_unfinished()
    assert sched.kv.num_requests() == 0
    assert sched.kv.pool.num_free_blocks == 8
    assert sched.schedule().is_empty()
    check(sched)


def test_finish_of_a_preempted_request_removes_it_from_waiting():
    sched = make_scheduler(num_blocks=6, chunk=12)
    sched.add(make_request("A", range(24), max_tokens=1))
    b = make_request("B", [50, 51])
    sched.add(b)
    step(sched)
    out, _ = step(sched)
    assert out.preempted == ["B"]
    sched.finish(b, RequestStatus.FINISHED_ABORTED)
    assert list(sched.waiting) == []
    assert b.status == RequestStatus.FINISHED_ABORTED
    assert not sched.has_unfinished()
    assert sched.kv.pool.num_free_blocks == 6
    check(sched)


# ---- the scenario the project is built around ----------------------------------------------
def test_long_prompt_over_a_cached_prefix_joins_running_decodes():
    sched = make_scheduler(num_blocks=4096, block_size=8, budget=2048, chunk=1024)
    prefix = list(range(5000))  # 625 full blocks
    warm = make_request("warm", [*prefix, 70_001, 70_002, 70_003], max_tokens=2)
    sched.add(warm)
    assert run_to_completion(sched) == [{"warm": 1024}] * 4 + [{"warm": 907}, {"warm": 1}]
    assert sched.kv.pool.num_cached_blocks == 625
    for rid in ("B", "C", "D"):
        sched.add(make_request(rid, [60_000 + ord(rid)] * 20, max_tokens=100))
    assert step(sched)[0].num_tokens == {"B": 20, "C": 20, "D": 20}
    assert step(sched)[0].num_tokens == {"B": 1, "C": 1, "D": 1}
    new = make_request("new", [*prefix, *range(80_000, 82_000)], max_tokens=10)
    sched.add(new)
    out, sampled = step(sched)
    assert new.num_cached_tokens == 5000
    assert out.num_tokens == {"new": 1024, "B": 1, "C": 1, "D": 1}
    assert sampled == ["B", "C", "D"]
    # The 625 cached blocks warm left behind, then 128 fresh ones after B, C and D's.
    assert sched.kv.block_ids("new") == [*range(625), *range(635, 763)]
    out, sampled = step(sched)
    assert out.num_tokens == {"new": 976, "B": 1, "C": 1, "D": 1}
    assert sampled == ["B", "C", "D", "new"]
    assert step(sched)[0].num_tokens == {"new": 1, "B": 1, "C": 1, "D": 1}
    assert new.num_computed_tokens == 7001
