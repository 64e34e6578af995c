"""End to end through gRPC on a local Ray cluster (2 prefill + 1 decode worker actors, the
router actor): prefix routing and cached tokens, 32 concurrent streams, cancel freeing blocks,
error codes with the server still serving, and cache-aware vs round-robin hit rates."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from cluster.controller import NAMESPACE
from cluster.local import LocalCluster, LocalOptions
from engine import LLM, SamplingParams
from perf.bench.client import scrape_counters
from router.proto import inference_pb2 as pb
from router.proto import inference_pb2_grpc as pb_grpc
from tests.helpers import random_prompts

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")
EXTRA = {"skip_tokenizer_init": True, "num_kv_blocks": 512, "max_model_len": 400}


def local(tiny_llama: str, policy: str) -> LocalCluster:
    return LocalCluster(
        LocalOptions(
            model=tiny_llama,
            prefill=2,
            decode=1,
            port=0,
            http_port=0,
            block_size=4,
            chunk_size=32,
            policy=policy,
            engine_extra=EXTRA,
        )
    ).start(log=lambda _m: None)


def generate(stub, ids, timeout=60, **sampling) -> list:
    sampling = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True, **sampling}
    return list(
        stub.Generate(
            pb.GenerateRequest(
                prompt_token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(**sampling)
            ),
            timeout=timeout,
        )
    )


def free_blocks(stub) -> dict[str, int]:
    status = stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=30)
    return {w.worker_id: w.free_blocks for w in status.workers}


@pytest.fixture(scope="module")
def cluster(tiny_llama):
    c = local(tiny_llama, "cache_aware")
    yield c, pb_grpc.InferenceStub(grpc.insecure_channel(c.address))
    c.close()


def test_shared_prefix_lands_on_one_prefill_worker_with_cached_tokens(cluster, tiny_llama):
    _, stub = cluster
    system = random_prompts([80], seed=501)[0]
    prompts = [system + tail for tail in random_prompts([5, 7, 9], seed=502)]
    expected = LLM(tiny_llama, block_size=4, chunk_size=32, **EXTRA).generate(
        prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    )
    served, cached = [], []
    for prompt, exp in zip(prompts, expected, strict=True):
        replies = generate(stub, prompt)
        assert [t for r in replies for t in r.token_ids] == exp.token_ids
        served.append(replies[-1].usage.prefill_worker)
        cached.append(replies[-1].usage.cached_tokens)
    assert len(set(served)) == 1
    assert cached == [0, 80, 80]


def test_32_concurrent_streams_and_cancel_free_blocks(cluster):
    _, stub = cluster
    before = free_blocks(stub)
    prompts = random_prompts([6 + i for i in range(32)], seed=503)
    done = []

    def one(i: int) -> None:
        replies = generate(stub, prompts[i], timeout=120)
        if replies[-1].finish_reason == "length":
            done.append(i)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert sorted(done) == list(range(32))
    call = stub.Generate(
        pb.GenerateRequest(
            prompt_token_ids=pb.TokenIds(ids=[7] * 30),
            sampling=pb.SamplingParams(max_tokens=300, ignore_eos=True),
        ),
        timeout=60,
    )
    next(call)
    call.cancel()
    deadline = time.monotonic() + 20
    while free_blocks(stub) != before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert free_blocks(stub) == before
    for name in ("prefill-0", "prefill-1", "decode-0"):
        ray.get(ray.get_actor(name, namespace=NAMESPACE).check_integrity.remote())


@pytest.mark.parametrize(
    ("ids", "sampling", "code"),
    [
        ([], {}, grpc.StatusCode.INVALID_ARGUMENT),
        ([5, 6], {"top_p": 0.0}, grpc.StatusCode.INVALID_ARGUMENT),
        ([5] * 400, {}, grpc.StatusCode.OUT_OF_RANGE),
    ],
)
def test_error_codes_and_server_keeps_serving(cluster, ids, sampling, code):
    _, stub = cluster
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, ids, **sampling)
    assert err.value.code() == code and "Traceback" not in err.value.details()
    assert generate(stub, [5, 6, 7])[-1].finish_reason == "length"


def pulls(http_address: str) -> int:
    """The router's pull decisions so far: prompts whose prefix a decode worker sent."""
    counters = asyncio.run(scrape_counters(f"{http_address}/metrics"))
    return int(counters["sums"].get("pull_decisions:pull", 0))


def test_cache_aware_beats_round_robin_on_ray(cluster, tiny_llama):
    """Two system prompts, A A B B A A B B: cache-aware keeps each family on one worker, where
    its blocks are already; round-robin sends each family to both, so the second visit finds
    its prefix only where the decode worker can send it (a pull) or computes it again."""
    c, stub = cluster
    systems = random_prompts([64, 64], seed=504)
    families = [0, 0, 1, 1, 0, 0, 1, 1]
    prompts = [
        systems[f] + t for f, t in zip(families, random_prompts([5] * 8, seed=505), strict=True)
    ]

    def run(s) -> tuple[int, set[str]]:
        hits, used = 0, set()
        for prompt in prompts:
            usage = generate(s, prompt)[-1].usage
            hits += usage.cached_tokens
            used.add(usage.prefill_worker)
        return hits, used

    c.close()  # the module's cluster (cache_aware) restarts fresh for a fair comparison
    results, pulled = {}, {}
    for policy in ("cache_aware", "round_robin"):
        fresh = local(tiny_llama, policy)
        try:
            results[policy] = run(pb_grpc.InferenceStub(grpc.insecure_channel(fresh.address)))
            pulled[policy] = pulls(fresh.http_address)
        finally:
            fresh.close()
    # cache-aware: every visit after a family's first hits its 64 tokens where they are
    assert results["cache_aware"] == (6 * 64, {"prefill-0", "prefill-1"})
    assert pulled["cache_aware"] == 0
    # round-robin: visits 5-8 hit locally; visits 2 and 4 (each family's first on the other
    # worker) hit only by a pull from decode-0, which the router makes once its index
    # shows decode-0's blocks (0, 1 or 2 of them, as the index refresh falls)
    assert pulled["round_robin"] in (0, 1, 2)
    assert results["round_robin"] == (
        (4 + pulled["round_robin"]) * 64,
        {"prefill-0", "prefill-1"},
    )
