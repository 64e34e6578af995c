"""Sampling n > 1: one prefill, n choices forked off its blocks (shared, the partial last one
copied), each drawing with its own seed exactly as a lone request with that seed would; each
choice ends on its own, the request's last output says finished; abort ends them all; every
block is free again afterwards."""

from __future__ import annotations

import pytest

from engine import LLM, InvalidRequestError, LLMEngine, SamplingParams
from engine.sampler import choice_seed
from tests.engine.test_remote_kv import copy_blocks
from tests.helpers import random_prompts

OPTS = dict(skip_tokenizer_init=True, block_size=4, chunk_size=16)


def run(engine: LLMEngine, check=lambda engine: None) -> tuple[dict, list]:
    """Step to the end: tokens per (request, index), and every output in order."""
    tokens, outs = {}, []
    while engine.has_unfinished():
        for out in engine.step().outputs.values():
            tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
            outs.append(out)
        engine.check_integrity()
        check(engine)
    return tokens, outs


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, num_kv_blocks=128, **OPTS)


def test_greedy_choices_are_identical(llm):
    prompt = random_prompts([10], seed=91)[0]
    greedy = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompt, SamplingParams(**greedy, n=3))
    alone = llm.generate(prompt, SamplingParams(**greedy))[0]
    assert [o.index for o in outs] == [0, 1, 2]
    assert [o.token_ids for o in outs] == [alone.token_ids] * 3
    assert {o.finish_reason for o in outs} == {"length"}
    llm.engine.check_integrity()
    assert llm.engine.pool.num_free_blocks == 128


@pytest.mark.parametrize("prompt_len", [9, 12])  # a partial last block, or only full ones
def test_seeded_choices_draw_as_lone_requests_with_their_seeds(llm, prompt_len):
    prompt = random_prompts([prompt_len], seed=92)[0]
    sampled = dict(max_tokens=10, temperature=1.0, ignore_eos=True)
    outs = llm.generate(prompt, SamplingParams(**sampled, seed=42, n=3))
    again = llm.generate(prompt, SamplingParams(**sampled, seed=42, n=3))
    assert [o.token_ids for o in outs] == [o.token_ids for o in again]  # reproducible
    assert len({tuple(o.token_ids) for o in outs}) == 3  # and different
    for i, out in enumerate(outs):  # choice 0 keeps the request's seed: n=1 draws as before
        lone = llm.generate(prompt, SamplingParams(**sampled, seed=choice_seed(42, i)))[0]
        assert out.token_ids == lone.token_ids
    assert choice_seed(42, 0) == 42
    assert llm.engine.pool.num_free_blocks == 128


def test_each_choice_ends_on_its_own_and_the_last_output_finishes(tiny_llama):
    engine = LLMEngine(tiny_llama, num_kv_blocks=64, **OPTS)
    prompt = random_prompts([7], seed=93)[0]
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=3, n=4, logit_bias={2: 4.0})
    engine.add_request("r", prompt, params)
    tokens, outs = run(engine)
    ends = [(o.index, o.finish_reason) for o in outs if o.finish_reason is not None]
    assert sorted(i for i, _ in ends) == [0, 1, 2, 3]
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    lengths = {i: len(tokens["r", i]) for i in range(4)}
    assert len(set(lengths.values())) > 1  # they did end at different steps
    for i, reason in ends:
        assert reason == ("stop" if tokens["r", i][-1] == 2 else "length")
    assert engine.pool.num_free_blocks == 64


@pytest.mark.parametrize("steps", [0, 1, 3])  # before the prefill, at the fork, decoding
def test_abort_ends_every_choice(tiny_llama, steps):
    engine = LLMEngine(tiny_llama, num_kv_blocks=64, **OPTS)
    engine.add_request("r", random_prompts([20], seed=94)[0], SamplingParams(max_tokens=20, n=3))
    outs = []
    for _ in range(steps):
        outs += engine.step().outputs.values()
    assert engine.abort("r")
    outs = list(engine.step().outputs.values())
    assert sorted(o.index for o in outs) == [0, 1, 2]
    assert {o.finish_reason for o in outs} == {"abort"} and outs[-1].finished
    assert not any(o.finished for o in outs[:-1])
    assert not engine.has_unfinished() and not engine.abort("r")
    engine.check_integrity()
    assert engine.pool.num_free_blocks == 64


