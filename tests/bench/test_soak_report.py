"""The soak benchmark's per-window latencies (benchmarks/soak_report.py), by hand."""

from __future__ import annotations

from benchmarks.soak_report import window_table, windows
from perf.bench.timeline import RequestRecord


def test_windows_hold_the_requests_sent_in_them_with_linear_percentiles():
    r = RequestRecord
    records = [
        r("a", 0.0, 0.5, ((0.1, 1), (0.5, 1)), 4),  # ttft 100 ms, e2e 500 ms
        r("b", 1.0, 1.2, ((1.2, 1),), 4),  # ttft = e2e = 200 ms
        r("c", 2.5, 2.6, (), 4, status="UNAVAILABLE"),
        r("d", 9.9, 10.3, ((10.0, 1), (10.3, 1)), 4),  # window 0: ttft 100, e2e 400
        r("e", 10.0, 10.4, ((10.3, 1), (10.4, 1)), 4),  # window 1 (starts at 10 s)
    ]
    rows = windows(records, 10.0)
    # window 0: TTFT 100, 200, 100 -> p50 100, p99 at rank 1.98: 100 + 0.98 * 100;
    # E2E 500, 200, 400 -> p50 400, p99 400 + 0.98 * 100
    assert rows == [
        dict(start_s=0.0, requests=4, failed=1, ttft_p50_ms=100.0, ttft_p99_ms=198.0)
        | dict(e2e_p50_ms=400.0, e2e_p99_ms=498.0),
        dict(start_s=10.0, requests=1, failed=0, ttft_p50_ms=300.0, ttft_p99_ms=300.0)
        | dict(e2e_p50_ms=400.0, e2e_p99_ms=400.0),
    ]
    assert window_table(rows).splitlines()[2] == "| 0 | 4 | 1 | 100.0 / 198.0 | 400.0 / 498.0 |"


def test_a_window_without_completed_requests_has_no_percentiles():
    rows = windows([RequestRecord("a", 1.0, 2.0, (), 4, status="UNAVAILABLE")], 10.0)
    assert rows == [
        dict(start_s=0.0, requests=1, failed=1, ttft_p50_ms=None, ttft_p99_ms=None)
        | dict(e2e_p50_ms=None, e2e_p99_ms=None)
    ]
