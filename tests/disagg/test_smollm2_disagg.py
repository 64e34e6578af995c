"""SmolLM2 prefilled in one process and decoded in another gives the colocated tokens."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.disagg.cluster import pair, run_concurrently, start_worker, tokens

pytestmark = pytest.mark.slow

OPTIONS = dict(
    model="smollm2-135m-instruct", kv_cache_memory_gb=0.1, chunk_size=32, max_num_batched_tokens=64
)


def test_smollm2_greedy_and_seeded_equal_colocated():
    colocated = LLM(**OPTIONS)
    tok = colocated.tokenizer
    texts = [
        "The three laws of robotics are",
        "Write a haiku about the sea.",
        "Explain, step by step and in detail, how a bicycle's gears let a rider climb a "
        "steep hill without getting tired as quickly, and why lower gears help.",
    ]
    prompts = [tok.encode(t) for t in texts]
    assert max(len(p) for p in prompts) > 32  # one prompt spans several chunks
    params = [
        dict(max_tokens=12, temperature=0.0),
        dict(max_tokens=12, temperature=0.8, top_p=0.95, seed=7),
        dict(max_tokens=12, temperature=0.0),
    ]
    expected = [
        o.token_ids for o in colocated.generate(prompts, [SamplingParams(**p) for p in params])
    ]
    del colocated
    prefill = start_worker("prefill", "p0", OPTIONS, {"timeout_seconds": 10.0})
    decode = start_worker("decode", "d0", OPTIONS, {"timeout_seconds": 10.0})
    try:
        pair(prefill, decode)
        got = run_concurrently(prefill, decode, prompts, params)
        assert [tokens(got[f"r{i}"]) for i in range(3)] == expected
        prefill.client.check_integrity()
        decode.client.check_integrity()
    finally:
        decode.stop()
        prefill.stop()
