"""End to end: gRPC -> router -> Ray worker actors -> gRPC stream, on a local Ray cluster."""

from __future__ import annotations

import grpc
import pytest

from cluster.local import LocalCluster, LocalOptions
from engine import LLM, SamplingParams
from router.proto import inference_pb2 as pb
from router.proto import inference_pb2_grpc as pb_grpc
from tests.helpers import random_prompts

pytestmark = pytest.mark.ray

pytest.importorskip("ray")


def test_grpc_on_ray_cluster_equals_offline_engine_and_shuts_down(tiny_llama):
    extra = {"skip_tokenizer_init": True, "num_kv_blocks": 256}
    cluster = LocalCluster(
        LocalOptions(
            model=tiny_llama, port=0, http_port=0, block_size=4, chunk_size=16, engine_extra=extra
        )
    )
    try:
        cluster.start(log=lambda _m: None)
        stub = pb_grpc.InferenceStub(grpc.insecure_channel(cluster.address))
        prompts = random_prompts([12, 45], seed=401)
        expected = LLM(tiny_llama, block_size=4, chunk_size=16, **extra).generate(
            prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        )
        for prompt, exp in zip(prompts, expected, strict=True):
            replies = list(
                stub.Generate(
                    pb.GenerateRequest(
                        prompt_token_ids=pb.TokenIds(ids=prompt),
                        sampling=pb.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                    ),
                    timeout=60,
                )
            )
            assert [t for r in replies for t in r.token_ids] == exp.token_ids
            usage = replies[-1].usage
            assert (usage.prefill_worker, usage.decode_worker) == ("prefill-0", "decode-0")
        status = stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=30)
        assert sorted((w.worker_id, w.role, w.healthy) for w in status.workers) == [
            ("decode-0", "decode", True),
            ("prefill-0", "prefill", True),
        ]
    finally:
        cluster.close()
    import ray

    assert not ray.is_initialized()
