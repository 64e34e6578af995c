"""The simulator's per-request control path: how it shifts a request, and that
benchmarks/sim_calibration.py recovers it from idle runs (here: runs simulated with a known
control path, standing in for the real runs of `python -m benchmarks.experiments idle`)."""

from __future__ import annotations

import json
import shutil

import pytest

from benchmarks import sim_calibration
from benchmarks.experiment_shapes import Shape
from engine.step_model import StepModel
from perf.bench.driver import BenchConfig
from perf.bench.workloads import RandomWorkload, TokenSpace
from perf.sim.cluster import ClusterConfig
from perf.sim.command import DEFAULT_PROFILE, REQUEST_OVERHEAD_KEY
from perf.sim.driver import simulate
from tests.sim.runs import write_simulated_run

MODEL = StepModel({"const": 0.01, "prefill_tokens": 0.001})


def ttft(cluster: ClusterConfig) -> float:
    config = BenchConfig(num_requests=1)
    workload = RandomWorkload(input_len=64, output_len=3)
    (r,), _ = simulate(workload, TokenSpace(), config, cluster, MODEL)
    return r.ttft


@pytest.mark.parametrize("prefill", [0, 1])
def test_control_path_delays_a_request_by_exactly_its_path(prefill):
    bare = ttft(ClusterConfig(prefill=prefill))
    timed = ttft(ClusterConfig(prefill=prefill, local_overhead_s=0.25, remote_overhead_s=0.6))
    assert timed - bare == pytest.approx(0.25 if prefill == 0 else 0.6)


def test_negative_overhead_is_refused():
    with pytest.raises(ValueError, match="overheads"):
        ClusterConfig(local_overhead_s=-0.1)


def test_calibration_recovers_the_control_path_of_idle_runs(tmp_path, capsys):
    for name, shape in (("aggregated", Shape(0, 1)), ("disaggregated", Shape(1, 1))):
        overheads = ("--local-overhead-ms", "250", "--remote-overhead-ms", "600")
        write_simulated_run(tmp_path / "idle" / name, shape, *overheads)
    profile = tmp_path / "profile.json"
    shutil.copy(DEFAULT_PROFILE, profile)
    capsys.readouterr()
    assert sim_calibration.main([str(tmp_path / "idle"), "--profile", str(profile), "--write"]) == 0
    written = json.loads(profile.read_text())[REQUEST_OVERHEAD_KEY]
    assert written == {"local": pytest.approx(250, abs=0.2), "remote": pytest.approx(600, abs=0.2)}
    out = capsys.readouterr().out
    assert "aggregated: TTFT p50 real" in out and "-> remote control path 600.0 ms" in out


def test_calibration_without_runs_is_an_error(tmp_path, capsys):
    assert sim_calibration.main([str(tmp_path)]) == 2
    assert "no experiment runs" in capsys.readouterr().err


def test_steps_slow_down_while_more_workers_compute_than_shared_cores():
    workload = RandomWorkload(input_len=64, output_len=1)
    config = BenchConfig(num_requests=2)  # both at once, one per decode worker

    def ttfts(cores):
        cluster = ClusterConfig(prefill=0, decode=2, shared_cores=cores)
        records, run = simulate(workload, TokenSpace(), config, cluster, MODEL)
        assert run.cluster.busy_workers == 0  # every worker idle again at the end
        return sorted(r.ttft for r in records)

    step = 0.01 + 0.064  # one 64-token prefill step
    assert ttfts(None) == pytest.approx([step, step])
    assert ttfts(2) == pytest.approx([step, step])  # a core each
    # one core: the second worker's step starts while the first computes, at half speed
    assert ttfts(1) == pytest.approx([step, 2 * step])


def test_step_time_scale_stretches_every_step_and_the_busy_seconds():
    workload = RandomWorkload(input_len=64, output_len=3)
    config = BenchConfig(num_requests=1)
    step = [0.01 + 0.064, 0.01, 0.01]  # the prefill step, then two decode steps
    for scale in (1.0, 2.5):
        cluster = ClusterConfig(prefill=0, decode=1, step_time_scale=scale)
        (r,), run = simulate(workload, TokenSpace(), config, cluster, MODEL)
        assert r.ttft == pytest.approx(scale * step[0])
        assert run.cluster.engine_steps() == {
            "decode-0": {"steps": 3, "busy_s": pytest.approx(scale * sum(step))}
        }
    with pytest.raises(ValueError, match="step time scale"):
        ClusterConfig(step_time_scale=0)


def test_dynamic_chunking_corrects_its_model_by_the_simulated_steps():
    # Steps run 2x the profile: as the engine does, the chunk budget learns that from the
    # steps it ran and shrinks its chunks, so the steps come back to the target.
    from perf.sim.worker import WorkerConfig

    workload = RandomWorkload(input_len=3000, output_len=1)
    worker = WorkerConfig(itl_target_ms=100.0, max_num_batched_tokens=4096, chunk_size=4096)
    cluster = ClusterConfig(prefill=0, decode=1, worker=worker, step_time_scale=2.0)
    _, run = simulate(workload, TokenSpace(), BenchConfig(num_requests=1), cluster, MODEL)
    budget = run.cluster.decode["decode-0"].budget
    assert budget.ratio == pytest.approx(2.0, rel=0.01)
    steps = run.cluster.engine_steps()["decode-0"]
    # unscaled, each step would take 90 tokens (0.01 + 0.09 s) and run 0.2 s; corrected, the
    # chunks halve after the first few steps: ~3000 / 45 steps of ~0.1 s
    assert 60 <= steps["steps"] <= 72
    assert steps["busy_s"] / steps["steps"] == pytest.approx(0.1, rel=0.1)
