"""`baton simulate` checked against real `baton bench` runs: every run of the experiments
(benchmarks/experiments.py writes each run's results.json and manifest.yaml) is simulated with
the same workload, seed, arrivals and cluster shape, and the errors of TTFT p50 / p99, TPOT p50
and the prefix-cache hit rate are printed (the simulator's target: within 10%).

    python -m benchmarks.sim_validation runs/experiments [--profile P] [--kv-bandwidth-gbps 2]
        [--out runs/sim-validation.md]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from benchmarks.driver import BenchConfig
from benchmarks.report import summarize
from benchmarks.sim.driver import simulate
from benchmarks.simulate import DEFAULT_PROFILE, add_overhead_args, cluster_config
from benchmarks.timeline import read_results
from benchmarks.workloads import WORKLOADS, TokenSpace

METRICS = (  # (label, how to read it from a summary)
    ("TTFT p50 ms", lambda s: s["latency_ms"]["ttft"]["median"]),
    ("TTFT p99 ms", lambda s: s["latency_ms"]["ttft"]["p99"]),
    ("TPOT p50 ms", lambda s: s["latency_ms"]["tpot"]["median"]),
    ("hit rate %", lambda s: 100.0 * s["cache"]["cached_fraction"]),
)
TOLERANCE = 0.10


def simulated_summary(run_dir: Path, args: argparse.Namespace) -> tuple[dict, dict]:
    """(real summary, simulated summary) of one experiment run directory."""
    real, _ = read_results(run_dir)
    cfg = real["config"]
    workload = WORKLOADS[cfg["workload_name"]](**cfg["options"])
    config = BenchConfig(
        num_requests=cfg["num_requests"],
        duration_s=cfg["duration_s"],
        request_rate=cfg["request_rate"],
        burstiness=cfg["burstiness"],
        max_concurrency=cfg["max_concurrency"],
        seed=cfg["seed"],
        block_size=cfg["block_size"],
        hash_seed=cfg["hash_seed"],
    )
    flags = argparse.Namespace(
        manifest=str(run_dir / "manifest.yaml"),
        profile=args.profile,
        kv_bandwidth_gbps=args.kv_bandwidth_gbps,
        kv_latency_ms=args.kv_latency_ms,
        local_overhead_ms=args.local_overhead_ms,
        remote_overhead_ms=args.remote_overhead_ms,
        shared_cores=args.shared_cores,
        **dict.fromkeys(
            (
                "prefill",
                "decode",
                "policy",
                "local_prefill_tokens",
                "itl_target_ms",
                "chunk_size",
                "num_kv_blocks",
                "max_num_seqs",
                "max_num_batched_tokens",
            ),
        ),
    )
    cluster, model = cluster_config(flags, config.seed)
    records, run = simulate(workload, TokenSpace(high=args.vocab_size), config, cluster, model)
    return real, summarize(records, real["goodput"]["slo_ms"], run.cluster.workers())


def error(real: float | None, sim: float | None) -> float | None:
    """(sim - real) / real; None where either is missing or real is 0."""
    if real is None or sim is None or real == 0:
        return None
    return (sim - real) / real


def validation_table(rows: list[tuple[str, dict, dict]]) -> str:
    """Markdown: one line per run, real / sim (error) per metric; within-tolerance counts."""
    head = "| run | " + " | ".join(f"{label} real / sim" for label, _ in METRICS) + " |"
    lines = [head, "|" + "---|" * (len(METRICS) + 1)]
    within = total = 0
    for name, real, sim in rows:
        cells = []
        for _, get in METRICS:
            r, s = get(real), get(sim)
            e = error(r, s)
            if e is not None:
                total += 1
                within += abs(e) <= TOLERANCE
            fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
            cells.append(f"{fmt(r)} / {fmt(s)}" + ("" if e is None else f" ({e:+.0%})"))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append(f"\n{within} of {total} figures within {TOLERANCE:.0%}.")
    return "\n".join(lines)


def add_replay_args(p: argparse.ArgumentParser) -> None:
    """How real runs are simulated again (also benchmarks/sim_calibration.py's flags)."""
    p.add_argument("--profile", default=str(DEFAULT_PROFILE), help="step profile JSON")
    p.add_argument("--kv-bandwidth-gbps", type=float, default=2.0)
    p.add_argument("--kv-latency-ms", type=float, default=2.0)
    p.add_argument("--vocab-size", type=int, default=49152)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sim_validation")
    p.add_argument("runs", help="an experiments output directory (or one experiment's)")
    add_replay_args(p)
    add_overhead_args(p, shared_cores=os.cpu_count())
    p.add_argument("--out", help="also write the table to this file")
    args = p.parse_args(argv)
    run_dirs = sorted(m.parent for m in Path(args.runs).rglob("manifest.yaml"))
    if not run_dirs:
        print(f"error: no experiment runs (manifest.yaml) under {args.runs}", file=sys.stderr)
        return 2
    rows = []
    for run_dir in run_dirs:
        real, sim = simulated_summary(run_dir, args)
        rows.append((f"{run_dir.parent.name}: {run_dir.name}", real, sim))
    text = validation_table(rows)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
