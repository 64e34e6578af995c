"""benchmarks.int8_quality's two measures on a tiny GGUF-converted model: the engine-driven
perplexity equals transformers' teacher-forced perplexity (exact path, any rows per step),
and the greedy agreement of an engine with itself is total."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.int8_quality import agreement, perplexity
from engine import LLM
from engine.model.gguf_kernel import load_kernel
from tests.engine.test_gguf_blocks import VOCAB
from tests.helpers import random_prompts

pytestmark = pytest.mark.skipif(load_kernel() is None, reason="no GGUF block kernel here")
OPTS = dict(skip_tokenizer_init=True, block_size=4, num_kv_blocks=64, enable_prefix_caching=False)


def test_perplexity_equals_transformers_teacher_forced(quantized_llama, hf_models):
    tokens = random_prompts([40], seed=5, vocab=VOCAB)[0]
    hf = hf_models(str(quantized_llama))
    with torch.no_grad():
        logits = hf(torch.tensor([tokens])).logits[0, :-1].double()
    nll = -torch.log_softmax(logits, -1)[torch.arange(39), torch.tensor(tokens[1:])].mean()
    want = math.exp(float(nll))
    llm = LLM(str(quantized_llama), **OPTS)
    for rows in (1, 3, 8):  # one token per step (decode) and a few rows per step
        assert perplexity(llm, tokens, rows) == pytest.approx(want, rel=1e-4)
    int8 = LLM(str(quantized_llama), int8_activations=True, **OPTS)
    assert perplexity(int8, tokens, 1) == pytest.approx(want, rel=0.05)  # close, not equal


def test_an_engine_agrees_with_itself(quantized_llama):
    llm = LLM(str(quantized_llama), **OPTS)
    prompts = random_prompts([6, 11], seed=6, vocab=VOCAB)
    assert agreement(llm, llm, prompts, 8) == (1.0, 1.0)
