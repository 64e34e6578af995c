"""`baton simulate` checked against real `baton bench` runs: every run of the experiments
(benchmarks/experiments.py writes each run's results.json and manifest.yaml) is simulated with
the same workload, seed, arrivals and cluster shape, and the errors of TTFT p50 / p99, TPOT p50
and the prefix-cache hit rate are printed (the simulator's target: within 10%).

    python -m benchmarks.sim_validation runs/experiments [--profile P] [--kv-bandwidth-gbps 2]
        [--out runs/sim-validation.md]
    python -m benchmarks.sim_validation runs/r1 runs/r2 runs/r3    # repeats of the same runs

Given several output directories holding repeats of the same runs (same experiment, run name,
workload and seed), each figure is compared with the median of its repeats, and the table
also prints the repeats' range and how far they spread: on a shared machine the real runs
themselves may differ by more than the target, and a figure that does not repeat within 10%
cannot be validated within 10%.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from perf.bench.driver import BenchConfig
from perf.bench.report import summarize
from perf.bench.timeline import read_results
from perf.bench.workloads import WORKLOADS, TokenSpace
from perf.sim.command import DEFAULT_PROFILE, add_overhead_args, cluster_config
from perf.sim.driver import simulate

METRICS = (  # (label, how to read it from a summary)
    ("TTFT p50 ms", lambda s: s["latency_ms"]["ttft"]["median"]),
    ("TTFT p99 ms", lambda s: s["latency_ms"]["ttft"]["p99"]),
    ("TPOT p50 ms", lambda s: s["latency_ms"]["tpot"]["median"]),
    ("hit rate %", lambda s: 100.0 * s["cache"]["cached_fraction"]),
)
TOLERANCE = 0.10


def simulated_summary(
    run_dir: Path, args: argparse.Namespace, step_time_scale: float | None = None
) -> tuple[dict, dict]:
    """(real summary, simulated summary) of one experiment run directory; every step's time
    times step_time_scale (default: args.step_time_scale, else 1)."""
    real, _ = read_results(run_dir)
    return real, replay(real, run_dir, args, step_time_scale)


def replay(
    real: dict, run_dir: Path, args: argparse.Namespace, step_time_scale: float | None = None
) -> dict:
    """The simulated summary of a real run (its summary, and its directory for the manifest)."""
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
    if step_time_scale is None:
        step_time_scale = getattr(args, "step_time_scale", 1.0)
    flags = argparse.Namespace(
        manifest=str(run_dir / "manifest.yaml"),
        profile=args.profile,
        kv_bandwidth_gbps=args.kv_bandwidth_gbps,
        kv_latency_ms=args.kv_latency_ms,
        local_overhead_ms=args.local_overhead_ms,
        remote_overhead_ms=args.remote_overhead_ms,
        shared_cores=args.shared_cores,
        step_time_scale=step_time_scale,
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
    sim = summarize(records, real["goodput"]["slo_ms"], run.cluster.workers())
    sim["engine_steps"] = run.cluster.engine_steps()
    return sim


def busy_s(summary: dict) -> float | None:
    """Seconds all engines spent in steps over the run; None where the run did not record
    them (runs before baton:engine_step_duration_seconds, or without a metrics page)."""
    steps = summary.get("engine_steps")
    return sum(w["busy_s"] for w in steps.values()) if steps else None


def speed_matched_summary(
    run_dir: Path, args: argparse.Namespace, rounds: int = 6
) -> tuple[dict, dict, float]:
    """(real summary, simulated summary, scale): the run simulated with its steps scaled so
    that the simulated engines compute as many seconds as the run's engines did. Fixed-point
    rounds (the schedule, so the steps, changes with the scale: under load the routing may
    flip between rounds); the round whose engine seconds came closest is kept."""
    scale = 1.0
    real, sim = simulated_summary(run_dir, args, scale)
    real_busy = busy_s(real)
    if real_busy is None:
        raise ValueError(f"{run_dir}: results.json has no engine_steps (re-run the experiment)")
    best = (abs(busy_s(sim) - real_busy), sim, scale)
    for _ in range(rounds):
        scale *= real_busy / busy_s(sim)
        sim = replay(real, run_dir, args, scale)
        best = min(best, (abs(busy_s(sim) - real_busy), sim, scale), key=lambda b: b[0])
    return real, best[1], best[2]


def error(real: float | None, sim: float | None) -> float | None:
    """(sim - real) / real; None where either is missing or real is 0."""
    if real is None or sim is None or real == 0:
        return None
    return (sim - real) / real


def spread(values: list[float]) -> float | None:
    """How far repeats of one figure lie apart: (max - min) / median; None where the median
    is 0."""
    mid = statistics.median(values)
    return None if mid == 0 else (max(values) - min(values)) / mid


def near_median(values: list[float]) -> bool:
    """Every value within the tolerance of the values' median (which is not 0)."""
    mid = statistics.median(values)
    return mid != 0 and all(abs(v - mid) <= TOLERANCE * abs(mid) for v in values)


