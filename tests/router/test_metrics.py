"""RouterMetrics and the cluster exposition: request timing from output dicts, one parseable
exposition with every family once and every sample labelled with worker and role."""

from __future__ import annotations

import threading

import msgpack
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.metrics import EngineMetrics, snapshot
from kvtransfer.metrics import TransferMetrics
from router.metrics import RouterMetrics
from router.metrics_exposition import cluster_metrics_text, gather_worker_snapshots


def outputs(n_token_outputs: int, reason: str = "length"):
    for i in range(n_token_outputs):
        yield {"token_ids": [i], "finished": i == n_token_outputs - 1, "finish_reason": reason}
    return "done"


def test_timer_observes_ttft_itl_e2e_and_passes_outputs_and_return_value():
    m = RouterMetrics()

    def consume():
        timer = m.start()
        got = yield from timer.track(outputs(4))
        assert got == "done"

    assert len(list(consume())) == 4
    list(m.start().track(outputs(1, "stop")))
    g = m.registry.get_sample_value
    assert g("baton:time_to_first_token_seconds_count") == 2
    assert g("baton:inter_token_latency_seconds_count") == 3
    assert g("baton:e2e_request_latency_seconds_count") == 2
    assert g("baton:request_success_total", {"finished_reason": "length"}) == 1
    assert g("baton:request_success_total", {"finished_reason": "stop"}) == 1


def test_closing_the_tracked_stream_closes_the_inner_one():
    closed = threading.Event()

    def inner():
        try:
            yield {"token_ids": [1], "finished": False}
            yield {"token_ids": [2], "finished": True, "finish_reason": "stop"}
        finally:
            closed.set()

    stream = RouterMetrics().start().track(inner())
    next(stream)
    stream.close()
    assert closed.is_set()


def test_decisions_prefix_cache_and_read_counters():
    m = RouterMetrics()
    m.decided("cache_aware", local=False)
    m.decided("cache_aware", local=False)
    m.decided("cache_aware", local=True)
    m.prefix_cache(100, 64)
    failures = [3]
    m.read_counter(
        "auth_failures", "Requests refused for a missing or unknown API key.", lambda: failures[0]
    )
    g = m.registry.get_sample_value
    assert g("baton:router_decisions_total", {"policy": "cache_aware", "prefill": "remote"}) == 2
    assert g("baton:router_decisions_total", {"policy": "cache_aware", "prefill": "local"}) == 1
    assert (g("baton:prefix_cache_queries_total"), g("baton:prefix_cache_hits_total")) == (100, 64)
    failures[0] = 5
    assert g("baton:auth_failures_total") == 5
    m.read_counter("auth_failures", "Auth failures.", lambda: 7)  # a restarted door
    assert g("baton:auth_failures_total") == 7


def worker_snapshot(prompt_tokens: int, sent_bytes: int = 0) -> list[dict]:
    engine, transfer = EngineMetrics(), TransferMetrics()
    engine.prompt_tokens.inc(prompt_tokens)
    engine.prefix_cache(prompt_tokens, 4)
    engine.decode_time.observe(0.7)
    engine.state(running=2, waiting=1, kv_usage=0.25)
    transfer.sent(2, sent_bytes)
    # Over the wire, as a worker's metrics() reply travels.
    return msgpack.unpackb(msgpack.packb(snapshot(engine.registry, transfer.registry)))


