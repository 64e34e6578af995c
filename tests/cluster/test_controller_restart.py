"""A controller whose process dies (SIGKILL) is restarted by Ray and re-adopts the running
cluster: the router keeps serving meanwhile (no request of a running stream fails), the
workers keep their incarnations (none was restarted), `baton deploy status` answers again
within seconds with the events of the restart, and a following `scale` and `down` work. A
worker that dies while no controller runs is re-paired by the restarted controller."""

from __future__ import annotations

import json
import os
import signal
import time

import grpc
import pytest

from cluster import state_store
from cluster.controller import NAMESPACE, controller_handle
from cluster.local_ray import start_local_ray
from cluster.router_actor import ROUTER_NAME
from deploy.client import baton_actors
from engine import LLM, SamplingParams
from router.proto import inference_pb2 as pb
from router.proto import inference_pb2_grpc as pb_grpc
from tests.cluster.manifests import tiny_manifest
from tests.deploy.streams import MAX_TOKENS, RequestStream, stream_prompt
from tests.helpers import baton_deploy as baton

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")
from ray.util.placement_group import placement_group  # noqa: E402

BACK_WITHIN_S = 30.0  # Ray starts a new controller process, which loads the saved state


@pytest.fixture(scope="module")
def ray_address():
    start_local_ray(num_cpus=8, namespace=NAMESPACE)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@ray.remote(num_cpus=0)
class Orphan:
    """Stands for a worker nobody recorded."""


def generate(address: str, ids: list[int]) -> list[int]:
    """One greedy request on a new channel (a fresh connection, no reconnect backoff)."""
    with grpc.insecure_channel(address) as channel:
        replies = pb_grpc.InferenceStub(channel).Generate(
            pb.GenerateRequest(
                prompt_token_ids=pb.TokenIds(ids=ids),
                sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
            ),
            timeout=60,
        )
        return [t for r in replies for t in r.token_ids]


def incarnations() -> dict[str, str]:
    """Each running worker's incarnation, asked of the worker itself (not the controller)."""
    names = [n for n in baton_actors(NAMESPACE) if n.startswith(("prefill-", "decode-"))]
    handles = [ray.get_actor(n, namespace=NAMESPACE) for n in names]
    return dict(zip(names, ray.get([h.ping.remote() for h in handles], timeout=30), strict=True))


def kill_controller() -> int:
    """SIGKILL the controller's process (Ray restarts it); returns the killed pid."""
    pid = ray.get(controller_handle().pid.remote(), timeout=30)
    os.kill(pid, signal.SIGKILL)
    return pid


def status_after_restart(address: str, old_pid: int) -> dict:
    """`baton deploy status --json` once the new controller answers; fails after BACK_WITHIN_S."""
    deadline = time.monotonic() + BACK_WITHIN_S
    while True:
        out = baton(address, "status", "--json")
        if out.returncode == 0:
            new_pid = ray.get(controller_handle().pid.remote(), timeout=30)
            if new_pid != old_pid:
                return json.loads(out.stdout)
        assert time.monotonic() < deadline, f"status not back within {BACK_WITHIN_S} s: {out}"
        time.sleep(0.5)


