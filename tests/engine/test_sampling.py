"""Seeded sampling is batch-independent; filters keep exactly the allowed tokens."""

from __future__ import annotations

import torch

from engine import LLM, SamplingParams
from engine.sampler import SampleRequest, _filter_logits, sample
from tests.helpers import random_prompts


def test_seeded_sampling_same_alone_and_in_batch(tiny_llama):
    llm = LLM(tiny_llama, skip_tokenizer_init=True, block_size=4, num_kv_blocks=256, chunk_size=16)
    prompts = random_prompts([11, 25, 6, 40], seed=11)
    params = [
        SamplingParams(
            max_tokens=12, temperature=1.3, top_p=0.95, top_k=50, seed=100 + i, ignore_eos=True
        )
        for i in range(4)
    ]
    alone = [llm.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params, strict=True)]
    batch = [o.token_ids for o in llm.generate(prompts, params)]
    assert alone == batch
    # Different seeds really give different streams (the test above could not fail otherwise).
    other = llm.generate(
        [prompts[0]],
        [
            SamplingParams(
                max_tokens=12, temperature=1.3, top_p=0.95, top_k=50, seed=999, ignore_eos=True
            )
        ],
    )
    assert other[0].token_ids != alone[0]


def test_sampling_draws_follow_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    counts = torch.zeros(3)
    p = SamplingParams(temperature=1.0)
    for position in range(3000):
        counts[sample(logits, [SampleRequest(p, 7, position)])[0]] += 1
    assert torch.allclose(counts / 3000, torch.tensor([0.5, 0.3, 0.2]), atol=0.03)


def test_filters_keep_exact_sets():
    logits = torch.log(torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05]))
    kept = lambda p: torch.isfinite(_filter_logits(logits, p)).nonzero().flatten().tolist()
    assert kept(SamplingParams(top_k=2)) == [0, 1]
    assert kept(SamplingParams(top_p=0.6)) == [0, 1]  # 0.4 < 0.6, 0.65 >= 0.6
    assert kept(SamplingParams(top_p=0.64)) == [0, 1]
    assert kept(SamplingParams(top_p=0.66)) == [0, 1, 2]
    assert kept(SamplingParams(min_p=0.45)) == [0, 1, 2]  # >= 0.18
    assert kept(SamplingParams(top_k=4, min_p=0.3)) == [0, 1, 2]  # >= 0.12
