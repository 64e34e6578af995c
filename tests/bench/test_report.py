"""The report's arithmetic on a hand-made timeline, every expected value computed by hand;
the oracle cache's hits by hand on a small case; results.json, the table, compare and plots."""

from __future__ import annotations

import pytest

from perf.bench.oracle import OracleCache
from perf.bench.report import compare_table, meets_slo, parse_slo, summarize, table
from perf.bench.timeline import RequestRecord, read_results, write_results

WORKERS = {"prefill": ["p0", "p1", "p2"], "decode": ["d0"]}


def timeline() -> list[RequestRecord]:
    r = RequestRecord
    return [
        # ttft 0.1, e2e 0.4, 4 tokens: tpot 0.3 / 3 = 0.1, itls 0.1 and 0.2
        r("a", 0.0, 0.4, ((0.1, 1), (0.2, 1), (0.4, 2)), 10, 4, 8, "p0", "d0"),
        # ttft 0.3, e2e 0.5, 2 tokens: tpot 0.2, itl 0.2
        r("b", 0.5, 1.0, ((0.8, 1), (1.0, 1)), 20, 0, 0, "p0", "d0"),
        # one token: ttft 0.2 = e2e, no tpot, no itl; prefilled locally on d0
        r("c", 1.0, 1.2, ((1.2, 1),), 6, 4, 4, "d0", "d0"),
        r("d", 1.1, 1.15, (), 8, status="RESOURCE_EXHAUSTED", error="no blocks"),
        # ttft 0.1, e2e 0.5, 4 tokens: tpot 0.4 / 3, itl 0.4
        r("e", 1.5, 2.0, ((1.6, 2), (2.0, 2)), 12, 8, 8, "p1", "d0", kind="long"),
    ]


def test_latencies_percentiles_and_throughput():
    s = summarize(timeline(), workers=WORKERS)
    assert (s["num_requests"], s["completed"], s["failed"]) == (5, 4, 1)
    assert s["failures"] == {"RESOURCE_EXHAUSTED": 1}
    assert s["duration_s"] == 2.0
    lat = s["latency_ms"]
    # TTFT 100, 300, 200, 100 ms; linear percentiles of [100, 100, 200, 300]:
    # p90 at rank 0.9 * 3 = 2.7 -> 200 + 0.7 * 100, p99 at 2.97 -> 200 + 0.97 * 100
    assert lat["ttft"] == pytest.approx(dict(mean=175, median=150, p90=270, p99=297))
    # TPOT 100, 200, 133.33 ms (c has one token)
    assert lat["tpot"] == pytest.approx(
        dict(
            mean=(100 + 200 + 400 / 3) / 3,
            median=400 / 3,
            p90=200 - 0.2 * (200 - 400 / 3),
            p99=200 - 0.02 * (200 - 400 / 3),
        )
    )
    # ITL 100, 200, 200, 400 ms: p90 at rank 2.7 -> 200 + 0.7 * 200
    assert lat["itl"] == pytest.approx(dict(mean=225, median=200, p90=340, p99=394))
    # E2E 400, 500, 200, 500 ms
    assert lat["e2e"] == pytest.approx(dict(mean=400, median=450, p90=500, p99=500))
    # 4 ok requests, 11 output tokens, 48 prompt tokens over 2 s
    assert s["throughput"] == pytest.approx(
        dict(requests_per_s=2.0, output_tokens_per_s=5.5, total_tokens_per_s=29.5)
    )


def test_goodput_counts_requests_meeting_every_slo():
    slo = parse_slo("ttft=250,tpot=150")
    assert slo == {"ttft": 250.0, "tpot": 150.0}
    # a: ok; b: TTFT 300 > 250; c: no TPOT, TTFT 200 ok; d: failed; e: TPOT 133 ok
    assert [meets_slo(r, slo) for r in timeline()] == [True, False, True, False, True]
    g = summarize(timeline(), slo)["goodput"]
    assert g["slo_ms"] == slo
    assert (g["requests_per_s"], g["fraction"]) == pytest.approx((1.5, 0.6))
    # a tighter TPOT SLO drops e (133 ms) and a (100 ms) but not c (one token)
    assert summarize(timeline(), parse_slo("tpot=99"))["goodput"]["requests_per_s"] == 0.5
    with pytest.raises(ValueError, match="KEY=MS"):
        parse_slo("ttft:5")


def test_cache_fractions_load_balance_and_kv():
    s = summarize(timeline(), workers=WORKERS)
    assert s["cache"] == pytest.approx(
        dict(
            prompt_tokens=48,
            cached_tokens=16,
            oracle_cached_tokens=20,
            cached_fraction=16 / 48,
            oracle_fraction=20 / 48,
            of_oracle=16 / 20,
            prefill_tokens_computed=48 - 16,
        )
    )
    pre, dec = s["load_balance"]["prefill"], s["load_balance"]["decode"]
    assert pre["requests"] == {"p0": 2, "p1": 1, "p2": 0}  # remote prefills only
    assert pre["prefill_tokens"] == {"p0": 6 + 20, "p1": 4, "p2": 0}
    assert pre["requests_max_over_mean"] == pytest.approx(2.0)  # 2 / (3 / 3)
    assert pre["prefill_tokens_max_over_mean"] == pytest.approx(2.6)  # 26 / (30 / 3)
    assert dec["requests"] == {"d0": 4} and dec["prefill_tokens"] == {"d0": 2}
    assert dec["requests_max_over_mean"] == 1.0
    assert s["kv"]["remote_prefills"] == 3 and s["kv"]["local_prefills"] == 1


