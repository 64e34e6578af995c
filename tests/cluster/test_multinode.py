"""Baton across several Ray nodes on this one machine (ray.cluster_utils.Cluster: a head and
worker nodes, each a raylet with its own CPUs and a custom resource naming it).

The head has no CPU: it runs the controller and the router only. Node A (2 CPUs, the only
`prefill_slot`) gets the prefill worker and one decode worker, node B (1 CPU) the other decode
worker, so a request prefilled on A and decoded on B moves its KV between nodes. Node B is then
removed under load: its requests migrate to the decode worker on A and finish with the offline
engine's tokens, and since no node has room for the lost worker, `baton deploy status` reports
the decode pool degraded (1 of 2 running) with an event naming the worker and its node. A new
node C joins: Ray places the lost worker's bundle there and restarts it, the controller pairs
it again, and it serves."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from cluster.controller import NAMESPACE, controller_handle, short_node
from engine import LLM, SamplingParams
from router.proto import inference_pb2 as pb
from tests.cluster.manifests import tiny_manifest
from tests.deploy.streams import MAX_TOKENS, RequestStream, stream_prompt
from tests.helpers import baton_deploy as baton
from tests.helpers import random_prompts

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")
NODE_MEMORY = 100 * 1024 * 1024  # each raylet's object store (KV never goes through it)
LONG_TOKENS = 500  # long enough to be running on node B when it is removed
DETECT_S = 90.0  # the lost worker reported; later, back on the new node
ENGINE = dict(block_size=4, chunk_size=16, num_kv_blocks=2048, skip_tokenizer_init=True)


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    nodes = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "resources": {"node_head": 1},
            "object_store_memory": NODE_MEMORY,
            "include_dashboard": False,
        },
    )
    workers = {
        "node_a": nodes.add_node(
            num_cpus=2, resources={"node_a": 1, "prefill_slot": 1}, object_store_memory=NODE_MEMORY
        ),
        "node_b": nodes.add_node(
            num_cpus=1, resources={"node_b": 1}, object_store_memory=NODE_MEMORY
        ),
    }
    nodes.wait_for_nodes()
    ray.init(address=nodes.address, namespace=NAMESPACE, log_to_driver=False)
    yield nodes, workers
    try:
        controller = controller_handle()
        ray.get(controller.shutdown.remote(), timeout=120)
        ray.kill(controller, no_restart=True)
    finally:
        ray.shutdown()
        nodes.shutdown()


def node_ids() -> dict[str, str]:
    """{"node_head" | "node_a" | ...: node id} of the live nodes, by their custom resource."""
    out = {}
    for n in ray.nodes():
        if n["Alive"]:
            (name,) = [r for r in n["Resources"] if r.startswith("node_")]
            out[name] = n["NodeID"]
    return out


def wait_for_status(address: str, cond, what: str) -> dict:
    """`baton deploy status --json` until cond(status) holds; fails after DETECT_S."""
    deadline = time.monotonic() + DETECT_S
    while True:
        out = baton(address, "status", "--json")
        assert out.returncode == 0, out.stderr
        st = json.loads(out.stdout)
        if cond(st):
            return st
        assert time.monotonic() < deadline, f"{what} not seen within {DETECT_S} s: {st}"
        time.sleep(1.0)


def long_request(stub, prompt: list[int], out: dict) -> threading.Thread:
    def run() -> None:
        replies = []
        try:
            for reply in stub.Generate(
                pb.GenerateRequest(
                    prompt_token_ids=pb.TokenIds(ids=prompt),
                    sampling=pb.SamplingParams(
                        max_tokens=LONG_TOKENS, temperature=0.0, ignore_eos=True
                    ),
                ),
                timeout=300,
            ):
                replies.append(reply)
                out["streaming"].set()
            out["tokens"] = [t for r in replies for t in r.token_ids]
            out["decode"] = replies[-1].usage.decode_worker
        except Exception as exc:  # noqa: BLE001 - the test asserts there is none
            out["error"] = repr(exc)
            out["streaming"].set()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_serve_across_nodes_then_lose_a_node_under_load(cluster, tiny_llama):
    nodes, workers = cluster
    address = nodes.address
    ids = node_ids()
    manifest = tiny_manifest(tiny_llama, name="multinode", decode=2, num_kv_blocks=2048)
    manifest["spec"]["prefill"]["resources"] = {"CPU": 1, "prefill_slot": 1}
    controller = controller_handle(create=True)
    ray.get(controller.apply.remote(manifest), timeout=600)

    # Placement: the router on the head, the prefill worker on A, a decode worker on each node.
    st = json.loads(baton(address, "status", "--json").stdout)
    router = ray.get_actor("baton-router", namespace=NAMESPACE)
    assert ray.get(router.node_id.remote(), timeout=30) == ids["node_head"]
    where = {w["worker_id"]: w["node_id"] for w in st["workers"]}
    assert where["prefill-0"] == ids["node_a"]
    assert sorted([where["decode-0"], where["decode-1"]]) == sorted([ids["node_a"], ids["node_b"]])
    on_b = next(w for w in ("decode-0", "decode-1") if where[w] == ids["node_b"])
    on_a = next(w for w in ("decode-0", "decode-1") if w != on_b)
    human = baton(address, "status")
    assert f"{on_b:<12}" in human.stdout and short_node(ids["node_b"]) in human.stdout
    assert "3 live node(s)" in human.stdout

    offline = LLM(tiny_llama, **ENGINE)
    long_prompts = random_prompts([30] * 4, seed=1301)
    long_expected = offline.generate(
        long_prompts, SamplingParams(max_tokens=LONG_TOKENS, temperature=0.0, ignore_eos=True)
    )
    b_handle = ray.get_actor(on_b, namespace=NAMESPACE)

    with RequestStream(st["router"]["address"]) as stream:
        # Served across nodes: prefilled on A, decoded on B (the KV crossed between raylets).
        deadline = time.monotonic() + DETECT_S
        while ("prefill-0", on_b) not in {(p, d) for *_, p, d in stream.results}:
            assert time.monotonic() < deadline and not stream.errors, stream.errors
            time.sleep(0.2)

        # Under load: long requests, some running on B's decode worker, then B goes.
        longs = []
        for prompt in long_prompts:
            out = {"streaming": threading.Event()}
            longs.append((out, long_request(stream.stub, prompt, out)))
            assert out["streaming"].wait(60), "a long request never started streaming"
        assert ray.get(b_handle.stats.remote(), timeout=30).num_requests > 0
        nodes.remove_node(workers["node_b"])
        removed_at = time.monotonic()

        for out, thread in longs:
            thread.join(300)
            assert "error" not in out, out["error"]
        # Every long request finished with the offline tokens, the moved ones on A.
        assert [out["tokens"] for out, _ in longs] == [e.token_ids for e in long_expected]
        assert {out["decode"] for out, _ in longs} == {on_a}

        st = wait_for_status(address, lambda s: s["degraded"], "a degraded decode pool")
        print(f"\ndegraded status {time.monotonic() - removed_at:.1f} s after node B went")
        assert (st["wanted"], st["running"]) == (
            {"prefill": 1, "decode": 2},
            {"prefill": 1, "decode": 1},
        )
        lost = [e for e in st["events"] if e.startswith(f"{on_b} lost:")]
        assert lost and f"its node {short_node(ids['node_b'])} is gone" in lost[-1], st["events"]
        human = baton(address, "status")
        assert "DEGRADED: decode 1 of 2 running" in human.stdout, human.stdout
        assert f"{on_b} lost:" in human.stdout
        served = len(stream.results)
        stream.wait_for(served + 6)  # the pool left serves on

        # A new node with room: Ray places the lost bundle there; the controller re-pairs it.
        nodes.add_node(num_cpus=1, resources={"node_c": 1}, object_store_memory=NODE_MEMORY)
        node_c = node_ids()["node_c"]
        added_at = time.monotonic()
        st = wait_for_status(
            address,
            lambda s: (
                not s["degraded"]
                and all(w["healthy"] for w in s["workers"])
                and {w["worker_id"]: w["node_id"] for w in s["workers"]}[on_b] == node_c
            ),
            "the lost worker back",
        )
        print(f"{on_b} re-paired on node C {time.monotonic() - added_at:.1f} s after it joined")
        assert any(
            e.startswith(f"{on_b} was restarted by Ray on node {short_node(node_c)}")
            and "paired again" in e
            for e in st["events"]
        ), st["events"]
        back = len(stream.results)
        deadline = time.monotonic() + DETECT_S
        while on_b not in {d for *_, d in stream.results[back:]}:
            assert time.monotonic() < deadline, "the restarted worker got no request"
            time.sleep(0.5)

    assert stream.errors == []
    expected = offline.generate(
        [stream_prompt(k) for k, *_ in stream.results],
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
    )
    for (k, tokens, finish, _, _), exp in zip(stream.results, expected, strict=True):
        assert (tokens, finish) == (exp.token_ids, "length"), k