def validation_table(rows: list[tuple[str, list[dict], dict]]) -> str:
    """Markdown: one line per run (name, its real summaries - one per repeat -, the simulated
    one), real / sim (error against the real median) per metric and the seconds the engines
    computed (not a target: where the speed comes from); counts of figures within the
    tolerance, and with repeats, of the figures whose repeats agree within it."""
    head = "| run | " + " | ".join(f"{label} real / sim" for label, _ in METRICS)
    head += " | engine busy s real / sim |"
    lines = [head, "|" + "---|" * (len(METRICS) + 2)]
    within = total = repeated = repeatable = repeatable_within = in_range = 0
    repeats = max(len(reals) for _, reals, _ in rows)
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    for name, reals, sim in rows:
        cells = []
        for _, get in METRICS:
            values = [get(real) for real in reals]
            r, s = statistics.median(values), get(sim)
            e = error(r, s)
            cell = fmt(r)
            if len(values) > 1:
                cell += f" [{fmt(min(values))}-{fmt(max(values))}]"
            cell += f" / {fmt(s)}" + ("" if e is None else f" ({e:+.0%})")
            if e is not None:
                total += 1
                within += abs(e) <= TOLERANCE
                if len(values) > 1:
                    repeated += 1
                    agree = near_median(values)
                    repeatable += agree
                    repeatable_within += agree and abs(e) <= TOLERANCE
                    in_range += min(values) * (1 - TOLERANCE) <= s <= max(values) * (1 + TOLERANCE)
            cells.append(cell)
        busy = [b for b in map(busy_s, reals) if b is not None]
        cells.append(f"{fmt(statistics.median(busy) if busy else None)} / {fmt(busy_s(sim))}")
        lines.append(f"| {name} ({len(reals)}) | " + " | ".join(cells) + " |")
    if repeats > 1:
        lines.append(
            f"\nreal: median [min-max] of the repeats (their count after the run's name); sim's "
            f"error against the median.\n{within} of {total} figures within {TOLERANCE:.0%} of "
            f"the real median. Of the {repeated} figures with repeats, {repeatable} repeat within "
            f"{TOLERANCE:.0%} of their median, and of those {repeatable_within} are simulated "
            f"within {TOLERANCE:.0%}; {in_range} of the {repeated} simulated figures lie in the "
            f"repeats' range widened by {TOLERANCE:.0%}."
        )
    else:
        lines.append(f"\n{within} of {total} figures within {TOLERANCE:.0%}.")
    return "\n".join(lines)


def repeats_of(roots: list[Path]) -> dict[str, list[Path]]:
    """{run name: its directories, one per root that holds it}; a run is named by its path
    under its root (experiment/run, or the run alone when a root is one experiment's)."""
    found: dict[str, list[Path]] = defaultdict(list)
    for root in roots:
        for manifest in sorted(root.rglob("manifest.yaml")):
            run_dir = manifest.parent
            rel = run_dir.relative_to(root)
            parts = rel.parts[-2:] if len(rel.parts) >= 2 else (root.name, *rel.parts)
            found[": ".join(parts)].append(run_dir)
    return dict(sorted(found.items()))