def test_cluster_exposition_merges_families_once_with_worker_and_role_labels():
    router = RouterMetrics()
    router.prefix_cache(50, 8)
    list(router.start().track(outputs(3)))
    text = cluster_metrics_text(
        router.registry,
        {
            "p0": ("prefill", worker_snapshot(30, sent_bytes=4096)),
            "d0": ("decode", worker_snapshot(20)),
            "d1": ("decode", None),  # did not answer
        },
        router_id="router-0",
    )
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("baton:prefix_cache_queries", "baton:kv_cache_usage_perc", "baton:ttft"):
        assert text.count(f"# TYPE {name}") <= 1
    assert text.count("# TYPE baton:prefix_cache_queries_total counter") == 1

    def values(family: str, sample: str) -> dict[tuple[str, str], float]:
        return {
            (s.labels["worker"], s.labels["role"]): s.value
            for s in families[family].samples
            if s.name == sample
        }

    queries = values("baton:prefix_cache_queries", "baton:prefix_cache_queries_total")
    assert queries == {("router-0", "router"): 50, ("p0", "prefill"): 30, ("d0", "decode"): 20}
    assert values("baton:kv_transfer_bytes", "baton:kv_transfer_bytes_total") == {
        ("p0", "prefill"): 4096,
        ("d0", "decode"): 0,
    }
    assert values("baton:num_requests_running", "baton:num_requests_running") == {
        ("p0", "prefill"): 2,
        ("d0", "decode"): 2,
    }
    assert values("baton:worker_up", "baton:worker_up") == {
        ("d0", "decode"): 1,
        ("d1", "decode"): 0,
        ("p0", "prefill"): 1,
    }
    ttft = families["baton:time_to_first_token_seconds"]
    assert ttft.type == "histogram"
    count = [s for s in ttft.samples if s.name.endswith("_count")]
    assert [(s.labels, s.value) for s in count] == [({"worker": "router-0", "role": "router"}, 1)]
    decode = [
        s
        for s in families["baton:request_decode_time_seconds"].samples
        if s.name.endswith("_bucket") and s.labels["le"] == "0.8"
    ]
    assert {s.labels["worker"]: s.value for s in decode} == {"p0": 1, "d0": 1}
    assert "_created" not in text


def test_a_family_whose_type_disagrees_is_left_out():
    bad = [{"name": "baton:prefix_cache_hits", "type": "gauge", "help": "x", "samples": [
        ["baton:prefix_cache_hits", {}, 1.0]
    ]}]  # fmt: skip
    router = RouterMetrics()
    text = cluster_metrics_text(router.registry, {"w": ("decode", bad)})
    hits = {f.name: f for f in text_string_to_metric_families(text)}["baton:prefix_cache_hits"]
    assert hits.type == "counter"
    assert [s.labels["worker"] for s in hits.samples] == ["router"]


class _Worker:
    def __init__(self, reply=None, error=None, delay=0.0):
        self.reply, self.error, self.delay = reply, error, delay
        self.release = threading.Event()

    def metrics(self):
        if self.delay:
            self.release.wait(self.delay)
        if self.error:
            raise self.error
        return self.reply


def test_gather_skips_workers_that_fail_or_are_slow():
    slow = _Worker([], delay=30)
    got = gather_worker_snapshots(
        {
            "ok": ("prefill", _Worker([{"name": "x"}])),
            "broken": ("decode", _Worker(error=RuntimeError("gone"))),
            "slow": ("decode", slow),
        },
        timeout=0.5,
    )
    slow.release.set()
    assert got == {
        "ok": ("prefill", [{"name": "x"}]),
        "broken": ("decode", None),
        "slow": ("decode", None),
    }


@pytest.mark.parametrize("workers", [{}])
def test_an_empty_cluster_still_exposes_the_router(workers):
    text = cluster_metrics_text(RouterMetrics().registry, gather_worker_snapshots(workers))
    names = {f.name for f in text_string_to_metric_families(text)}
    assert "baton:router_decisions" in names and "baton:worker_up" in names


def test_the_grafana_dashboard_queries_only_series_the_cluster_exposes():
    import json
    import re
    from pathlib import Path

    router = RouterMetrics()
    router.decided("cache_aware", local=False)
    router.success.labels(finished_reason="stop").inc()
    router.read_counter("auth_failures", "Auth failures.", lambda: 0)
    router.read_counter("request_migrations", "Migrations.", lambda: 0)
    router.request_error("http", 400, "invalid_request")
    text = cluster_metrics_text(router.registry, {"p0": ("prefill", worker_snapshot(1))})
    exposed = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    dashboard = Path(__file__).parents[2] / "deploy" / "grafana" / "baton-dashboard.json"
    panels = json.loads(dashboard.read_text())["panels"]
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    used = {name for e in exprs for name in re.findall(r"baton:[a-z0-9_]+", e)}
    assert len(used) >= 18
    assert used <= exposed, sorted(used - exposed)
