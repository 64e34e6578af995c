"""`baton plan` on cases whose answer is known by construction."""

from __future__ import annotations

import math

import yaml

from deploy.manifest import parse_manifest
from engine.step_model import StepModel
from perf.bench.driver import BenchConfig
from perf.bench.workloads import RandomWorkload
from perf.planner import Candidate, Outcome, candidates, evaluate, manifest_for, search
from perf.sim.cluster import ClusterConfig

# a decode step of k rows takes 10 + 10k ms; prefill is almost free
MODEL = StepModel({"const": 0.01, "decodes": 0.01, "prefill_tokens": 1e-6})
WORKLOAD = RandomWorkload(input_len=32, output_len=8)
CONFIG = BenchConfig(num_requests=4, request_rate=math.inf)  # all four arrive at once
BASE = ClusterConfig()


def plan(prefill, decode, itl_ms=45.0):
    cands = candidates(prefill, decode, ["cache_aware"], [None], [None])
    return search(cands, lambda c: evaluate(c, BASE, MODEL, WORKLOAD, CONFIG, (1e6, itl_ms)))


def test_one_decode_worker_misses_the_itl_slo_two_meet_it():
    # 1 decode worker: 4 rows per step = 50 ms > 45; 2 workers: 2 rows per step = 30 ms (a
    # first token leaves between two steps, so no gap is longer than a step)
    best, outcomes = plan([1], [1, 2, 3, 4])
    assert (best.candidate.prefill, best.candidate.decode) == (1, 2)
    assert len(outcomes) == 2  # stops at the first feasible cost
    assert round(outcomes[0].itl_p99, 6) == 50.0 and not outcomes[0].feasible
    assert round(outcomes[1].itl_p99, 6) == 30.0


def test_cheapest_feasible_shape_wins_over_disaggregation():
    # aggregated with 2 decode workers (cost 2) meets the SLO: cheaper than 1 + 2
    best, outcomes = plan([0, 1], [1, 2, 3])
    assert (best.candidate.prefill, best.candidate.decode) == (0, 2)
    assert all(o.candidate.cost <= 2 for o in outcomes)


def test_no_feasible_shape():
    best, outcomes = plan([1], [1], itl_ms=25.0)
    assert best is None and len(outcomes) == 1


def test_search_breaks_ties_by_ttft_and_stops_at_the_cost():
    cands = [Candidate(1, 1, p, None, None, 2.0) for p in ("a", "b")]
    cands.append(Candidate(1, 2, "c", None, None, 3.0))
    ttft = {"a": 500.0, "b": 300.0, "c": 1.0}
    best, outcomes = search(cands, lambda c: Outcome(c, ttft[c.policy], 1.0, 1, True))
    assert best.candidate.policy == "b" and len(outcomes) == 2


def test_candidates_cheapest_first_with_costs():
    cands = candidates(
        [0, 1], [1, 2], ["cache_aware", "round_robin"], [None], [None, 250.0], prefill_cost=2.0
    )
    costs = [c.cost for c in cands]
    assert costs == sorted(costs)
    assert all(c.policy == "cache_aware" for c in cands if c.prefill == 0)  # no pool, no policy
    assert len(cands) == 2 * 2 + 2 * 2 * 2  # P=0: 2 decode x 2 targets; P=1: x 2 policies


def test_manifest_validates_and_carries_the_shape():
    c = Candidate(2, 3, "least_loaded", 512, 250.0, 5.0)
    data = yaml.safe_load(manifest_for(c, BASE))
    spec = parse_manifest(data).spec
    assert (spec.prefill.replicas, spec.decode.replicas) == (2, 3)
    assert spec.router.policy == "least_loaded"
    assert (spec.engine.chunk_size, spec.engine.itl_target_ms) == (512, 250.0)