def test_a_choice_without_a_free_block_recomputes_to_the_same_tokens(tiny_llama, llm):
    # 10 tokens fill 3 blocks of the 4: one fork gets the copy of the partial block, the
    # other queues and recomputes (and preemptions follow as the choices grow).
    engine = LLMEngine(tiny_llama, num_kv_blocks=4, enable_prefix_caching=False, **OPTS)
    forks = []
    fork = engine.kv.fork
    engine.kv.fork = lambda *args: forks.append(fork(*args)) or forks[-1]
    prompt = random_prompts([10], seed=95)[0]
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=8, n=3, ignore_eos=True)
    engine.add_request("r", prompt, params)
    tokens, _ = run(engine)
    assert forks == [[(2, 3)], None]
    expected = [o.token_ids for o in llm.generate(prompt, params)]
    assert [tokens["r", i] for i in range(3)] == expected
    assert engine.pool.num_free_blocks == 4


def test_running_choices_stay_within_max_num_seqs(tiny_llama, llm):
    engine = LLMEngine(tiny_llama, num_kv_blocks=128, max_num_seqs=4, **OPTS)
    prompts = random_prompts([6, 9], seed=96)
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=4, n=3, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    seen = []
    tokens, _ = run(engine, lambda e: seen.append(len(e.scheduler.running)))
    assert max(seen) == 3  # the second request waited for the first's three seats
    for i, p in enumerate(prompts):
        assert [tokens[str(i), c] for c in range(3)] == [
            o.token_ids for o in llm.generate(p, params)
        ]


def test_n_is_bounded_by_the_engine(tiny_llama):
    engine = LLMEngine(tiny_llama, num_kv_blocks=16, max_n=2, **OPTS)
    with pytest.raises(InvalidRequestError, match=r"sampling.n=3 is invalid: .* at most 2"):
        engine.add_request("r", [5, 6], SamplingParams(n=3))
    engine.add_request("ok", [5, 6], SamplingParams(n=2))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("ok#1", [5, 6], SamplingParams())


def test_prompt_logprobs_come_once_on_choice_0(llm):
    prompt = random_prompts([9], seed=97)[0]
    outs = llm.generate(prompt, SamplingParams(max_tokens=3, n=2, prompt_logprobs=1, logprobs=2))
    assert len(outs[0].prompt_logprobs) == 9 and outs[1].prompt_logprobs is None
    assert all(len(o.logprobs) == 3 for o in outs)


def test_prefill_engine_samples_n_first_tokens_and_decode_engine_forks(tiny_llama, llm):
    prompt = random_prompts([14], seed=98)[0]
    params = SamplingParams(max_tokens=7, temperature=1.0, seed=11, n=3, ignore_eos=True)
    prefill = LLMEngine(tiny_llama, num_kv_blocks=64, **OPTS)
    decode = LLMEngine(tiny_llama, num_kv_blocks=64, **OPTS)
    prefill.add_request("r", prompt, params, prefill_only=True)
    seed = prefill.seed_of("r")
    firsts, outs = run(prefill)
    assert [o.finish_reason for o in outs] == ["prefilled"] * 3 and outs[-1].finished
    assert prefill.kv.table_ids() == ["r"]  # the choices hold no blocks on the prefill side
    dst, hits = decode.reserve_remote("r", prompt, params, seed)
    copy_blocks(prefill, prefill.held_block_ids("r")[hits:], decode, dst[hits:])
    decode.complete_remote("r", [firsts["r", i][0] for i in range(3)])
    assert prefill.release_held("r")
    rest, _ = run(decode)
    expected = [o.token_ids for o in llm.generate(prompt, params)]
    assert [rest["r", i] for i in range(3)] == expected  # the first tokens included
    assert [firsts["r", i] for i in range(3)] == [e[:1] for e in expected]
    assert decode.pool.num_free_blocks == 64 and prefill.pool.num_free_blocks == 64
