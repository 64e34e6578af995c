"""cluster.status without Ray: the status document from the workers' and the router's
answers (wanted vs running per pool, degraded, the cluster's mode)."""

from __future__ import annotations

from cluster.state import RouterRecord
from cluster.status import cluster_mode, router_view, status_view, worker_row
from deploy.manifest import parse_manifest
from tests.cluster.manifests import tiny_manifest
from tests.cluster.workers import worker


def manifest(prefill: int, decode: int) -> dict:
    return parse_manifest(tiny_manifest("tiny", prefill, decode, name="c1")).model_dump(mode="json")


def test_worker_row_carries_the_stats_and_the_checked_health():
    stats = {"num_requests": 2, "free_blocks": 10}
    restarted = worker("decode-0", healthy=False, node_id="n1")  # answers, not re-paired yet
    assert worker_row(restarted, stats) == {
        "num_requests": 2,
        "free_blocks": 10,
        "worker_id": "decode-0",
        "role": "decode",
        "healthy": False,
        "state": "active",
        "node_id": "n1",
    }
    leaving = worker("prefill-1", draining=True)
    assert worker_row(leaving, TimeoutError("no answer")) == {
        "error": "no answer",
        "worker_id": "prefill-1",
        "role": "prefill",
        "healthy": False,
        "state": "draining",
        "node_id": "",
    }


def test_router_view_adds_the_addresses():
    router = RouterRecord("h", (), "127.0.0.1:5000", "http://127.0.0.1:8000", {})
    assert router_view(router, {"requests": 4}) == {
        "requests": 4,
        "address": "127.0.0.1:5000",
        "http_address": "http://127.0.0.1:8000",
    }
    assert router_view(router, RuntimeError("gone")) == {
        "error": "gone",
        "address": "127.0.0.1:5000",
        "http_address": "http://127.0.0.1:8000",
    }


def test_a_pool_with_fewer_answering_workers_than_wanted_is_degraded():
    rows = [
        worker_row(worker("prefill-0"), {}),
        worker_row(worker("decode-0"), {}),
        worker_row(worker("decode-1"), RuntimeError("lost")),
        worker_row(worker("decode-2", draining=True), {}),  # leaving: not counted
    ]
    view = status_view(manifest(1, 2), 4, None, rows, [{"node_id": "n1"}], ["line"])
    assert view == {
        "name": "c1",
        "generation": 4,
        "replicas": {"prefill": 1, "decode": 2},
        "wanted": {"prefill": 1, "decode": 2},
        "running": {"prefill": 1, "decode": 1},
        "degraded": True,
        "mode": "disaggregated",
        "router": None,
        "workers": rows,
        "nodes": [{"node_id": "n1"}],
        "events": ["line"],
        "manifest": manifest(1, 2),
    }
    healthy = [row for row in rows if row["worker_id"] != "decode-1"]
    assert status_view(manifest(1, 1), 4, None, healthy, [], [])["degraded"] is False


def test_no_manifest_wants_nothing():
    view = status_view(None, 0, None, [], [], [])
    assert (view["name"], view["wanted"], view["degraded"], view["mode"]) == (
        None,
        {"prefill": 0, "decode": 0},
        False,
        None,
    )


def test_cluster_mode():
    assert cluster_mode(None) is None
    assert cluster_mode(manifest(0, 1)) == "aggregated"
    assert cluster_mode(manifest(2, 1)) == "disaggregated"
