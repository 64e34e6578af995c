"""The simulator's per-request control path, measured: what an idle cluster's TTFT holds beyond
the engine steps the step profile predicts.

    python -m benchmarks.experiments idle              # one request at a time, both shapes
    python -m benchmarks.sim_calibration runs/experiments/idle [--profile P] [--write]

For each run of the `idle` experiment (requests one at a time, so nothing queues) the run is
simulated without any control path, and the difference of the TTFT medians is that run's
overhead: "local" from the aggregated run (router -> decode worker, which prefills; the first
token's way back), "remote" from the disaggregated one (index refresh, the decode worker's
reservation, the prefill call, the KV hand-over, all as Ray and gRPC calls). `--write` stores
them in the profile as request_overhead_ms, where `baton simulate`, `baton plan` and
benchmarks/sim_validation.py read them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import yaml

from benchmarks.sim_validation import add_replay_args, simulated_summary
from perf.sim.command import REQUEST_OVERHEAD_KEY


def path_of(run_dir: Path) -> str:
    """The path a run's requests took: "local" (prefilled on their decode worker) or "remote"."""
    spec = yaml.safe_load((run_dir / "manifest.yaml").read_text())["spec"]
    return "local" if spec["prefill"]["replicas"] == 0 else "remote"


def measure(runs: Path, args: argparse.Namespace) -> dict[str, float]:
    """{"local": ms, "remote": ms} (the paths the runs under `runs` took)."""
    bare = argparse.Namespace(**{**vars(args), "local_overhead_ms": 0.0, "remote_overhead_ms": 0.0})
    found: dict[str, float] = {}
    for run_dir in sorted(m.parent for m in runs.rglob("manifest.yaml")):
        real, sim = simulated_summary(run_dir, bare)
        real_ms, sim_ms = (s["latency_ms"]["ttft"]["median"] for s in (real, sim))
        path = path_of(run_dir)
        found[path] = max(0.0, real_ms - sim_ms)
        note = (
            f" (the profile predicts {sim_ms - real_ms:.1f} ms more than the run took: it was "
            "measured slower than this machine is now; `baton profile` again)"
            if real_ms < sim_ms
            else ""
        )
        print(
            f"{run_dir.name}: TTFT p50 real {real_ms:.1f} ms, simulated steps {sim_ms:.1f} ms "
            f"-> {path} control path {found[path]:.1f} ms{note}"
        )
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sim_calibration")
    p.add_argument("runs", help="the idle experiment's output (runs/experiments/idle)")
    add_replay_args(p)
    p.add_argument("--write", action="store_true", help="store the figures in the profile")
    p.add_argument("--shared-cores", type=float, default=os.cpu_count(), help="as sim_validation's")
    args = p.parse_args(argv)
    if not any(Path(args.runs).rglob("manifest.yaml")):
        print(f"error: no experiment runs (manifest.yaml) under {args.runs}", file=sys.stderr)
        return 2
    found = measure(Path(args.runs), args)
    if args.write:
        profile = Path(args.profile)
        data = json.loads(profile.read_text())
        data[REQUEST_OVERHEAD_KEY] = {
            **data.get(REQUEST_OVERHEAD_KEY, {}),
            **{k: round(v, 1) for k, v in found.items()},
        }
        profile.write_text(json.dumps(data, indent=2) + "\n")
        print(f"written: {profile} {REQUEST_OVERHEAD_KEY}={data[REQUEST_OVERHEAD_KEY]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
