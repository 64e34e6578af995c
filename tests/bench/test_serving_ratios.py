"""stream_ratios: each stream count's figures over the first stream count's of the same shape
and round, and the median over the rounds."""

from __future__ import annotations

import pytest

from perf.serving.ratios import ratios_table, stream_ratios


def run(shape, streams, round_, tok_s, ttft, itl):
    summary = {
        "throughput": {"output_tokens_per_s": tok_s},
        "latency_ms": {"ttft": {"median": ttft}, "itl": {"median": itl}},
    }
    return {"shape": shape, "streams": streams, "round": round_, "summary": summary}


def test_ratios_divide_by_the_same_rounds_first_stream_count():
    runs = [
        run("aggregated", 1, 0, 40.0, 200.0, 20.0),
        run("aggregated", 4, 0, 100.0, 400.0, 30.0),
        run("aggregated", 1, 1, 20.0, 400.0, 40.0),  # a slow minute: every figure moves
        run("aggregated", 4, 1, 60.0, 600.0, 50.0),
        run("aggregated", 1, 2, 40.0, 200.0, 20.0),
        run("aggregated", 4, 2, 80.0, 500.0, 40.0),
        run("disaggregated", 2, 0, 10.0, 100.0, None),  # no second token: no ITL
        run("disaggregated", 8, 0, 50.0, 150.0, 30.0),
    ]
    ratios = stream_ratios(runs)
    four = ratios["aggregated"]["4"]
    assert four["base_streams"] == 1
    assert four["rounds"] == {
        "tok_s": [2.5, 3.0, 2.0],
        "ttft_p50": [2.0, 1.5, 2.5],
        "itl_p50": [1.5, 1.25, 2.0],
    }
    assert four["median"] == {"tok_s": 2.5, "ttft_p50": 2.0, "itl_p50": 1.5}
    eight = ratios["disaggregated"]["8"]
    assert eight["base_streams"] == 2
    assert eight["rounds"] == {"tok_s": [5.0], "ttft_p50": [1.5], "itl_p50": [None]}
    assert eight["median"] == {"tok_s": 5.0, "ttft_p50": 1.5, "itl_p50": None}
    text = ratios_table(ratios)
    assert "aggregated, 4 vs 1 stream (median of 3 rounds" in text
    assert "tok/s 2.50x [2.50 3.00 2.00], TTFT p50 2.00x [2.00 1.50 2.50]" in text
    assert "disaggregated, 8 vs 2 streams (median of 1 round;" in text
    assert "ITL p50 - [-]" in text


@pytest.mark.parametrize("streams", [[1], [4]])
def test_one_stream_count_has_no_ratios(streams):
    runs = [run("aggregated", n, r, 10.0, 1.0, 1.0) for r in range(2) for n in streams]
    assert stream_ratios(runs) == {} and ratios_table({}) == ""
