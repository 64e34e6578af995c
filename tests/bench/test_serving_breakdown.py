"""The serving profile's arithmetic on exact readings: an engine's phases per step from two
metrics snapshots, the token path from records and step ends, and the command's refusals."""

from __future__ import annotations

import pytest

from baton.cli import main
from perf.bench.timeline import RequestRecord
from perf.serving.breakdown import engine_breakdown, token_path


def families(steps: int, step_s: float, gaps: int, gap_s: float, phases: dict) -> list[dict]:
    """A worker's metrics families as engine.metrics.snapshot gives them (buckets left out)."""
    phase = "baton:engine_step_phase_seconds_sum"
    phase_samples = [[phase, {"phase": p}, s] for p, s in phases.items()]
    return [
        {"name": "baton:engine_step_duration_seconds", "type": "histogram", "help": "",
         "samples": [["baton:engine_step_duration_seconds_count", {}, steps],
                     ["baton:engine_step_duration_seconds_sum", {}, step_s]]},
        {"name": "baton:engine_step_gap_seconds", "type": "histogram", "help": "",
         "samples": [["baton:engine_step_gap_seconds_count", {}, gaps],
                     ["baton:engine_step_gap_seconds_sum", {}, gap_s]]},
        {"name": "baton:engine_step_phase_seconds", "type": "histogram", "help": "",
         "samples": phase_samples},
        {"name": "baton:generation_tokens", "type": "counter", "help": "",
         "samples": [["baton:generation_tokens_total", {}, 99.0]]},
    ]  # fmt: skip


def test_engine_phases_per_step_over_a_run():
    before = families(10, 0.5, 9, 0.02, {"schedule": 0.01, "forward": 0.45, "sample": 0.04})
    after = families(
        30, 1.7, 28, 0.06, {"schedule": 0.03, "forward": 1.45, "sample": 0.12, "matmul": 0.1}
    )
    got = engine_breakdown(before, after)
    assert got["steps"] == 20 and got["gaps"] == 19
    assert got["busy_s"] == pytest.approx(1.2)
    assert got["step_ms"] == pytest.approx(60.0)
    assert got["gap_ms"] == pytest.approx(40 / 19)
    assert list(got["phases_ms"]) == ["forward", "matmul", "sample", "schedule"]  # most first
    assert got["phases_ms"] == pytest.approx(
        {"forward": 50.0, "matmul": 5.0, "sample": 4.0, "schedule": 1.0}
    )
    assert got["unattributed_ms"] == pytest.approx(0.0, abs=1e-9)
    idle = engine_breakdown(after, after)
    assert (idle["steps"], idle["step_ms"], idle["phases_ms"], idle["gap_ms"]) == (0, 0.0, {}, 0.0)


def test_token_path_matches_each_chunk_to_its_tokens_step():
    start = 1000.0  # the run's t = 0 on the monotonic clock
    records = [
        RequestRecord("s0", 0.0, 0.5, ((0.2, 1), (0.3, 2), (0.5, 1)), 10,
                      server_request_id="run-s0"),
        RequestRecord("s1", 0.0, 0.4, ((0.4, 1),), 10, server_request_id="run-s1"),
        RequestRecord("s2", 0.0, 0.1, (), 10, status="UNAVAILABLE", server_request_id="run-s2"),
    ]  # fmt: skip
    times = [
        ("run-s0", 0, 1000.19),  # the prefill worker's first token
        ("run-s0", 1, 1000.27),
        ("run-s0", 2, 1000.28),  # the chunk at 0.3 carries tokens 1 and 2: matched by token 2
        ("run-s0", 3, 1000.47),
        ("run-s1", 0, 1000.39),
        ("other", 0, 999.0),
    ]
    got = token_path(records, times, start)
    assert (got["chunks"], got["matched"]) == (4, 4)
    assert got["first_ms"]["median"] == pytest.approx(10.0)  # 0.2 - 0.19 and 0.4 - 0.39
    assert got["later_ms"]["mean"] == pytest.approx(25.0)  # 0.3 - 0.28 and 0.5 - 0.47
    lost = token_path(records, times[1:], start)  # no record of token 0 of s0
    assert (lost["chunks"], lost["matched"]) == (4, 3)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--shapes", "sideways"], "--shapes takes aggregated, disaggregated"),
        (["--streams", "0"], "--streams takes counts >= 1"),
        (["--requests-per-stream", "0"], "--requests-per-stream must be >= 1"),
        (["--rounds", "0"], "--rounds must be >= 1"),
        (["-o", "nosuch=1"], "workload shared-prefix has no option 'nosuch'"),
        (["--manifest", "/nonexistent.yaml"], "/nonexistent.yaml"),
    ],
)
def test_bad_options_exit_2_before_starting_anything(argv, message, capsys):
    assert main(["profile", "serving", *argv]) == 2
    assert message in capsys.readouterr().err
