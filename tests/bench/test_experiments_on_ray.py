"""One experiment run for real, then simulated again by benchmarks/sim_validation.py: a local
Ray cluster of the run's shape started from the base manifest (the path `baton bench
--manifest` takes), the workload through its gRPC door, results and summary written, the
cluster torn down."""

from __future__ import annotations

import json

import pytest
import yaml

from benchmarks import sim_validation
from benchmarks.experiments import main
from tests.cluster.manifests import tiny_manifest

pytestmark = pytest.mark.ray


def test_quick_aggregated_run_prefills_every_prompt_locally(tiny_llama, tmp_path, capsys):
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump(tiny_manifest(tiny_llama)))
    out = tmp_path / "out"
    argv = ["short-random", "--quick", "--base-manifest", str(base), "--out", str(out)]
    assert main([*argv, "--only", "aggregated", "--quiet", "--no-plots", "--seed", "3"]) == 0
    results = json.loads((out / "short-random" / "aggregated" / "results.json").read_text())
    assert (results["completed"], results["failed"]) == (8, 0)
    # 0 prefill + 2 decode workers: no KV moved, both decode workers used
    assert (results["kv"]["remote_prefills"], results["kv"]["local_prefills"]) == (0, 8)
    assert results["config"]["shape"] == dict(
        prefill=0, decode=2, policy="cache_aware", local_prefill_tokens=0
    )
    assert len(results["load_balance"]["decode"]["requests"]) == 2
    assert all(len(r["chunks"]) and r["status"] == "OK" for r in results["records"])
    text = (out / "short-random" / "summary.md").read_text()
    assert "seed 3" in text and "8 requests per run" in text
    assert "no verdict: run 'disaggregated' was not part of this invocation" in text
    assert "written:" in capsys.readouterr().out
    # the report again from results.json alone (no cluster): the same summary
    (out / "short-random" / "summary.md").unlink()
    assert main([*argv, "--only", "aggregated", "--quiet", "--no-plots", "--report-only"]) == 0
    assert "8 requests per run" in (out / "short-random" / "summary.md").read_text()
    again = json.loads((out / "short-random" / "aggregated" / "results.json").read_text())
    assert again == results
    capsys.readouterr()
    # the run simulated again from its manifest.yaml and results.json
    assert sim_validation.main([str(out), "--vocab-size", "512"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[2].startswith("| short-random: aggregated (1) | ")
    assert table[2].count(" / ") == 5  # real / sim of each metric, and the engines' seconds
    # the real run recorded its engine's steps from the cluster's /metrics
    real_busy = table[2].split("|")[-2].split(" / ")[0]
    assert float(real_busy) > 0
