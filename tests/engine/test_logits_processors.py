"""Penalties, logit_bias and min_tokens: exactly a plain per-token reference over random
logits, Hugging Face's repetition penalty in an engine run, and the same tokens whether a
request runs in one engine, continues elsewhere, or is handed from a prefill engine."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from engine import LLM, InvalidRequestError, LLMEngine, SamplingParams
from engine.logits_processors import process_logits
from engine.sampler import SampleRequest, sample
from tests.engine.test_remote_kv import OPTS, disaggregated
from tests.helpers import random_prompts, run_to_completion

V = 64
F32 = np.float32


def reference(row: torch.Tensor, req: SampleRequest) -> torch.Tensor:
    """One row processed token by token in float32, as the processors' docstring says."""
    p = req.params
    out = [F32(x) for x in row.tolist()]
    if req.num_output_tokens < p.min_tokens:
        for t in req.min_tokens_mask:
            out[t] = F32(-np.inf)
    for t, bias in p.logit_bias:
        out[t] = out[t] + F32(bias)
    seen = set(req.token_ids)
    generated = list(req.token_ids)[len(req.token_ids) - req.num_output_tokens :]
    counts = Counter(generated)
    for t in range(len(out)):
        x = out[t]
        if p.repetition_penalty != 1.0 and t in seen:
            rep = F32(p.repetition_penalty)
            x = x / rep if x > 0 else x * rep
        if p.frequency_penalty or p.presence_penalty:
            x = x - F32(p.frequency_penalty) * F32(counts[t])
            x = x - F32(p.presence_penalty) * F32(counts[t] > 0)
        out[t] = x
    return torch.tensor(np.array(out, dtype=F32))


PARAMS = [
    dict(),
    dict(repetition_penalty=1.7),
    dict(repetition_penalty=0.6),
    dict(presence_penalty=1.25, frequency_penalty=0.3),
    dict(presence_penalty=-0.5, frequency_penalty=-1.1, repetition_penalty=1.2),
    dict(logit_bias={3: 5.0, 17: -100, 40: 0.25}),
    dict(logit_bias={5: 2.5}, repetition_penalty=1.3, frequency_penalty=0.7, min_tokens=4),
    dict(min_tokens=3, max_tokens=8),
]


@pytest.mark.parametrize("kwargs", PARAMS)
def test_processors_equal_the_reference_exactly(kwargs):
    g = torch.Generator().manual_seed(len(str(kwargs)))
    params = SamplingParams(temperature=0.0, **kwargs)
    reqs, rows = [], []
    for i in range(6):
        history = torch.randint(0, V, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g)
        generated = int(torch.randint(0, len(history) + 1, (1,), generator=g))
        reqs.append(
            SampleRequest(
                params,
                seed=i,
                position=len(history),
                token_ids=tuple(history.tolist()),
                num_output_tokens=generated,
                min_tokens_mask=frozenset({2, 9}),
            )
        )
        rows.append(torch.randn(V, generator=g) * 3)
    logits = torch.stack(rows)
    raw = logits.clone()
    got = process_logits(logits, reqs)
    assert torch.equal(logits, raw)  # the raw logits (for logprobs) are never written
    expected = torch.stack([reference(logits[i], r) for i, r in enumerate(reqs)])
    assert torch.equal(got, expected)
    assert sample(logits, reqs) == expected.argmax(-1).tolist()
    if kwargs:  # the reference is not the identity: the comparison above could fail
        assert not torch.equal(expected, raw)


def test_rows_without_processors_are_the_same_tensor():
    logits = torch.randn(2, V)
    reqs = [SampleRequest(SamplingParams(), 0, 1, min_tokens_mask=frozenset({2}))] * 2
    assert process_logits(logits, reqs) is logits


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, skip_tokenizer_init=True, block_size=4, chunk_size=8)


def test_repetition_penalty_greedy_equals_hf(llm, tiny_llama, hf_models):
    hf = hf_models(tiny_llama)
    prompts = random_prompts([6, 19], seed=71, vocab=40)  # few distinct ids: repeats happen
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, repetition_penalty=1.8)
    plain = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    for prompt, out, unpenalized in zip(prompts, llm.generate(prompts, params), plain, strict=True):
        ref = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt)),
            max_new_tokens=16,
            do_sample=False,
            repetition_penalty=1.8,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert out.token_ids == ref
        assert out.token_ids != unpenalized.token_ids  # the penalty changed the run


def test_min_tokens_masks_eos_and_stop_token_ids(llm):
    prompt = random_prompts([9], seed=72)[0]
    eos = SamplingParams(max_tokens=12, temperature=0.0, logit_bias={2: 100}, min_tokens=5)
    out = llm.generate(prompt, eos)[0]
    assert 2 not in out.token_ids[:5] and out.token_ids[5] == 2 and len(out.token_ids) == 6
    assert (out.finish_reason, out.stop_reason) == ("stop", 2)
    stop = SamplingParams(
        max_tokens=12, temperature=0.0, logit_bias={7: 100}, stop_token_ids=[7], min_tokens=3
    )
    out = llm.generate(prompt, stop)[0]
    assert len(out.token_ids) == 4 and 7 not in out.token_ids[:3]
    assert (out.token_ids[3], out.finish_reason, out.stop_reason) == (7, "stop", 7)
    # Without min_tokens the biased EOS comes at once.
    out = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, logit_bias={2: 100}))
    assert out[0].token_ids == [2]


SAMPLED = dict(
    max_tokens=20,
    temperature=1.0,
    seed=5,
    ignore_eos=True,
    presence_penalty=1.5,
    frequency_penalty=1.0,
    repetition_penalty=2.0,
    logit_bias={11: 6.0},
    min_tokens=6,
)


@pytest.mark.parametrize("cut", [1, 9])
def test_continuation_with_penalties_equals_uninterrupted(llm, cut):
    prompt = random_prompts([11], seed=73, vocab=60)[0]
    whole = llm.generate(prompt, SamplingParams(**SAMPLED))[0].token_ids
    plain = llm.generate(prompt, SamplingParams(max_tokens=20, temperature=1.0, seed=5))
    assert whole != plain[0].token_ids
    rest = llm.generate(
        prompt + whole[:cut], SamplingParams(**SAMPLED, num_prior_output_tokens=cut)
    )[0]
    assert rest.token_ids == whole[cut:]


def test_prefill_engine_first_token_and_decode_engine_apply_the_same(tiny_llama):
    prompts = random_prompts([7, 22], seed=74, vocab=60)
    params = [SamplingParams(**SAMPLED), SamplingParams(**{**SAMPLED, "temperature": 0.0})]
    colocated = LLMEngine(tiny_llama, num_kv_blocks=128, **OPTS)
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        colocated.add_request(str(i), p, sp)
    expected = run_to_completion(colocated)
    prefill = LLMEngine(tiny_llama, num_kv_blocks=128, **OPTS)
    decode = LLMEngine(tiny_llama, num_kv_blocks=128, **OPTS)
    got, _ = disaggregated(prefill, decode, prompts, params)
    assert got == expected


def test_logit_bias_ids_must_be_in_the_vocabulary(llm):
    with pytest.raises(InvalidRequestError, match=r"logit_bias .*\[0, 512\): \[512\]"):
        llm.generate([5, 6], SamplingParams(logit_bias={512: 1.0}))
