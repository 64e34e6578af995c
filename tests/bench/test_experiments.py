"""The experiments' cluster shapes and verdicts, without a cluster (a real run of one shape is
tests/bench/test_experiments_on_ray.py)."""

from __future__ import annotations

import pytest

from benchmarks.experiment_runs import slug
from benchmarks.experiment_shapes import Shape
from benchmarks.experiment_verdicts import (
    chunking_verdict,
    floor_step_ms,
    long_prompt_verdict,
    policies_verdict,
)
from benchmarks.experiments import EXPERIMENTS
from cluster.local import LOCAL_MANIFEST
from deploy.manifest import load_manifest, parse_manifest


def base() -> dict:
    return load_manifest(LOCAL_MANIFEST).model_dump(mode="json")


def test_shape_manifest_is_valid_with_free_ports_and_the_shape():
    m = parse_manifest(
        Shape(
            0, 2, policy="round_robin", local_prefill_tokens=64, engine={"chunk_size": 2048}
        ).manifest(base(), "exp")
    )
    assert (m.metadata.name, m.spec.prefill.replicas, m.spec.decode.replicas) == ("exp", 0, 2)
    assert (m.spec.router.port, m.spec.router.http_port) == (0, 0)
    assert (m.spec.router.policy, m.spec.router.local_prefill_tokens) == ("round_robin", 64)
    # local.yaml's 1,024-token step budget grows to hold one 2,048-token chunk
    assert (m.spec.engine.chunk_size, m.spec.engine.max_num_batched_tokens) == (2048, 2048)
    target = parse_manifest(Shape(0, 2, engine={"itl_target_ms": 300}).manifest(base(), "x"))
    assert target.spec.engine.itl_target_ms == 300
    assert target.spec.engine.max_num_batched_tokens == 1024


def test_every_experiment_builds_valid_manifests_and_unique_run_dirs():
    for experiment in EXPERIMENTS.values():
        slugs = [slug(r.name) for r in experiment.runs]
        assert len(set(slugs)) == len(slugs)
        for run in experiment.runs:
            parse_manifest(run.shape.manifest(base(), experiment.name))


def summary(**lat) -> dict:
    """A summary with the given latencies: {kind or '': {metric: {q: ms}}}."""

    def stats(metrics):
        return {
            m: {q: metrics.get(m, {}).get(q) for q in ("median", "p99")}
            for m in ("ttft", "itl", "tpot", "e2e")
        }

    return {
        "latency_ms": stats(lat.get("", {})),
        "by_kind": {k: {"latency_ms": stats(v)} for k, v in lat.items() if k},
        "goodput": {"requests_per_s": lat.get("goodput", {}).get("g", 0.0)},
        "cache": lat.get("cache", {}),
        "load_balance": lat.get("load_balance", {}),
        "config": lat.get("config", {}),
    }


def test_long_prompt_verdict_checks_both_targets():
    s = {
        "disaggregated, no long prompts": summary(chat={"itl": {"p99": 100.0}}),
        "aggregated": summary(chat={"itl": {"p99": 900.0}}, long={"ttft": {"median": 5000.0}}),
        "disaggregated": summary(chat={"itl": {"p99": 140.0}}, long={"ttft": {"median": 7000.0}}),
    }
    lines = long_prompt_verdict(s)
    assert "target disaggregated <= 1.5x no-long (1.40x): within the target" in lines
    assert "target disaggregated beats aggregated on p99 ITL: within the target" in lines
    s["disaggregated"] = summary(chat={"itl": {"p99": 160.0}})
    assert (
        "target disaggregated <= 1.5x no-long (1.60x): outside the target" in long_prompt_verdict(s)
    )


def policy_summary(cached: float, oracle: float, requests: list[int], g: float) -> dict:
    mean = sum(requests) / len(requests)
    lb = {"requests_max_over_mean": max(requests) / mean, "prefill_tokens_max_over_mean": 1.0}
    return summary(
        cache={"cached_fraction": cached, "oracle_fraction": oracle},
        load_balance={"prefill": lb},
        goodput={"g": g},
    )


def test_policies_verdict_hit_rate_balance_and_best_goodput():
    s = {
        "cache_aware": policy_summary(0.76, 0.8, [11, 9], 0.3),  # 0.95x oracle, 1.1 max/mean
        "round_robin": policy_summary(0.4, 0.8, [10, 10], 0.2),
    }
    lines = policies_verdict(s)
    assert "target cache_aware hit rate >= 0.9x oracle (0.95x): within the target" in lines
    assert "target cache_aware max/mean <= 1.25 (1.10): within the target" in lines
    assert "target cache_aware best goodput (best: cache_aware): within the target" in lines
    s["cache_aware"] = policy_summary(0.7, 0.8, [14, 6], 0.1)
    lines = policies_verdict(s)
    assert "target cache_aware hit rate >= 0.9x oracle (0.875x): outside the target" in lines
    assert "target cache_aware max/mean <= 1.25 (1.40): outside the target" in lines
    assert "target cache_aware best goodput (best: round_robin): outside the target" in lines


def test_chunking_verdict_compares_itl_beside_long_prefills_with_its_target():
    workload = {"options": EXPERIMENTS["chunking"].options, "block_size": 16}
    s = {
        "chunk 512": summary(chat={"itl": {"p99": 90.0}}, long={"ttft": {"median": 30000.0}}),
        "itl_target 1000 ms": summary(
            chat={"itl": {"p99": 250.0}},
            long={"ttft": {"median": 40000.0}},
            config={"itl_target_ms": 1000} | workload,
        ),
        "itl_target 20 ms": summary(
            chat={"itl": {"p99": 250.0}},
            long={"ttft": {"median": 40000.0}},
            config={"itl_target_ms": 20} | workload,
        ),
    }
    s["chunk 512"]["by_kind"]["chat"]["itl_beside_long_prefill_ms"] = {"p99": 2000.0}
    s["itl_target 1000 ms"]["by_kind"]["chat"]["itl_beside_long_prefill_ms"] = {"p99": 1070.0}
    s["itl_target 20 ms"]["by_kind"]["chat"]["itl_beside_long_prefill_ms"] = {"p99": 320.0}
    lines = chunking_verdict(s)
    assert lines[0] == (
        "chunk 512: chat ITL p99 beside long prefills 2000 ms (all chat ITLs: 90 ms), "
        "long-prompt TTFT p50 30000 ms"
    )
    assert lines[1].endswith("(1.07x the target; bound 1.1x)")
    # 20 ms is below what one block costs after 7,000 cached tokens on this CPU's profile,
    # 1,000 ms above it
    floor = floor_step_ms(s["itl_target 20 ms"]["config"])
    assert 20 < floor < 1000
    assert lines[2].endswith(
        f"(16.00x target; below this hardware's floor: one block after 7,000 tokens beside "
        f"one decode is predicted at {floor:.0f} ms, so the target cannot hold)"
    )


@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_experiments_have_quick_sizes(name):
    e = EXPERIMENTS[name]
    assert set(e.quick_options) == set(e.options)
