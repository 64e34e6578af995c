"""EngineLoop: concurrent submitters get exactly their streams; failures never hang."""

from __future__ import annotations

import threading

import pytest

from engine import LLM, InvalidRequestError, LLMEngine, SamplingParams
from engine.engine_loop import EngineLoop
from tests.helpers import random_prompts

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_threads_submit_concurrently_and_get_their_own_tokens(tiny_llama):
    prompts = random_prompts([7, 19, 4, 30, 12, 9], seed=51)
    expected = [
        o.token_ids for o in LLM(tiny_llama, skip_tokenizer_init=True).generate(prompts, GREEDY)
    ]
    loop = EngineLoop(
        LLMEngine(tiny_llama, skip_tokenizer_init=True, block_size=4, num_kv_blocks=128)
    ).start()
    got: dict[int, list[int]] = {}

    def client(i: int) -> None:
        stream = loop.submit(f"r{i}", prompts[i], GREEDY)
        got[i] = [t for out in stream for t in out.new_token_ids]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [got[i] for i in range(len(prompts))] == expected
    loop.run(loop.engine.check_integrity)
    loop.stop()


def test_bad_request_raises_to_caller_and_loop_keeps_serving(tiny_llama):
    loop = EngineLoop(LLMEngine(tiny_llama, skip_tokenizer_init=True)).start()
    with pytest.raises(InvalidRequestError, match="empty"):
        loop.submit("bad", [], GREEDY)
    outs = list(loop.submit("good", [5, 6, 7], GREEDY))
    assert outs[-1].finish_reason == "length"
    assert sum(len(o.new_token_ids) for o in outs) == 6
    loop.stop()


def test_step_failure_fails_streams_instead_of_hanging(tiny_llama, monkeypatch):
    engine = LLMEngine(tiny_llama, skip_tokenizer_init=True, block_size=4, num_kv_blocks=64)
    loop = EngineLoop(engine).start()

    def broken(rows):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "execute", broken)
    out = loop.submit("x", [5, 6, 7], GREEDY).get(timeout=10)
    assert (out.finished, out.finish_reason) == (True, "error")
    assert "device lost" in out.error
    loop.run(engine.check_integrity)
    assert engine.pool.num_free_blocks == 64
    loop.stop()
