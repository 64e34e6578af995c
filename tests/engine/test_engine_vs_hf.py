"""Greedy tokens and logprobs of our engine equal Hugging Face transformers' (fp32)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.helpers import hf_greedy, random_prompts

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("kind", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("chunk_size", [1, 7, 64])
def test_greedy_batch_matches_hf(kind, chunk_size, request, hf_models):
    path = request.getfixturevalue(kind)
    llm = LLM(
        path,
        skip_tokenizer_init=True,
        block_size=4,
        num_kv_blocks=128,
        chunk_size=chunk_size,
        max_num_batched_tokens=max(chunk_size, 64),
    )
    prompts = random_prompts([5, 17, 33, 2, 70])
    outs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(hf_models(path), prompt, 10)
        assert out.finish_reason == "length"
    llm.engine.check_integrity()
    assert llm.engine.pool.num_free_blocks == 128  # everything released (some still cached)


@pytest.mark.parametrize("kind", ["tiny_llama", "tiny_qwen2"])
def test_prefix_hits_give_same_tokens(kind, request, hf_models):
    path = request.getfixturevalue(kind)
    llm = LLM(path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=256, chunk_size=16)
    shared = random_prompts([40], seed=7)[0]
    tails = random_prompts([3, 9, 14], seed=8)
    first = llm.generate([shared + tails[0]], GREEDY)[0]
    assert first.num_cached_tokens == 0
    outs = llm.generate([shared + t for t in tails[1:]], GREEDY)
    for tail, out in zip(tails[1:], outs, strict=True):
        assert out.num_cached_tokens == 40  # 10 full blocks of the shared prefix
        assert out.token_ids == hf_greedy(hf_models(path), shared + tail, 10)
    # The very same prompt again: all full blocks hit, except the one holding the last token.
    again = llm.generate([shared + tails[0]], GREEDY)[0]
    assert again.num_cached_tokens == (len(shared + tails[0]) - 1) // 4 * 4
    assert again.token_ids == first.token_ids
    llm.engine.check_integrity()


def test_preemption_recomputes_exactly(tiny_llama, hf_models):
    # 12 blocks of 4 tokens cannot hold four 20-token sequences: requests get preempted.
    llm = LLM(
        tiny_llama,
        skip_tokenizer_init=True,
        block_size=4,
        num_kv_blocks=12,
        chunk_size=8,
        enable_prefix_caching=False,
    )
    prompts = random_prompts([9, 10, 11, 12], seed=3)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(4)}
    preempted = []
    while engine.has_unfinished():
        result = engine.step()
        preempted += result.preempted
        for rid, out in result.outputs.items():
            tokens[rid] += out.new_token_ids
        engine.check_integrity()
    assert preempted, "the scenario must preempt"
    for i, p in enumerate(prompts):
        assert tokens[str(i)] == hf_greedy(hf_models(tiny_llama), p, 8)


def test_logprobs_match_hf(tiny_qwen2, hf_models):
    llm = LLM(tiny_qwen2, skip_tokenizer_init=True, block_size=4, num_kv_blocks=64, chunk_size=8)
    prompt = random_prompts([21], seed=5)[0]
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=4, temperature=0.0, logprobs=5, ignore_eos=True)
    )[0]
    full = torch.tensor([prompt + out.token_ids[:-1]])
    with torch.no_grad():
        logits = hf_models(tiny_qwen2)(full).logits[0, len(prompt) - 1 :]
    ref = torch.log_softmax(logits.float(), -1)
    assert len(out.logprobs) == 4
    for step, lp in enumerate(out.logprobs):
        assert lp.token_id == out.token_ids[step] == int(ref[step].argmax())
        assert lp.logprob == pytest.approx(float(ref[step, lp.token_id]), abs=1e-4)
        ids, vals = zip(*lp.top, strict=True)
        top = torch.topk(ref[step], 5)
        assert list(ids) == top.indices.tolist()
        assert torch.allclose(torch.tensor(vals), top.values, atol=1e-4)


def test_mistral_matches_hf_within_its_sliding_window(tmp_path, hf_models):
    from benchmarks.checkpoints import make_checkpoint
    from engine import PromptTooLongError

    path = str(make_checkpoint(tmp_path, "mistral"))
    llm = LLM(path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=128, chunk_size=16)
    assert llm.engine.max_model_len == 96  # capped at the window (full attention inside it)
    prompts = random_prompts([9, 40], seed=9)
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY), strict=True):
        assert out.token_ids == hf_greedy(hf_models(path), prompt, 10)
    with pytest.raises(PromptTooLongError):
        llm.generate([[5] * 96], GREEDY)
