"""Whether the cluster can serve (router/readiness.py): the decision for every shape, the
router's answer through a shape change (scale prefill to 0 and back), and what HTTP /health
and grpc.health.v1 answer from it over real servers."""

from __future__ import annotations

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.openai_http import create_app
from router.readiness import PoolHealth, readiness
from router.router import Router
from router.server import SERVICE, start_server
from tests.router.serving import BackgroundLoop, http_serving

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.mark.parametrize(
    ("aggregated", "prefill", "decode", "serving", "reason"),
    [
        # aggregated: a healthy decode worker is enough; the prefill pool does not count
        (True, (0, 0), (1, 1), True, "ok"),
        (True, (0, 2), (1, 3), True, "ok"),
        (True, (1, 1), (1, 1), True, "ok"),  # prefill workers still draining
        (True, (1, 1), (0, 1), False, "no healthy decode worker"),
        (True, (0, 0), (0, 0), False, "no healthy decode worker"),
        # disaggregated: both pools need a healthy worker
        (False, (1, 1), (1, 1), True, "ok"),
        (False, (1, 3), (2, 2), True, "ok"),
        (False, (0, 0), (1, 1), False, "no healthy prefill worker"),  # pool being replaced
        (False, (0, 2), (1, 1), False, "no healthy prefill worker"),
        (False, (1, 1), (0, 1), False, "no healthy decode worker"),
        (False, (0, 0), (0, 0), False, "no healthy prefill or decode worker"),
    ],
)
def test_the_decision_for_every_shape(aggregated, prefill, decode, serving, reason):
    ready = readiness(aggregated, PoolHealth(*prefill), PoolHealth(*decode))
    assert (ready.serving, ready.reason) == (serving, reason)
    assert ready.mode == ("aggregated" if aggregated else "disaggregated")


def test_the_body_names_the_healthy_pools():
    assert readiness(True, PoolHealth(0, 1), PoolHealth(2, 3)).body() == {
        "status": "ok",
        "serving": True,
        "mode": "aggregated",
        "pools": {"prefill": {"healthy": 0, "workers": 1}, "decode": {"healthy": 2, "workers": 3}},
    }


class Worker:
    """A pool member: readiness never calls a worker, it counts what the router knows."""


def answer(router: Router) -> tuple[bool, str, str, int, int]:
    ready = router.readiness()
    return ready.serving, ready.reason, ready.mode, ready.prefill.healthy, ready.decode.healthy


def test_serving_through_scale_prefill_to_zero_and_back():
    p0, p1, d0 = Worker(), Worker(), Worker()
    router = Router({"p0": p0}, {"d0": d0}, block_size=4, hash_seed="t")
    assert answer(router) == (True, "ok", "disaggregated", 1, 1)
    router.update_membership({"healthy": {"p0": False, "d0": True}})
    assert answer(router) == (False, "no healthy prefill worker", "disaggregated", 0, 1)
    # `baton deploy scale prefill=0`: the apply turns aggregated on, then retires p0
    router.configure("cache_aware", 0, 0.0, aggregated=True)
    assert answer(router) == (True, "ok", "aggregated", 0, 1)
    router.set_workers({}, {"d0": d0})
    assert answer(router) == (True, "ok", "aggregated", 0, 1)
    # `baton deploy scale prefill=1`: aggregated stays in effect until p1 is published
    router.configure("cache_aware", 0, 0.0, aggregated=False)
    assert answer(router) == (True, "ok", "aggregated", 0, 1)
    router.set_workers({"p1": p1}, {"d0": d0})
    assert answer(router) == (True, "ok", "disaggregated", 1, 1)
    router.update_membership({"healthy": {"p1": True, "d0": False}})
    assert answer(router) == (False, "no healthy decode worker", "disaggregated", 1, 0)
    router.update_membership({"healthy": {"p1": True, "d0": True}})
    assert answer(router) == (True, "ok", "disaggregated", 1, 1)


def test_http_health_is_200_while_the_shape_can_serve():
    d0 = Worker()
    router = Router({}, {"d0": d0}, block_size=4, hash_seed="t", aggregated=True)
    with http_serving(create_app(router, ["tiny"])) as (url, _):
        reply = httpx.get(url + "/health")
        assert (reply.status_code, reply.json()["mode"], reply.json()["pools"]["decode"]) == (
            200,
            "aggregated",
            {"healthy": 1, "workers": 1},
        )
        router.update_membership({"healthy": {"d0": False}})
        reply = httpx.get(url + "/health")
        assert (reply.status_code, reply.json()["status"]) == (503, "no healthy decode worker")
        router.update_membership({"healthy": {"d0": True}})
        router.configure("cache_aware", 0, 0.0, aggregated=False)
        assert httpx.get(url + "/health").status_code == 200  # aggregated until p0 comes
        router.set_workers({"p0": Worker()}, {"d0": d0})
        reply = httpx.get(url + "/health")
        assert (reply.status_code, reply.json()["mode"]) == (200, "disaggregated")


def test_grpc_health_check_and_watch_follow_the_router():
    d0 = Worker()
    router = Router({}, {"d0": d0}, block_size=4, hash_seed="t", aggregated=True)
    loop = BackgroundLoop()
    server, port = loop.run(start_server(router, "127.0.0.1", 0))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            def check(service: str) -> int:
                return stub.Check(health_pb2.HealthCheckRequest(service=service)).status

            assert (check(""), check(SERVICE)) == (SERVING, SERVING)
            watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=30)
            assert next(watch).status == SERVING
            router.update_membership({"healthy": {"d0": False}})
            assert next(watch).status == NOT_SERVING  # within a poll of the router
            assert (check(""), check(SERVICE)) == (NOT_SERVING, NOT_SERVING)
            router.update_membership({"healthy": {"d0": True}})
            assert next(watch).status == SERVING
            watch.cancel()
            router.configure("cache_aware", 0, 0.0, aggregated=False)
            assert check(SERVICE) == SERVING  # aggregated until prefill workers come
            router.set_workers({"p0": Worker()}, {"d0": d0})
            assert check(SERVICE) == SERVING
            router.update_membership({"healthy": {"p0": False, "d0": True}})
            assert check(SERVICE) == NOT_SERVING  # disaggregated: no healthy prefill worker
    finally:
        loop.run(server.stop(1))
        loop.close()
