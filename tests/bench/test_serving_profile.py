"""`baton profile serving` end to end on the tiny checkpoint, both shapes on local Ray: every
request answered, each engine's phases add up to its measured step time (a consistency check,
not a timing one), every token the client got is matched to the step that sampled it, and
every process's threads are read by their names."""

from __future__ import annotations

import json

import pytest
import yaml

from baton.cli import main
from tests.cluster.manifests import tiny_manifest

pytestmark = pytest.mark.ray


def test_profile_serving_both_shapes(tiny_llama, tmp_path, capsys):
    manifest = tmp_path / "tiny.yaml"
    manifest.write_text(yaml.safe_dump(tiny_manifest(tiny_llama)))
    out = tmp_path / "out"
    argv = ["profile", "serving", "--manifest", str(manifest), "--streams", "1,2"]
    argv += ["--requests-per-stream", "2", "--rounds", "2", "--warmup", "1", "--vocab-size", "512"]
    argv += ["-o", "system_len=24", "-o", "user_len=8", "-o", "output_len=4"]
    assert main([*argv, "--out", str(out)]) == 0

    text = capsys.readouterr().out
    written = json.loads((out / "serving_profile.json").read_text())
    runs = written["runs"]
    assert [(r["shape"], r["round"], r["streams"]) for r in runs] == [
        (shape, round_, streams)
        for shape in ("aggregated", "disaggregated")
        for round_ in (0, 1)
        for streams in (1, 2)
    ]
    for run in runs:
        assert f"== {run['shape']}, {run['streams']} stream" in text
        s = run["summary"]
        assert (s["completed"], s["failed"]) == (2 * run["streams"], 0)
        # each stream count of each round draws its own requests after its warm-up's: none
        # repeats a prompt an earlier run cached, so no request hits more than the system prompt
        seed = run["streams"] + 1000 * run["round"]
        assert (s["config"]["seed"], s["config"]["skip_sessions"]) == (seed, 1)
        assert s["cache"]["cached_tokens"] <= 24 * s["completed"]
        roles = {"aggregated": 1, "disaggregated": 2}[run["shape"]]
        assert len(run["engines"]) == roles
        for engine in run["engines"].values():
            assert engine["steps"] > 0 and engine["step_ms"] > 0
            # the phases are laps of one timer: they add up to the step (float rounding only)
            assert engine["phases_sum_ms"] == pytest.approx(engine["step_ms"], rel=1e-6)
            assert abs(engine["unattributed_ms"]) < 1e-6 * engine["step_ms"] + 1e-9
            assert {"schedule", "inputs", "forward", "sample", "outputs"} <= set(
                engine["phases_ms"]
            )
        path = run["token_path"]
        tokens = 4 * s["completed"]
        assert path["matched"] == path["chunks"] and s["completed"] <= path["chunks"] <= tokens
        assert path["first_ms"]["median"] is not None
        labels = set(run["threads"])
        assert labels == {"router", "client", *run["engines"]}
        for worker in run["engines"]:
            names = {t["name"] for t in run["threads"][worker]["threads"]}
            assert "engine-loop" in names, names
        assert run["threads"]["router"]["cpu_s"] >= 0
    # the kernel counts CPU time in clock ticks (10 ms): a run this short can leave the router
    # under one tick, but not every run of the profile
    assert sum(run["threads"]["router"]["cpu_s"] for run in runs) > 0
    for shape in ("aggregated", "disaggregated"):
        two = written["ratios"][shape]["2"]
        assert two["base_streams"] == 1 and len(two["rounds"]["tok_s"]) == 2
        assert all(r > 0 for r in two["rounds"]["tok_s"] + two["rounds"]["ttft_p50"])
        assert f"{shape}, 2 vs 1 stream (median of 2 rounds" in text
