"""Prompt logprobs equal Hugging Face's log_softmax of the model's logits at every prompt
position (fp32, 1e-4), however the prompt is chunked, preempted or partly cached already;
per-token logprobs are the raw model's, whatever the logits processors did."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, LLMEngine, SamplingParams
from tests.helpers import random_prompts


def hf_logprobs(hf, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V]: row i is the log-softmax of the logits after tokens[: i + 1]."""
    with torch.no_grad():
        logits = hf(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, -1)


def check_prompt_logprobs(entries, prompt: list[int], ref: torch.Tensor, top_n: int) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for j in range(1, len(prompt)):
        lp = entries[j]
        assert lp.token_id == prompt[j]
        assert lp.logprob == pytest.approx(float(ref[j - 1, prompt[j]]), abs=1e-4)
        assert len(lp.top) == top_n
        if top_n:
            top = torch.topk(ref[j - 1], top_n)
            assert [t for t, _ in lp.top] == top.indices.tolist()
            assert torch.allclose(torch.tensor([v for _, v in lp.top]), top.values, atol=1e-4)


@pytest.mark.parametrize("kind", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("chunk_size", [1, 5, 64])
def test_prompt_logprobs_match_hf(kind, chunk_size, request, hf_models):
    path = request.getfixturevalue(kind)
    llm = LLM(
        path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=128, chunk_size=chunk_size
    )
    prompts = random_prompts([1, 2, 9, 30], seed=81)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
        check_prompt_logprobs(out.prompt_logprobs, prompt, hf_logprobs(hf_models(path), prompt), 3)
    llm.engine.check_integrity()


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(tiny_llama, hf_models):
    llm = LLM(tiny_llama, skip_tokenizer_init=True, block_size=4, num_kv_blocks=128, chunk_size=16)
    shared = random_prompts([24], seed=82)[0]
    a, b, c = (shared + t for t in random_prompts([5, 6, 7], seed=83))
    greedy = dict(max_tokens=3, temperature=0.0, ignore_eos=True)
    assert llm.generate(a, SamplingParams(**greedy))[0].num_cached_tokens == 0
    out = llm.generate(b, SamplingParams(**greedy, prompt_logprobs=0))[0]
    assert out.num_cached_tokens == 0  # the 24 cached tokens have no logits: recomputed
    check_prompt_logprobs(out.prompt_logprobs, b, hf_logprobs(hf_models(tiny_llama), b), 0)
    assert out.token_ids == llm.generate(b, SamplingParams(**greedy))[0].token_ids
    # The cache itself is intact: a request without prompt logprobs still hits it.
    assert llm.generate(c, SamplingParams(**greedy))[0].num_cached_tokens == 24


def test_preempted_prefill_keeps_its_prompt_logprobs_once(tiny_llama, hf_models):
    # 10 blocks of 4 tokens cannot hold three 12-token prompts and their outputs at once.
    engine = LLMEngine(
        tiny_llama,
        skip_tokenizer_init=True,
        block_size=4,
        num_kv_blocks=10,
        chunk_size=4,
        enable_prefix_caching=False,
    )
    prompts = random_prompts([12, 12, 12], seed=84)
    params = SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=2, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    got, preempted = {}, []
    while engine.has_unfinished():
        result = engine.step()
        preempted += result.preempted
        for rid, out in result.outputs.items():
            if out.prompt_logprobs is not None:
                assert rid not in got
                got[rid] = out.prompt_logprobs
    assert preempted
    for i, p in enumerate(prompts):
        check_prompt_logprobs(got[str(i)], p, hf_logprobs(hf_models(tiny_llama), p), 2)
    engine.check_integrity()


def test_sampled_logprobs_are_the_raw_models(tiny_llama, hf_models):
    llm = LLM(tiny_llama, skip_tokenizer_init=True, block_size=4, num_kv_blocks=64, chunk_size=8)
    prompt = random_prompts([10], seed=85, vocab=40)[0]
    params = SamplingParams(
        max_tokens=8,
        temperature=0.0,
        logprobs=4,
        ignore_eos=True,
        repetition_penalty=1.8,
        logit_bias={7: 3.0},
    )
    out = llm.generate(prompt, params)[0]
    ref = hf_logprobs(hf_models(tiny_llama), prompt + out.token_ids)[len(prompt) - 1 :]
    changed = 0
    for step, lp in enumerate(out.logprobs):
        assert lp.token_id == out.token_ids[step]
        assert lp.logprob == pytest.approx(float(ref[step, lp.token_id]), abs=1e-4)
        assert [t for t, _ in lp.top] == torch.topk(ref[step], 4).indices.tolist()
        changed += lp.token_id != int(ref[step].argmax())
    assert changed  # the processors chose other tokens than the raw argmax somewhere