def add_replay_args(p: argparse.ArgumentParser) -> None:
    """How real runs are simulated again (also benchmarks/sim_calibration.py's flags)."""
    p.add_argument("--profile", default=str(DEFAULT_PROFILE), help="step profile JSON")
    p.add_argument("--kv-bandwidth-gbps", type=float, default=2.0)
    p.add_argument("--kv-latency-ms", type=float, default=2.0)
    p.add_argument("--vocab-size", type=int, default=49152)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sim_validation")
    p.add_argument(
        "runs",
        nargs="+",
        help="an experiments output directory (or one experiment's); several: repeats of the "
        "same runs, compared by their median",
    )
    add_replay_args(p)
    add_overhead_args(p, shared_cores=os.cpu_count())
    p.add_argument(
        "--speed-from-run",
        action="store_true",
        help="simulate each run with its steps scaled to the seconds its engines computed "
        "(engine_steps in results.json): the machine's speed during that run taken as given, "
        "the rest (queues, batching, routing, caching) predicted; repeats are not merged",
    )
    p.add_argument(
        "--sensitivity",
        type=float,
        metavar="FRACTION",
        help="also simulate each run with every step FRACTION faster and slower (e.g. 0.05) "
        "and print how far each figure moves: a figure that moves by more than the tolerance "
        "cannot repeat within it on a machine whose speed drifts that much between runs",
    )
    p.add_argument("--out", help="also write the table to this file")
    args = p.parse_args(argv)
    if args.sensitivity is not None and not 0 < args.sensitivity < 1:
        p.error(f"--sensitivity must be in (0, 1), got {args.sensitivity}")
    runs = repeats_of([Path(r) for r in args.runs])
    if not runs:
        print(
            f"error: no experiment runs (manifest.yaml) under {' '.join(args.runs)}",
            file=sys.stderr,
        )
        return 2
    rows = []
    if args.speed_from_run:
        try:
            for name, run_dirs in runs.items():
                for d in run_dirs:
                    real, sim, scale = speed_matched_summary(d, args)
                    rows.append((f"{name} [{d.parents[1].name}] x{scale:.2f}", [real], sim))
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return _print_table(rows, runs, args)
    for name, run_dirs in runs.items():
        reals, sims = zip(*(simulated_summary(d, args) for d in run_dirs), strict=True)
        configs = {
            repr(real["config"].get("options")) + repr(real["config"].get("seed")) for real in reals
        }
        if len(configs) > 1:
            print(
                f"error: the repeats of {name} ran different workloads or seeds: "
                + ", ".join(map(str, run_dirs)),
                file=sys.stderr,
            )
            return 2
        rows.append((name, list(reals), sims[0]))
    return _print_table(rows, runs, args)


def sensitivity_table(rows: list[tuple[str, list[dict]]], fraction: float) -> str:
    """Markdown: per run (name, its simulated summaries at speeds 1 - fraction, 1 and
    1 + fraction), each figure's range and its spread over the median; a count of the figures
    that leave the tolerance around their median."""
    head = f"| run (steps x{1 - fraction:g} / x1 / x{1 + fraction:g}) | "
    head += " | ".join(f"{label} range (spread)" for label, _ in METRICS) + " |"
    lines = [head, "|" + "---|" * (len(METRICS) + 1)]
    moved = total = 0
    for name, sims in rows:
        cells = []
        for _, get in METRICS:
            values = [get(sim) for sim in sims]
            if statistics.median(values) == 0:
                cells.append("-")
                continue
            total += 1
            moved += not near_median(values)
            cells.append(f"{min(values):.1f}-{max(values):.1f} ({spread(values):.0%})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append(
        f"\n{moved} of {total} simulated figures move further than {TOLERANCE:.0%} from their "
        f"median when every step runs {fraction:.0%} faster or slower."
    )
    return "\n".join(lines)


def _print_table(
    rows: list[tuple[str, list[dict], dict]],
    runs: dict[str, list[Path]],
    args: argparse.Namespace,
) -> int:
    text = validation_table(rows)
    if args.sensitivity is not None:
        base = getattr(args, "step_time_scale", 1.0)
        speeds = (1 - args.sensitivity, 1.0, 1 + args.sensitivity)
        sims = []
        for name, run_dirs in runs.items():
            real, _ = read_results(run_dirs[0])
            sims.append((name, [replay(real, run_dirs[0], args, base * f) for f in speeds]))
        text += "\n\n" + sensitivity_table(sims, args.sensitivity)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
