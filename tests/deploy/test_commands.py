"""`baton deploy` argument parsing and the status table (no Ray)."""

from __future__ import annotations

import pytest

from deploy.commands import format_status, parse_pools, serving_line


def test_parse_pools():
    assert parse_pools(["prefill=2", "decode=3"]) == {"prefill": 2, "decode": 3}
    assert parse_pools(["decode=1"]) == {"decode": 1}
    assert parse_pools(["prefill=0"]) == {"prefill": 0}  # aggregated
    for bad, message in (
        ("prefill", "expected prefill=N or decode=N"),
        ("router=2", "expected prefill=N or decode=N"),
        ("decode=0", "N must be an integer >= 1"),
        ("decode=-1", "N must be an integer >= 1"),
        ("decode=two", "N must be an integer >= 1"),
        ("prefill=-1", "N must be an integer >= 0"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_pools([bad])


def test_status_table_lists_every_worker_with_role_state_health_load_kv_and_hits():
    status = {
        "name": "local",
        "generation": 3,
        "replicas": {"prefill": 1, "decode": 1},
        "mode": "disaggregated",
        "router": {
            "address": "127.0.0.1:50051",
            "policy": "cache_aware",
            "hit_rate": 0.5,
            "readiness": {
                "status": "ok",
                "serving": True,
                "mode": "disaggregated",
                "pools": {
                    "prefill": {"healthy": 1, "workers": 2},
                    "decode": {"healthy": 1, "workers": 1},
                },
            },
        },
        "workers": [
            {
                "worker_id": "decode-0",
                "role": "decode",
                "state": "active",
                "healthy": True,
                "num_requests": 2,
                "kv_usage": 0.125,
                "cache_hit_rate": 0.25,
            },
            {
                "worker_id": "prefill-1",
                "role": "prefill",
                "state": "draining",
                "healthy": False,
                "num_requests": 1,
                "kv_usage": 0.5,
                "cache_hit_rate": 0.75,
            },
        ],
    }
    lines = format_status(status).splitlines()
    assert lines[0] == "cluster local  generation 3  prefill 1  decode 1  disaggregated"
    assert lines[1] == "router grpc 127.0.0.1:50051  http -  policy cache_aware  hit rate 0.50"
    assert lines[2] == "serving yes  mode disaggregated  healthy prefill 1/2  decode 1/1"
    assert lines[4].split() == [
        "WORKER",
        "ROLE",
        "STATE",
        "HEALTHY",
        "REQUESTS",
        "KV",
        "USAGE",
        "HIT",
        "RATE",
    ]
    assert lines[5].split() == ["prefill-1", "prefill", "draining", "NO", "1", "50.0%", "0.75"]
    assert lines[6].split() == ["decode-0", "decode", "active", "yes", "2", "12.5%", "0.25"]


def test_serving_line_says_what_the_routers_health_says():
    from router.readiness import PoolHealth, readiness

    agg = readiness(True, PoolHealth(0, 0), PoolHealth(1, 1)).body()
    assert serving_line({"readiness": agg}) == (
        "serving yes  mode aggregated  healthy prefill 0/0  decode 1/1"
    )
    down = readiness(False, PoolHealth(0, 1), PoolHealth(1, 1)).body()
    assert serving_line({"readiness": down}) == (
        "serving NO: no healthy prefill worker  mode disaggregated  healthy prefill 0/1  decode 1/1"
    )
    assert serving_line({"error": "RayActorError: gone"}) == "serving NO: RayActorError: gone"
    assert serving_line(None) == "serving NO: no router runs"