def test_killed_controller_readopts_the_running_cluster(ray_address, tiny_llama, tmp_path):
    manifest = tiny_manifest(tiny_llama, name="restart-test")
    controller = controller_handle(create=True)
    ray.get(controller.apply.remote(manifest), timeout=600)
    address = ray.get(controller.status.remote(), timeout=60)["router"]["address"]
    before = incarnations()
    assert sorted(before) == ["decode-0", "prefill-0"]

    # An orphan: a worker and its bundle that a controller started but died before recording.
    orphan_pg = placement_group([{"CPU": 1}], name="baton-decode-99", lifetime="detached")
    ray.get(orphan_pg.ready(), timeout=60)
    Orphan.options(name="decode-99", namespace=NAMESPACE, lifetime="detached").remote()

    with RequestStream(address) as stream:
        stream.wait_for(3)
        killed = kill_controller()
        t0 = time.monotonic()
        served_at_kill = len(stream.results)
        st = status_after_restart(ray_address, killed)
        print(f"\nstatus answered {time.monotonic() - t0:.1f} s after the controller was killed")
        assert incarnations() == before  # re-adopted, not restarted
        assert (st["name"], st["generation"], st["replicas"], st["degraded"]) == (
            "restart-test",
            1,
            {"prefill": 1, "decode": 1},
            False,
        )
        assert st["router"]["address"] == address and "error" not in st["router"]
        assert all(w["healthy"] for w in st["workers"])
        events = ray.get(controller.events.remote(), timeout=30)
        assert any(
            "controller restarted: re-adopted workers prefill-0, decode-0 and the router on "
            f"{address}" in e
            for e in events
        ), events
        assert any(e.startswith("generation 1:") for e in events)  # the saved lines came back
        stream.wait_for(served_at_kill + 6)  # served by the same router and workers
        deadline = time.monotonic() + BACK_WITHIN_S
        while "decode-99" in baton_actors(NAMESPACE):  # the re-adopting controller removes orphans
            assert time.monotonic() < deadline, baton_actors(NAMESPACE)
            time.sleep(0.5)
        events = ray.get(controller.events.remote(), timeout=30)
        assert any(
            e.startswith("removed decode-99: started by the dead controller") for e in events
        )

        # The restarted controller reconciles as before: a second decode worker.
        scaled = baton(ray_address, "scale", "decode=2")
        assert scaled.returncode == 0, scaled.stderr
        assert "generation 2: add 1 decode worker(s)" in scaled.stdout
        assert incarnations().keys() == {"prefill-0", "decode-0", "decode-1"}
        stream.wait_for(len(stream.results) + 9)

        # A worker that dies while no controller runs: the new controller re-pairs it.
        killed = kill_controller()
        ray.kill(ray.get_actor("decode-1", namespace=NAMESPACE), no_restart=False)
        status_after_restart(ray_address, killed)
        deadline = time.monotonic() + BACK_WITHIN_S
        while True:
            health = ray.get(controller.check_health.remote(timeout=5.0), timeout=60)
            if all(health["healthy"].values()) and health["restarts"] == 1:
                break
            assert time.monotonic() < deadline, health
            time.sleep(0.5)
        assert incarnations()["decode-0"] == before["decode-0"]
        events = ray.get(controller.events.remote(), timeout=30)
        assert any("decode-1 was restarted by Ray" in e and "paired again" in e for e in events)
        served = len(stream.results)
        deadline = time.monotonic() + BACK_WITHIN_S
        while "decode-1" not in {d for *_, d in stream.results[served:]}:  # re-paired, serving
            router = ray.get(controller.status.remote(), timeout=60)["router"]
            assert time.monotonic() < deadline, (router, stream.results[served:])
            time.sleep(0.5)

    assert stream.errors == []
    # Router and controller die together: the router binds its old port again (read from the
    # saved state while no controller answers) and the new controller publishes the workers.
    killed = kill_controller()
    ray.kill(ray.get_actor(ROUTER_NAME, namespace=NAMESPACE), no_restart=False)
    prompt = stream_prompt(10_001)
    deadline = time.monotonic() + BACK_WITHIN_S
    while True:
        try:
            after_both = generate(address, prompt)
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            assert time.monotonic() < deadline, "router not back on its address"
            time.sleep(0.5)
    assert ray.get(controller_handle().pid.remote(), timeout=30) != killed
    assert incarnations()["decode-0"] == before["decode-0"]
    events = ray.get(controller.events.remote(), timeout=30)
    assert any("the router was restarted" in e for e in events[-10:]), events[-10:]

    offline = LLM(
        tiny_llama, block_size=4, chunk_size=16, num_kv_blocks=256, skip_tokenizer_init=True
    )
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    expected = offline.generate([stream_prompt(k) for k, *_ in stream.results], greedy)
    for (k, tokens, finish, _, _), exp in zip(stream.results, expected, strict=True):
        assert (tokens, finish) == (exp.token_ids, "length"), k
    assert after_both == offline.generate([prompt], greedy)[0].token_ids

    removed = baton(ray_address, "down")
    assert removed.returncode == 0, removed.stderr
    assert baton_actors(NAMESPACE) == []
    assert state_store.load(NAMESPACE) is None  # the next controller starts empty
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU") != 8 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray.available_resources().get("CPU") == 8  # every detached bundle was removed
