"""LLMEngine step API: exact scheduling of the prefix-cache + chunked-prefill scenario,
abort, admission errors, stop conditions."""

from __future__ import annotations

import pytest

from engine import (
    LLM,
    CapacityError,
    InvalidRequestError,
    LLMEngine,
    PromptTooLongError,
    SamplingParams,
)
from tests.helpers import random_prompts, run_to_completion

DECODE = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)


def test_cached_prefix_then_chunked_prefill_interleaved_with_decodes(tiny_llama):
    """5,000 cached tokens; a 7,000-token prompt arrives while B, C, D decode."""
    engine = LLMEngine(
        tiny_llama,
        skip_tokenizer_init=True,
        block_size=8,
        chunk_size=1024,
        max_num_batched_tokens=2048,
        num_kv_blocks=2000,
        decode_stretch=0,  # fixed chunks (the step budget: tests/engine/test_dynamic_chunking.py)
    )
    prefix, tail, extra = random_prompts([5000, 2000, 3], seed=21)
    engine.add_request("warm", prefix + extra, SamplingParams(max_tokens=1, temperature=0))
    run_to_completion(engine)
    for rid, prompt in zip("BCD", random_prompts([30, 45, 12], seed=22), strict=True):
        engine.add_request(rid, prompt, DECODE)
    while engine.step().scheduled != {"B": 1, "C": 1, "D": 1}:  # until all three decode alone
        pass
    engine.add_request("A", prefix + tail, DECODE)

    first = engine.step()
    assert engine.scheduler.requests["A"].num_cached_tokens == 5000
    assert first.scheduled == {"B": 1, "C": 1, "D": 1, "A": 1024}
    assert "A" not in first.outputs  # a partial prefill samples nothing
    second = engine.step()
    assert second.scheduled == {"B": 1, "C": 1, "D": 1, "A": 976}
    assert second.outputs["A"].num_cached_tokens == 5000
    assert len(second.outputs["A"].new_token_ids) == 1
    for _ in range(3):
        assert engine.step().scheduled == {"B": 1, "C": 1, "D": 1, "A": 1}
    engine.check_integrity()


def test_prompts_arriving_together_on_cpu_prefill_in_turn_offline_in_one_step(tiny_llama):
    prompts = random_prompts([40, 40, 40], seed=23)
    served = LLMEngine(tiny_llama, skip_tokenizer_init=True, block_size=8, num_kv_blocks=64)
    offline = LLM(tiny_llama, skip_tokenizer_init=True, block_size=8, num_kv_blocks=64).engine
    for engine in (served, offline):
        for rid, prompt in zip("ABC", prompts, strict=True):
            engine.add_request(rid, prompt, SamplingParams(max_tokens=5, temperature=0))
    # a served CPU engine: no other prompt joins a step carrying 32 prompt tokens, and while
    # requests decode a decode-only step runs between two prompts' steps
    assert served.scheduler.config.prefill_batch_tokens == 32
    assert served.scheduler.config.decode_steps_between_prompts == 1
    assert [served.step().scheduled for _ in range(5)] == [
        {"A": 40},
        {"A": 1},
        {"A": 1, "B": 40},
        {"A": 1, "B": 1},
        {"A": 1, "B": 1, "C": 40},
    ]
    # the offline LLM batches prompts up to the step's token budget (2,048 by default)
    assert offline.scheduler.config.prefill_batch_tokens == 2048
    assert offline.scheduler.config.decode_steps_between_prompts == 0
    assert offline.step().scheduled == {"A": 40, "B": 40, "C": 40}


def test_abort_frees_blocks_immediately(tiny_llama):
    engine = LLMEngine(
        tiny_llama,
        skip_tokenizer_init=True,
        block_size=4,
        num_kv_blocks=64,
        chunk_size=8,
        enable_prefix_caching=False,
    )
    engine.add_request("x", random_prompts([30])[0], DECODE)
    engine.add_request("y", random_prompts([6])[0], DECODE)
    engine.step()
    assert engine.pool.num_free_blocks < 64
    assert engine.abort("x") and engine.abort("y")
    assert not engine.abort("x")
    engine.check_integrity()
    assert engine.pool.num_free_blocks == 64
    result = engine.step()
    assert {r: o.finish_reason for r, o in result.outputs.items()} == {"x": "abort", "y": "abort"}
    assert not engine.has_unfinished()


def test_admission_errors(tiny_llama):
    engine = LLMEngine(
        tiny_llama, skip_tokenizer_init=True, block_size=4, num_kv_blocks=8, max_model_len=100
    )
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("a", [], DECODE)
    with pytest.raises(PromptTooLongError, match="max_model_len is 100"):
        engine.add_request("b", [5] * 100, DECODE)
    with pytest.raises(CapacityError, match="only 8"):
        engine.add_request("c", [5] * 40, DECODE)
    with pytest.raises(InvalidRequestError, match="out of range"):
        engine.add_request("d", [5, 100000], DECODE)
    engine.add_request("e", [5, 6], DECODE)
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("e", [5, 6], DECODE)
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(InvalidRequestError, match="unknown engine option"):
        LLMEngine(tiny_llama, skip_tokenizer_init=True, blok_size=4)


def test_stop_token_ids_and_max_model_len(tiny_llama):
    engine = LLMEngine(
        tiny_llama, skip_tokenizer_init=True, block_size=4, num_kv_blocks=64, max_model_len=24
    )
    prompt = random_prompts([20], seed=4)[0]
    engine.add_request("free", prompt, DECODE)
    free = run_to_completion(engine)["free"]
    assert len(free) == 4  # capped by max_model_len 24
    engine.add_request(
        "stop",
        prompt,
        SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True, stop_token_ids=(free[2],)),
    )
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step().outputs.values()
    assert [t for o in outputs for t in o.new_token_ids] == free[: free.index(free[2]) + 1]
    assert outputs[-1].finish_reason == "stop" and outputs[-1].stop_reason == free[2]
    engine.check_integrity()
