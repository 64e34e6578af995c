"""`baton deploy` against a running local Ray cluster, each command a separate process (as a
user runs it): apply 1+1, apply again (no change), scale to 2+2 and back to 1+1 while a stream
of requests runs, a changed engine option replaces the workers, `down` leaves no Baton actor;
an aggregated cluster (0 prefill workers) scaled to 1 prefill worker and back stays healthy
(/health, gRPC health and `baton deploy status` agree) while requests run. Every request
completes with the offline engine's tokens; none fails."""

from __future__ import annotations

import json
import re
import threading
import time

import grpc
import httpx
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.controller import NAMESPACE
from cluster.local_ray import start_local_ray
from deploy.client import baton_actors
from engine import LLM, SamplingParams
from router.proto import inference_pb2 as pb
from router.server import SERVICE
from tests.cluster.manifests import tiny_manifest
from tests.deploy.streams import MAX_TOKENS, RequestStream, stream_prompt
from tests.helpers import baton_deploy as baton
from tests.helpers import random_prompts

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")
LONG_TOKENS = 1500  # long enough to be running when the scale-down starts draining


@pytest.fixture(scope="module")
def ray_address():
    start_local_ray(num_cpus=8, namespace=NAMESPACE)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(autouse=True)
def down_after(ray_address):
    """A test that fails half way must not leave its cluster to the next test."""
    yield
    if baton_actors(NAMESPACE):
        baton(ray_address, "down")


def status(address: str) -> dict:
    out = baton(address, "status", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def pools(st: dict) -> dict[str, list[str]]:
    """Active worker ids by role; also checks every worker is healthy."""
    assert all(w["healthy"] for w in st["workers"]), st["workers"]
    return {
        role: sorted(
            w["worker_id"] for w in st["workers"] if w["role"] == role and w["state"] == "active"
        )
        for role in ("prefill", "decode")
    }


def start_long_requests(stub, count: int) -> list[tuple[list[int], dict]]:
    """Stream `count` long greedy requests with fresh prompts, one after another once the
    previous one streams its tokens. The decode pool picks the worker running the fewest
    requests, so they spread over the decode workers. Each `out` gets "tokens" and "usage"
    (prefill worker, decode worker) when its request finished."""
    greedy = dict(temperature=0.0, ignore_eos=True)
    started = []
    for prompt in random_prompts([30] * count, seed=902):
        out: dict = {"streaming": threading.Event()}

        def run(prompt=prompt, out=out) -> None:
            replies = []
            for reply in stub.Generate(
                pb.GenerateRequest(
                    prompt_token_ids=pb.TokenIds(ids=prompt),
                    sampling=pb.SamplingParams(max_tokens=LONG_TOKENS, **greedy),
                ),
                timeout=300,
            ):
                replies.append(reply)
                out["streaming"].set()
            out["tokens"] = [t for r in replies for t in r.token_ids]
            out["usage"] = (replies[-1].usage.prefill_worker, replies[-1].usage.decode_worker)

        out["thread"] = threading.Thread(target=run)
        out["thread"].start()
        assert out["streaming"].wait(60), "a long request never started streaming"
        started.append((prompt, out))
    return started


def test_apply_scale_under_load_change_options_and_down(ray_address, tiny_llama, tmp_path):
    manifest = tiny_manifest(tiny_llama, name="deploy-test", num_kv_blocks=2048)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(manifest))

    first = baton(ray_address, "apply", "-f", str(path))
    assert first.returncode == 0, first.stderr
    assert (
        "generation 1: add 1 prefill worker(s); add 1 decode worker(s); start router"
        in first.stdout
    )
    assert "prefill-0 is up" in first.stdout  # progress lines
    st = status(ray_address)
    assert (st["name"], st["generation"], pools(st)) == (
        "deploy-test",
        1,
        {"prefill": ["prefill-0"], "decode": ["decode-0"]},
    )

    again = baton(ray_address, "apply", "-f", str(path))
    assert again.returncode == 0, again.stderr
    assert "generation 1: no change" in again.stdout
    assert pools(status(ray_address)) == {"prefill": ["prefill-0"], "decode": ["decode-0"]}

    with RequestStream(st["router"]["address"]) as stream:
        stream.wait_for(3)
        up = baton(ray_address, "scale", "prefill=2", "decode=2")
        assert up.returncode == 0, up.stderr
        assert "generation 2: add 1 prefill worker(s); add 1 decode worker(s)" in up.stdout
        st = status(ray_address)
        assert (st["generation"], st["replicas"], pools(st)) == (
            2,
            {"prefill": 2, "decode": 2},
            {"prefill": ["prefill-0", "prefill-1"], "decode": ["decode-0", "decode-1"]},
        )
        served = len(stream.results)
        stream.wait_for(served + 12)
        # Long requests, some on decode-1, which will leave: the drain must wait for them.
        long_requests = start_long_requests(stream.stub, 4)
        down = baton(ray_address, "scale", "prefill=1", "decode=1")
        assert down.returncode == 0, down.stderr
        assert "draining prefill-1, decode-1" in down.stdout and "drained" in down.stdout
        assert re.search(r"waiting for .*decode-1: [1-9]\d* request", down.stdout), down.stdout
        for _, out in long_requests:
            out["thread"].join(120)
        assert "decode-1" in {out["usage"][1] for _, out in long_requests}
        offline = LLM(
            tiny_llama, block_size=4, chunk_size=16, num_kv_blocks=2048, skip_tokenizer_init=True
        )
        expected = offline.generate(
            [prompt for prompt, _ in long_requests],
            SamplingParams(max_tokens=LONG_TOKENS, temperature=0.0, ignore_eos=True),
        )
        assert [out["tokens"] for _, out in long_requests] == [e.token_ids for e in expected]
        st = status(ray_address)
        assert (st["generation"], pools(st)) == (
            3,
            {"prefill": ["prefill-0"], "decode": ["decode-0"]},
        )
        stream.wait_for(len(stream.results) + 3)

        changed = tiny_manifest(tiny_llama, name="deploy-test", num_kv_blocks=2048, max_num_seqs=64)
        path.write_text(yaml.safe_dump(changed))
        replaced = baton(ray_address, "apply", "-f", str(path))
        assert replaced.returncode == 0, replaced.stderr
        assert (
            "generation 4: replace 1 prefill worker(s) (options changed); replace 1 "
            "decode worker(s) (options changed)"
        ) in replaced.stdout
        assert pools(status(ray_address)) == {"prefill": ["prefill-2"], "decode": ["decode-2"]}
        stream.wait_for(len(stream.results) + 3)

    assert stream.errors == []
    ks = [k for k, *_ in stream.results]
    expected = offline.generate(
        [stream_prompt(k) for k in ks],
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
    )
    for (k, tokens, finish, _, _), exp in zip(stream.results, expected, strict=True):
        assert (tokens, finish) == (exp.token_ids, "length"), k
    used = {(p, d) for _, _, _, p, d in stream.results}
    for worker in ("prefill-1", "decode-1", "prefill-2", "decode-2"):
        assert any(worker in pair for pair in used), (worker, used)

    removed = baton(ray_address, "down")
    assert removed.returncode == 0, removed.stderr
    assert baton_actors(NAMESPACE) == []
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU") != 8 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray.available_resources().get("CPU") == 8  # every bundle was freed
    nothing = baton(ray_address, "status")
    assert nothing.returncode == 1 and "no Baton cluster runs here" in nothing.stderr


