"""Experiment run directories made by the simulator, standing in for real runs of
`python -m benchmarks.experiments` (a manifest.yaml and a results.json each) with known
figures behind them: a control path, a step time scale."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from benchmarks.experiment_shapes import Shape
from deploy.manifest import load_manifest
from perf.sim.command import main as simulate_main


def write_simulated_run(run_dir: Path, shape: Shape, *flags: str) -> None:
    """Six 256-token random requests one at a time (as the idle experiment sends them) through
    `shape`, simulated with `flags` (baton simulate's), written as an experiment run."""
    from cluster.local import LOCAL_MANIFEST

    base = load_manifest(LOCAL_MANIFEST).model_dump(mode="json")
    run_dir.mkdir(parents=True)
    manifest = run_dir / "manifest.yaml"
    manifest.write_text(yaml.safe_dump(shape.manifest(base, run_dir.parent.name)))
    argv = ["--manifest", str(manifest), "--workload", "random", "-o", "input_len=256"]
    argv += ["-o", "output_len=4", "--num-requests", "6", "--max-concurrency", "1"]
    argv += ["--kv-bandwidth-gbps", "2", "--out", str(run_dir), *flags]  # as sim_validation's
    assert simulate_main(argv) == 0
    results = json.loads((run_dir / "results.json").read_text())
    results["config"]["workload_name"] = "random"  # as benchmarks/experiments.py records it
    (run_dir / "results.json").write_text(json.dumps(results))
