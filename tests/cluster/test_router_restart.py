"""A killed router actor comes back by itself (Ray restarts it; it binds the ports its first
incarnation bound and the controller publishes the workers again): requests on the same gRPC
and HTTP addresses succeed again within seconds with the same greedy output, and a request in
the gap fails fast with UNAVAILABLE (or succeeds), never hangs."""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest

from cluster.controller import NAMESPACE, controller_handle
from cluster.local_ray import start_local_ray
from cluster.router_actor import ROUTER_NAME
from router.proto import inference_pb2 as pb
from router.proto import inference_pb2_grpc as pb_grpc
from tests.cluster.manifests import tiny_manifest
from tests.helpers import random_prompts

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")
BACK_WITHIN_S = 45.0  # the restart: a new process, imports, bind, publish


@pytest.fixture(scope="module")
def cluster(tiny_llama):
    start_local_ray(num_cpus=8, namespace=NAMESPACE)
    controller = controller_handle(create=True)
    ray.get(controller.apply.remote(tiny_manifest(tiny_llama)), timeout=600)
    yield controller
    ray.get(controller.shutdown.remote(), timeout=60)
    ray.kill(controller)
    ray.shutdown()


def generate(address: str, ids: list[int], timeout: float) -> list[int]:
    """One request on a new channel (a fresh connection, no reconnect backoff)."""
    with grpc.insecure_channel(address) as channel:
        replies = pb_grpc.InferenceStub(channel).Generate(
            pb.GenerateRequest(
                prompt_token_ids=pb.TokenIds(ids=ids),
                sampling=pb.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
            ),
            timeout=timeout,
        )
        return [t for r in replies for t in r.token_ids]


def test_killed_router_serves_again_on_the_same_addresses(cluster):
    controller = cluster
    before = ray.get(controller.status.remote(), timeout=30)["router"]
    address, http_address = before["address"], before["http_address"]
    prompt = random_prompts([11], seed=1201)[0]
    expected = generate(address, prompt, timeout=60)
    assert len(expected) == 5

    ray.kill(ray.get_actor(ROUTER_NAME, namespace=NAMESPACE), no_restart=False)

    # The gap: a call fails fast with UNAVAILABLE (connection refused) or is already served.
    start = time.monotonic()
    try:
        assert generate(address, prompt, timeout=10) == expected
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
    assert time.monotonic() - start < 11

    deadline = time.monotonic() + BACK_WITHIN_S
    while True:
        try:
            got = generate(address, prompt, timeout=10)
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            assert time.monotonic() < deadline, f"router not back within {BACK_WITHIN_S} s"
            time.sleep(0.5)
    assert got == expected
    with urllib.request.urlopen(f"{http_address}/v1/models", timeout=10) as response:
        assert response.status == 200

    after = ray.get(controller.status.remote(), timeout=30)["router"]
    assert (after["address"], after["http_address"]) == (address, http_address)
    events = ray.get(controller.events.remote(), timeout=30)
    assert any("the router was restarted" in e for e in events)
