"""The real default model: SmolLM2-135M-Instruct (GGUF, converted once) answers a chat prompt
token for token like Hugging Face transformers does on the same weights."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2() -> LLM:
    return LLM("smollm2-135m-instruct", kv_cache_memory_gb=0.25, chunk_size=16)


def test_chat_greedy_equals_hf(smollm2, hf_models):
    messages = [
        {
            "role": "system",
            "content": "You are a concise, friendly assistant who explains "
            "things to curious children using simple words and short sentences.",
        },
        {"role": "user", "content": "Name three primary colors and explain why."},
    ]
    out = smollm2.chat(messages, SamplingParams(max_tokens=40, temperature=0.0))[0]
    ids = smollm2.chat_token_ids(messages)
    hf = hf_models(str(smollm2.engine.model_dir))
    ref = hf.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids)),
        max_new_tokens=40,
        do_sample=False,
    )[0, len(ids) :].tolist()
    assert len(ids) > 32  # the prompt spans several prefill chunks
    assert out.token_ids == ref
    assert out.text == smollm2.tokenizer.decode(ref, skip_special_tokens=True)


def test_stop_string_truncates_text(smollm2):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    full = smollm2.chat(messages, SamplingParams(max_tokens=20, temperature=0.0))[0]
    assert "Paris" in full.text and full.finish_reason == "stop"
    cut = smollm2.chat(messages, SamplingParams(max_tokens=20, temperature=0.0, stop=("Paris",)))[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == "Paris"
    assert cut.text == full.text[: full.text.index("Paris")]
