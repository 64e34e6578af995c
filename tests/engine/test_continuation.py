"""A migrated request's continuation (num_prior_output_tokens): prompt + the tokens generated so
far, prefilled again elsewhere, goes on exactly as the uninterrupted run (seeded draws depend
on the token's absolute position), and max_tokens counts the earlier tokens."""

from __future__ import annotations

import pytest

from engine import LLM, InvalidRequestError, SamplingParams
from tests.helpers import random_prompts


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, skip_tokenizer_init=True, block_size=4, chunk_size=16)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("cut", [1, 7, 19])
def test_continuation_equals_uninterrupted_run(llm, temperature, cut):
    prompt = random_prompts([13], seed=5)[0]
    params = dict(max_tokens=24, temperature=temperature, seed=1234, ignore_eos=True)
    whole = llm.generate(prompt, SamplingParams(**params))[0].token_ids
    assert len(whole) == 24
    rest = llm.generate(
        prompt + whole[:cut], SamplingParams(**params, num_prior_output_tokens=cut)
    )[0]
    assert rest.token_ids == whole[cut:]  # max_tokens counted the first `cut` tokens too
    assert rest.finish_reason == "length"


def test_prior_output_tokens_must_fit():
    with pytest.raises(InvalidRequestError, match="num_prior_output_tokens"):
        SamplingParams(max_tokens=4, num_prior_output_tokens=4)
    with pytest.raises(InvalidRequestError, match="num_prior_output_tokens"):
        SamplingParams(num_prior_output_tokens=-1)


def test_prior_output_tokens_are_the_prompt_tail(llm):
    with pytest.raises(InvalidRequestError, match="tail"):
        llm.generate([5, 6, 7], SamplingParams(max_tokens=8, num_prior_output_tokens=3))
