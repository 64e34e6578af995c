"""Workers as Ray actors placed and paired by the controller: a request prefilled on one
actor and decoded on another gives the colocated engine's tokens; scaled to 0 prefill workers
the cluster runs aggregated (every request prefilled on its decode worker) and back."""

from __future__ import annotations

import grpc
import pytest

from cluster.controller import NAMESPACE, controller_handle
from cluster.local_ray import start_local_ray
from cluster.ray_peer import decode_client, prefill_client
from engine import LLM, CapacityError, InvalidRequestError, SamplingParams
from kvtransfer.errors import AddressError
from kvtransfer.worker_api import PromptRequest, Role
from router.handoff import generate_disaggregated
from router.proto import inference_pb2 as pb
from router.proto import inference_pb2_grpc as pb_grpc
from tests.cluster.manifests import tiny_manifest
from tests.helpers import random_prompts

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster(tiny_llama):
    start_local_ray(num_cpus=8, namespace=NAMESPACE)
    engine = dict(
        model=tiny_llama, skip_tokenizer_init=True, block_size=4, num_kv_blocks=256, chunk_size=16
    )
    controller = controller_handle(create=True)
    ray.get(controller.apply.remote(tiny_manifest(tiny_llama)), timeout=600)
    yield controller, engine
    ray.get(controller.shutdown.remote(), timeout=60)
    ray.kill(controller)
    ray.shutdown()


def test_controller_places_and_pairs_workers(cluster):
    controller, _ = cluster
    workers = ray.get(controller.workers.remote())
    assert sorted((w["worker_id"], w["role"], w["healthy"]) for w in workers) == [
        ("decode-0", "decode", True),
        ("prefill-0", "prefill", True),
    ]
    actor = ray.get_actor("prefill-0", namespace=NAMESPACE)  # named, in the baton namespace
    assert ray.get(actor.info.remote()).role is Role.PREFILL


def test_request_through_actors_equals_colocated(cluster, tiny_llama):
    controller, engine = cluster
    prefill = prefill_client(ray.get(controller.handle.remote("prefill-0")))
    decode = decode_client(ray.get(controller.handle.remote("decode-0")))
    prompts = random_prompts([7, 41], seed=101)
    params = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    expected = LLM(**engine).generate(prompts, SamplingParams(**params))
    for i, prompt in enumerate(prompts):
        outs = list(
            generate_disaggregated(
                prefill,
                decode,
                f"ray-{i}",
                prompt,
                params,
                prefill_id="prefill-0",
                decode_id="decode-0",
                timeout=60,
            )
        )
        assert [t for o in outs for t in o["token_ids"]] == expected[i].token_ids
    stats = {w["worker_id"]: w for w in ray.get(controller.workers.remote())}
    assert stats["decode-0"]["blocks_received"] == 2 + 11  # 7 and 41 tokens, block size 4
    assert stats["decode-0"]["free_blocks"] == 256


def test_engine_errors_come_back_as_themselves_without_ray_traceback(cluster):
    controller, _ = cluster
    decode = decode_client(ray.get(controller.handle.remote("decode-0")))
    params = {"max_tokens": 1, "temperature": 0.0, "seed": 1}
    with pytest.raises(CapacityError) as err:  # 256 blocks of 4 tokens: 1,100 never fit
        decode.reserve(PromptRequest("too-big", (5,) * 1100, params))
    assert type(err.value) is CapacityError
    assert str(err.value) == "prompt needs 276 KV blocks; this engine has only 256"
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        decode.reserve(PromptRequest("empty", (), params))
    with pytest.raises(AddressError, match="missing") as err:  # a kvtransfer error, too
        decode.connect_prefill("prefill-x", {"host": "127.0.0.1"})
    assert type(err.value) is AddressError
    stats = {w["worker_id"]: w for w in ray.get(controller.workers.remote())}
    assert stats["decode-0"]["free_blocks"] == 256  # nothing was reserved


def test_killed_worker_is_restarted_repaired_and_serves_again(cluster):
    controller, engine = cluster
    decode_handle = ray.get(controller.handle.remote("decode-0"))
    ray.kill(decode_handle, no_restart=False)  # the process dies; Ray restarts the actor
    health = {"restarts": 0}
    for _ in range(60):  # the router actor's poll may be the one that sees the restart
        health = ray.get(controller.check_health.remote(timeout=5.0))
        if health["restarts"] and health["healthy"]["decode-0"]:
            break
    assert health["restarts"] == 1 and health["healthy"] == {"prefill-0": True, "decode-0": True}
    prefill = prefill_client(ray.get(controller.handle.remote("prefill-0")))
    decode = decode_client(ray.get(controller.handle.remote("decode-0")))
    prompt = random_prompts([23], seed=111)[0]
    params = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    expected = LLM(**engine).generate([prompt], SamplingParams(**params))[0].token_ids
    outs = list(
        generate_disaggregated(
            prefill,
            decode,
            "after-restart",
            prompt,
            params,
            prefill_id="prefill-0",
            decode_id="decode-0",
            timeout=60,
        )
    )
    assert [t for o in outs for t in o["token_ids"]] == expected
    assert ray.get(controller.check_health.remote())["restarts"] == 1


def test_scale_to_aggregated_and_back_by_apply(cluster, tiny_llama):
    # Runs last: it reshapes the module's cluster.
    controller, engine = cluster
    result = ray.get(controller.scale.remote({"prefill": 0, "decode": 2}), timeout=600)
    assert result["changes"] == ["remove 1 prefill worker(s)", "add 1 decode worker(s)"]
    status = ray.get(controller.status.remote(), timeout=60)
    assert (status["mode"], status["replicas"]) == ("aggregated", {"prefill": 0, "decode": 2})
    assert status["router"]["aggregated"]
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(status["router"]["address"]))
    system = random_prompts([40], seed=121)[0]  # 10 blocks of 4
    prompts = [system + tail for tail in random_prompts([5, 7, 6], seed=122)]
    sampling = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    expected = LLM(**engine).generate(prompts, SamplingParams(**sampling))
    usage = []
    for prompt, exp in zip(prompts, expected, strict=True):
        replies = list(
            stub.Generate(
                pb.GenerateRequest(
                    prompt_token_ids=pb.TokenIds(ids=prompt),
                    sampling=pb.SamplingParams(**sampling),
                ),
                timeout=120,
            )
        )
        assert [t for r in replies for t in r.token_ids] == exp.token_ids
        u = replies[-1].usage
        usage.append((u.prefill_worker, u.decode_worker, u.cached_tokens))
    (worker, _, _), *_ = usage
    assert worker.startswith("decode-")  # prefilled locally, on the worker that has the prefix
    assert usage == [(worker, worker, 0), (worker, worker, 40), (worker, worker, 40)]

    manifest = tiny_manifest(tiny_llama, prefill=1, decode=2)
    result = ray.get(controller.apply.remote(manifest), timeout=600)
    assert result["changes"] == ["add 1 prefill worker(s)"]
    status = ray.get(controller.status.remote(), timeout=60)
    assert (status["mode"], status["replicas"]) == ("disaggregated", {"prefill": 1, "decode": 2})
    assert not status["router"]["aggregated"]
    prompt = random_prompts([29], seed=123)[0]
    replies = list(
        stub.Generate(
            pb.GenerateRequest(
                prompt_token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(**sampling)
            ),
            timeout=120,
        )
    )
    exp = LLM(**engine).generate([prompt], SamplingParams(**sampling))[0].token_ids
    assert [t for r in replies for t in r.token_ids] == exp
    assert replies[-1].usage.prefill_worker == "prefill-1"  # handed over: disaggregated again
