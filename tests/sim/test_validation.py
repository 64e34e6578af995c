"""benchmarks/sim_validation.py's table: figures against the real median, repeats found by run
name across output directories, and how far repeats spread."""

from __future__ import annotations

import json

import pytest

from benchmarks import sim_validation
from benchmarks.experiment_shapes import Shape
from benchmarks.sim_validation import repeats_of, spread, validation_table
from tests.sim.runs import write_simulated_run


def summary(ttft_p50: float, ttft_p99: float, tpot_p50: float, hit: float) -> dict:
    """The parts of a `baton bench` summary the table reads."""
    return {
        "latency_ms": {
            "ttft": {"median": ttft_p50, "p99": ttft_p99},
            "tpot": {"median": tpot_p50},
        },
        "cache": {"cached_fraction": hit / 100.0},
    }


def test_spread_is_range_over_median():
    assert spread([90.0, 100.0, 110.0]) == pytest.approx(0.2)
    assert spread([5.0]) == 0.0
    assert spread([0.0, 0.0]) is None


def test_one_real_run_per_row_counts_figures_within_ten_percent():
    rows = [("exp: a", [summary(100, 1000, 20, 50)], summary(105, 1200, 20, 0))]
    text = validation_table(rows)
    assert "| exp: a (1) | 100.0 / 105.0 (+5%) | 1000.0 / 1200.0 (+20%) |" in text
    # hit rate 50 -> 0 is -100%; 2 of 4 figures (TTFT p50, TPOT) within 10%
    assert text.endswith("2 of 4 figures within 10%.")


def test_repeats_compare_with_their_median_and_count_repeatable_figures():
    reals = [summary(100, 1000, 20, 0), summary(104, 1500, 30, 0), summary(98, 1100, 21, 0)]
    rows = [("exp: a", reals, summary(101, 1150, 21, 0))]
    text = validation_table(rows)
    # median 100 [98-104] vs 101: +1%; TTFT p99 median 1100 [1000-1500]; TPOT 21 [20-30]
    assert "| exp: a (3) | 100.0 [98.0-104.0] / 101.0 (+1%) |" in text
    assert "1100.0 [1000.0-1500.0] / 1150.0 (+5%)" in text
    assert "21.0 [20.0-30.0] / 21.0 (+0%)" in text
    # 3 figures (hit rate 0 has no error); TTFT p50 repeats within 10% of its median, the
    # others do not (1500 is 36% over 1100, 30 is 43% over 21); all three lie in the range
    assert "3 of 3 figures within 10% of the real median" in text
    assert "Of the 3 figures with repeats, 1 repeat within 10% of their median" in text
    assert "of those 1 are simulated within 10%; 3 of the 3 simulated figures lie" in text


def test_a_simulated_figure_outside_the_repeats_range_is_not_counted_in_it():
    reals = [summary(100, 1000, 20, 0), summary(102, 1010, 20, 0)]
    text = validation_table([("exp: a", reals, summary(150, 1005, 20, 0))])
    assert "2 of 3 figures within 10% of the real median" in text
    assert "2 of the 3 simulated figures lie in the repeats' range" in text


def test_repeats_are_found_by_experiment_and_run_name(tmp_path):
    for root in ("r1", "r2"):
        for run in ("idle/aggregated", "idle/disaggregated"):
            (tmp_path / root / run).mkdir(parents=True)
            (tmp_path / root / run / "manifest.yaml").write_text("{}")
    (tmp_path / "r3" / "aggregated").mkdir(parents=True)  # one experiment's directory
    (tmp_path / "r3" / "aggregated" / "manifest.yaml").write_text("{}")
    found = repeats_of([tmp_path / "r1", tmp_path / "r2", tmp_path / "r3"])
    assert list(found) == ["idle: aggregated", "idle: disaggregated", "r3: aggregated"]
    assert found["idle: aggregated"] == [
        tmp_path / "r1" / "idle" / "aggregated",
        tmp_path / "r2" / "idle" / "aggregated",
    ]


def test_no_runs_is_an_error(tmp_path, capsys):
    assert sim_validation.main([str(tmp_path), str(tmp_path)]) == 2
    assert "no experiment runs" in capsys.readouterr().err


def test_speed_from_run_recovers_the_step_time_scale_a_run_went_at(tmp_path, capsys):
    for name, shape in (("aggregated", Shape(0, 1)), ("disaggregated", Shape(1, 1))):
        write_simulated_run(tmp_path / "idle" / name, shape, "--step-time-scale", "1.5")
    capsys.readouterr()
    assert sim_validation.main([str(tmp_path), "--speed-from-run"]) == 0
    out = capsys.readouterr().out
    # the runs' engines computed 1.5x the profile's seconds: that speed, and then every figure
    assert "| idle: aggregated [" in out and "] x1.50 (1) |" in out
    assert out.count("x1.50") == 2
    assert "6 of 6 figures within 10%." in out  # hit rates are 0: no error
    # without it, the steps run at the profile's speed: TTFT 1.5x shorter
    assert sim_validation.main([str(tmp_path)]) == 0
    assert "(-33%)" in capsys.readouterr().out


def test_speed_from_run_needs_the_runs_engine_steps(tmp_path, capsys):
    run_dir = tmp_path / "idle" / "aggregated"
    write_simulated_run(run_dir, Shape(0, 1))
    results = json.loads((run_dir / "results.json").read_text())
    results["engine_steps"] = {}  # a run recorded without a metrics page, or before them
    (run_dir / "results.json").write_text(json.dumps(results))
    assert sim_validation.main([str(tmp_path), "--speed-from-run"]) == 2
    assert "has no engine_steps" in capsys.readouterr().err


def test_near_median_is_every_value_within_ten_percent_of_the_median():
    assert sim_validation.near_median([95.0, 100.0, 110.0])
    assert not sim_validation.near_median([89.0, 100.0, 101.0])
    assert not sim_validation.near_median([0.0, 0.0])


def test_sensitivity_table_counts_figures_that_leave_the_tolerance():
    # at steps x0.95 / x1 / x1.05: TTFT p50 moves with the speed (within 10% of its median),
    # TTFT p99 doubles (a queue that builds up), TPOT stays, hit rate 0 has no spread
    sims = [summary(95, 1000, 20, 0), summary(100, 1500, 20, 0), summary(105, 2000, 20, 0)]
    text = sim_validation.sensitivity_table([("exp: a", sims)], 0.05)
    assert text.startswith("| run (steps x0.95 / x1 / x1.05) | TTFT p50 ms range (spread) |")
    assert "| exp: a | 95.0-105.0 (10%) | 1000.0-2000.0 (67%) | 20.0-20.0 (0%) | - |" in text
    assert text.endswith(
        "1 of 3 simulated figures move further than 10% from their median when every step "
        "runs 5% faster or slower."
    )


def test_sensitivity_simulates_each_run_at_three_speeds(tmp_path, capsys):
    write_simulated_run(tmp_path / "idle" / "aggregated", Shape(0, 1))
    assert sim_validation.main([str(tmp_path), "--sensitivity", "0.05"]) == 0
    out = capsys.readouterr().out
    # one request at a time: every figure moves with the speed (+-5%), no further
    assert "| run (steps x0.95 / x1 / x1.05) |" in out
    assert "0 of 3 simulated figures move further than 10%" in out
    with pytest.raises(SystemExit):
        sim_validation.main([str(tmp_path), "--sensitivity", "1.5"])