def test_oracle_cache_by_hand():
    oracle = OracleCache(block_size=4, hash_seed="baton")
    one_to_ten = list(range(1, 11))
    assert oracle.lookup_and_insert(one_to_ten) == 0  # cold; caches blocks 1-4, 5-8
    assert oracle.lookup_and_insert(list(range(1, 9)) + [50, 51]) == 8
    # 8 tokens = 2 full blocks, but the last token is always computed: 1 block
    assert oracle.lookup_and_insert(list(range(1, 9))) == 4
    assert oracle.lookup_and_insert(one_to_ten, cache_salt="tenant") == 0  # salted: other hash
    assert oracle.lookup_and_insert([1, 2, 3, 4, 9, 9, 9, 9, 9]) == 4  # second block differs
    assert oracle.lookup_and_insert([2, 1, 3, 4, 5, 6, 7, 8, 9]) == 0  # first block differs
    assert OracleCache(block_size=4, hash_seed="other").lookup_and_insert(one_to_ten) == 0


def test_results_round_trip_table_and_compare(tmp_path):
    records = timeline()
    summary = summarize(records, parse_slo("ttft=250"), WORKERS, {"workload": "hand"})
    write_results(tmp_path / "a", summary, records)
    again, again_records = read_results(tmp_path / "a")
    assert again == summary and again_records == records
    text = table(summary)
    assert "4 ok / 5 (1 failed: RESOURCE_EXHAUSTED x1)" in text
    assert "TTFT" in text and "175.0" in text and "oracle 41.7%" in text
    both = compare_table({"a": summary, "bb": again})
    assert both.splitlines()[0].split() == ["a", "bb"]
    assert "goodput req/s" in both


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    from perf.bench.plots import compare_figure, in_flight, run_figures

    assert in_flight([(0.0, 2.0), (1.0, 3.0)]) == ([0.0, 0.0, 1.0, 2.0, 3.0], [0, 1, 2, 1, 0])
    paths = run_figures(timeline(), tmp_path)
    assert [p.name for p in paths] == ["ttft_cdf.png", "itl_over_time.png", "worker_load.png"]
    summary = summarize(timeline())
    fig = compare_figure(
        {"x": (summary, timeline()), "y": (summary, timeline())}, tmp_path / "c.png"
    )
    for p in [*paths, fig]:
        assert p.read_bytes()[:4] == b"\x89PNG"


def test_latencies_by_kind():
    """The long prompt (e) apart from the chats (a, b, c ok; d failed and not counted)."""
    s = summarize(timeline(), workers=WORKERS)
    chat, long = s["by_kind"]["chat"], s["by_kind"]["long"]
    assert (chat["requests"], long["requests"]) == (4, 1)
    # chat TTFT 100, 300, 200 ms; ITL 100, 200, 200 ms
    assert chat["latency_ms"]["ttft"] == pytest.approx(dict(mean=200, median=200, p90=280, p99=298))
    assert chat["latency_ms"]["itl"]["p99"] == pytest.approx(200)
    assert long["latency_ms"]["ttft"]["median"] == pytest.approx(100)
    assert long["latency_ms"]["itl"]["median"] == pytest.approx(400)
    assert "long TTFT (1)" in table(s)
    one_kind = [r for r in timeline() if r.kind == "chat"]
    assert summarize(one_kind)["by_kind"] == {}


def test_chat_itls_beside_a_long_prefill():
    """Only the chat gaps that overlap the long prompt's prefill (sent 1.0, first token 2.0)."""
    r = RequestRecord
    records = [
        r("L", 1.0, 2.5, ((2.0, 1), (2.5, 1)), 4000, kind="long"),
        # gaps 0.4 (before), 0.5 and 0.7 (overlap the window), 0.1 (after)
        r("x", 0.4, 2.2, ((0.5, 1), (0.9, 1), (1.4, 1), (2.1, 1), (2.2, 1)), 16),
        r("y", 1.2, 1.3, ((1.25, 1), (1.3, 1)), 16, status="CANCELLED", error="gone"),
    ]
    chat = summarize(records)["by_kind"]["chat"]
    beside = chat["itl_beside_long_prefill_ms"]
    assert beside == pytest.approx(dict(mean=600, median=600, p90=680, p99=698, count=2))
    assert "itl_beside_long_prefill_ms" not in summarize(records)["by_kind"]["long"]
    assert "chat ITL by long prefill (2)" in table(summarize(records))


def test_the_oracle_caches_an_answers_computed_blocks():
    oracle = OracleCache(block_size=4, hash_seed="baton")
    prompt, answer = list(range(1, 7)), [40, 41, 42, 43, 44]  # 11 tokens, 10 computed
    assert oracle.lookup_and_insert(prompt) == 0
    oracle.insert_answer(prompt, answer)
    # turn 2 = prompt + answer + more: blocks 0, 1 hit (tokens 0-7); block 2 (8-11) holds the
    # last answer token, whose KV was never computed
    assert oracle.lookup_and_insert(prompt + answer + [60, 61, 62]) == 8