def test_apply_refuses_bad_manifests_before_touching_the_cluster(ray_address, tiny_llama, tmp_path):
    before = baton_actors(NAMESPACE)
    impossible = tiny_manifest(tiny_llama)
    impossible["spec"]["decode"]["resources"] = {"GPU": 1}
    path = tmp_path / "gpu.yaml"
    path.write_text(yaml.safe_dump(impossible))
    out = baton(ray_address, "apply", "-f", str(path))
    assert out.returncode == 2
    assert "spec.decode.resources.GPU: 1 per worker, but the Ray cluster has 0" in out.stderr
    assert "Traceback" not in out.stderr
    scale = baton(ray_address, "scale", "decode=0")
    assert scale.returncode == 2 and "'decode=0': N must be an integer >= 1" in scale.stderr
    too_big = tiny_manifest(tiny_llama)
    too_big["spec"]["prefill"]["resources"] = {"CPU": 9}  # this one-node cluster has 8
    path.write_text(yaml.safe_dump(too_big))
    out = baton(ray_address, "apply", "-f", str(path))
    assert (
        out.returncode == 2
        and "spec.prefill.resources.CPU: 9 per worker, but the Ray cluster has 8 in total"
        in out.stderr
    )
    bad_address = baton("not-an-address", "status")
    assert (
        bad_address.returncode == 1
        and "cannot connect to a Ray cluster at 'not-an-address'" in bad_address.stderr
        and "Traceback" not in bad_address.stderr
    )
    assert baton_actors(NAMESPACE) == before


