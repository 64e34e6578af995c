"""benchmarks/kv_tier_agents.py without Ray: each run's manifest (shape, tier, KV memory), the
workload sized from it, and the restart run's recovery figures from records."""

from __future__ import annotations

import math
from pathlib import Path

from benchmarks.kv_tier_agents import RUNS, manifest, parse_args, recovery, workload
from deploy.manifest import parse_manifest
from perf.bench.timeline import RequestRecord


def test_each_run_is_its_shape_with_or_without_a_disk_tier(tmp_path):
    args = parse_args([])
    shapes = {}
    for run in RUNS:
        spec = parse_manifest(manifest(args, run, "smollm2-135m-instruct", tmp_path)).spec
        engine = spec.engine_for("decode")
        shapes[run] = (spec.prefill.replicas, spec.decode.replicas, engine.kv_tier)
        assert (engine.num_kv_blocks, engine.block_size) == (1024, 16)
        if engine.kv_tier == "disk":
            assert engine.kv_tier_path == str(tmp_path / run)  # each run its own directories
            assert engine.kv_tier_bytes == 8 * 2**30
    assert shapes == {
        "agg-off": (0, 1, "none"),
        "agg-disk": (0, 1, "disk"),
        "disagg-off": (1, 1, "none"),
        "disagg-disk": (1, 1, "disk"),
        "disagg-disk-restart": (1, 1, "disk"),
    }


def test_the_workload_is_sized_to_five_times_one_workers_kv():
    w = workload(parse_args([]))
    assert (w.kv_tokens, w.live_context_x) == (1024 * 16, 5.0)
    # own context at the mid-point: 200 + (100 + 600) x (7 - 1) / 2 + 100 = 2400 tokens
    assert w.mean_own_context() == 2400.0
    assert w.live_sessions() == math.ceil((5 * 16384 - 2000) / 2400) == 34
    # so 34 sessions of 7 turns: the default 300 requests reach the live context
    assert w.mean_turns() == 7.0 and parse_args([]).num_requests >= 34 * 7
    # contexts up to 4,096 positions fit (4096 - 2300) // 700 + 1 = 3 turns
    assert workload(parse_args(["--max-context", "4096"])).mean_turns() == 3
    tiny = workload(parse_args(["--tiny"]))
    assert tiny.live_sessions() == math.ceil((5 * 128 * 4 - 80) / tiny.mean_own_context())
    assert tiny.max_context <= 128 * 4  # every prompt fits one worker's KV cache


def record(rid: str, send_s: float, cached: int, oracle: int) -> RequestRecord:
    return RequestRecord(
        rid, send_s, send_s + 1, ((send_s + 0.5, 1),), 100, cached, oracle_cached_tokens=oracle
    )


def test_recovery_is_the_hit_rate_against_the_oracle_by_turn_after_the_kill():
    records = [
        record("g0-0", 0.0, 0, 0),
        record("g0-1", 2.0, 80, 80),
        record("g1-0", 3.0, 40, 50),
        record("g3-0", 9.5, 99, 1),  # in flight at the kill: neither before nor after
        record("g0-2", 11.0, 20, 90),  # the first turns after the kill at 10 s
        record("g1-1", 12.0, 60, 60),
        record("g0-3", 14.0, 95, 95),  # g0's second
        record("g2-0", 15.0, 10, 10),  # a new session's first turn
    ]
    assert recovery(records, 10.0) == {
        "kill_s": 10.0,
        "before": 120 / 130,
        "turn_1_after": (20 + 60 + 10) / (90 + 60 + 10),
        "turn_2_after": 1.0,
        "turn_3_after": None,
    }


def test_the_tiny_runs_fit_a_check(tmp_path):
    args = parse_args(["--tiny", "--runs", "disagg-disk-restart"])
    assert (args.kv_blocks, args.block_size, args.num_requests) == (128, 4, 60)
    spec = parse_manifest(manifest(args, "disagg-disk-restart", str(Path("m")), tmp_path)).spec
    assert spec.model.skip_tokenizer_init and spec.engine.kv_tier == "disk"