def test_failed_apply_leaves_nothing_behind_and_can_be_retried(ray_address, tiny_llama, tmp_path):
    broken = tiny_manifest(str(tmp_path / "no-such-model"), name="retry-test")
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(broken))
    out = baton(ray_address, "apply", "-f", str(path))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "starting prefill worker(s) failed" in out.stderr and "Traceback" not in out.stderr
    assert baton_actors(NAMESPACE) == ["baton-controller"]  # no worker, no router was kept
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU") != 8 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray.available_resources().get("CPU") == 8  # the worker's bundle was removed
    path.write_text(yaml.safe_dump(tiny_manifest(tiny_llama, name="retry-test")))
    fixed = baton(ray_address, "apply", "-f", str(path))
    assert fixed.returncode == 0, fixed.stderr
    assert (
        "generation 1: add 1 prefill worker(s); add 1 decode worker(s); start router"
        in fixed.stdout
    )  # the failed apply recorded nothing
    assert pools(status(ray_address)) == {"prefill": ["prefill-1"], "decode": ["decode-0"]}
    assert baton(ray_address, "down").returncode == 0
    assert baton_actors(NAMESPACE) == []


def health(http_address: str) -> tuple[int, dict]:
    reply = httpx.get(http_address + "/health", timeout=10)
    return reply.status_code, reply.json()


def grpc_health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        request = health_pb2.HealthCheckRequest(service=SERVICE)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=10).status


def ready(mode: str, prefill: int, decode: int = 1) -> dict:
    """The /health body of a serving cluster whose pools' workers are all healthy."""
    pools = {"prefill": {"healthy": prefill, "workers": prefill}}
    pools["decode"] = {"healthy": decode, "workers": decode}
    return {"status": "ok", "serving": True, "mode": mode, "pools": pools}


def test_health_follows_the_shape_through_scale_prefill_0_and_back(
    ray_address, tiny_llama, tmp_path
):
    manifest = tiny_manifest(tiny_llama, prefill=0, name="shape-test", num_kv_blocks=2048)
    path = tmp_path / "aggregated.yaml"
    path.write_text(yaml.safe_dump(manifest))
    applied = baton(ray_address, "apply", "-f", str(path))
    assert applied.returncode == 0, applied.stderr
    st = status(ray_address)
    http, address = st["router"]["http_address"], st["router"]["address"]
    assert health(http) == (200, ready("aggregated", 0))
    assert st["router"]["readiness"] == ready("aggregated", 0)  # deploy status agrees
    shown = baton(ray_address, "status").stdout
    assert "serving yes  mode aggregated  healthy prefill 0/0  decode 1/1" in shown, shown
    assert grpc_health(address) == health_pb2.HealthCheckResponse.SERVING

    seen: list[int] = []  # every /health status while the shape changes
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            seen.append(health(http)[0])
            time.sleep(0.2)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        with RequestStream(address) as stream:
            stream.wait_for(3)
            up = baton(ray_address, "scale", "prefill=1")
            assert up.returncode == 0, up.stderr
            assert health(http) == (200, ready("disaggregated", 1))
            assert status(ray_address)["router"]["readiness"] == ready("disaggregated", 1)
            stream.wait_for(len(stream.results) + 3)
            down = baton(ray_address, "scale", "prefill=0")
            assert down.returncode == 0, down.stderr
            assert health(http) == (200, ready("aggregated", 0))
            assert status(ray_address)["router"]["readiness"] == ready("aggregated", 0)
            stream.wait_for(len(stream.results) + 3)
    finally:
        stop.set()
        poller.join(30)
    assert len(seen) > 10 and set(seen) == {200}, seen
    assert grpc_health(address) == health_pb2.HealthCheckResponse.SERVING
    assert stream.errors == []
    prefilled_on = {p for _, _, _, p, _ in stream.results}
    decoded_on = {d for _, _, _, _, d in stream.results}
    assert any(p.startswith("prefill-") for p in prefilled_on)  # disaggregated
    assert prefilled_on & decoded_on  # aggregated: prefilled on the decode worker
    offline = LLM(
        tiny_llama, block_size=4, chunk_size=16, num_kv_blocks=2048, skip_tokenizer_init=True
    )
    expected = offline.generate(
        [stream_prompt(k) for k, *_ in stream.results],
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
    )
    for (k, tokens, finish, _, _), exp in zip(stream.results, expected, strict=True):
        assert (tokens, finish) == (exp.token_ids, "length"), k
    assert baton(ray_address, "down").returncode == 0
