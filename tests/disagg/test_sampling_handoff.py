"""The sampling features across a real prefill -> decode hand-off (in-process workers, gloo
pair group): n choices, logprobs, prompt logprobs, penalties and a JSON schema give the
colocated engine's tokens and values; the worker dicts carry index, logprobs and
prompt_logprobs as plain lists."""

from __future__ import annotations

import json

import jsonschema
import pytest

from decode_worker.worker import DecodeWorker
from engine import LLM, SamplingParams
from prefill_worker.worker import PrefillWorker
from router.handoff import generate_disaggregated
from tests.engine.test_structured_output import JSON, PROMPT, SCHEMA

NUM_BLOCKS = 128


@pytest.fixture(scope="module")
def pair(tiny_llama_tok):
    options = dict(
        model=tiny_llama_tok, block_size=4, num_kv_blocks=NUM_BLOCKS, chunk_size=16, hash_seed="t"
    )
    prefill, decode = PrefillWorker("p0", options), DecodeWorker("d0", options)
    decode.connect_prefill("p0", prefill.connect_decode("d0", decode), prefill)
    yield options, prefill, decode
    prefill.shutdown()
    decode.shutdown()


def by_choice(outs: list[dict]) -> dict[int, dict]:
    """Per index: its tokens, logprobs and finish_reason; prompt logprobs of its first."""
    choices: dict[int, dict] = {}
    for out in outs:
        c = choices.setdefault(
            out["index"],
            {"tokens": [], "logprobs": [], "reason": None, "prompt": out["prompt_logprobs"]},
        )
        c["tokens"] += out["token_ids"]
        c["logprobs"] += out["logprobs"] or []
        c["reason"] = c["reason"] or out["finish_reason"]
    return choices


@pytest.mark.parametrize(
    "params",
    [
        dict(max_tokens=6, temperature=1.0, seed=5, n=3, logprobs=2, prompt_logprobs=1),
        dict(
            max_tokens=8,
            temperature=0.0,
            repetition_penalty=1.5,
            frequency_penalty=0.5,
            presence_penalty=0.5,
            logit_bias={"40": 2.0},
            min_tokens=4,
            logprobs=0,
        ),
        dict(max_tokens=60, temperature=1.0, seed=7, n=2, structured_output=JSON),
    ],
    ids=["n-logprobs", "penalties", "json-n"],
)
def test_handoff_equals_colocated(pair, params):
    options, prefill, decode = pair
    expected = LLM(**options).generate(PROMPT, SamplingParams(**params))
    outs = list(
        generate_disaggregated(
            prefill, decode, "r", PROMPT, params, prefill_id="p0", decode_id="d0"
        )
    )
    assert outs[-1]["finished"] and not any(o["finished"] for o in outs[:-1])
    got = by_choice(outs)
    assert sorted(got) == list(range(params.get("n", 1)))
    for exp in expected:
        choice = got[exp.index]
        assert choice["tokens"] == exp.token_ids
        assert choice["reason"] == exp.finish_reason
        if exp.logprobs:
            assert [lp[0] for lp in choice["logprobs"]] == exp.token_ids
            for lp, ref in zip(choice["logprobs"], exp.logprobs, strict=True):
                assert lp[1] == pytest.approx(ref.logprob, abs=1e-5)
                assert [t for t, _ in lp[2]] == [t for t, _ in ref.top]
        if exp.prompt_logprobs is not None:
            prompt = choice["prompt"]
            assert prompt[0] is None and len(prompt) == len(PROMPT)
            for lp, ref in zip(prompt[1:], exp.prompt_logprobs[1:], strict=True):
                assert lp[0] == ref.token_id and lp[1] == pytest.approx(ref.logprob, abs=1e-5)
        elif exp.index == 0:
            assert choice["prompt"] is None
        if "structured_output" in params:
            jsonschema.validate(json.loads(exp.text), SCHEMA)
            assert "".join(o["text"] for o in outs if o["index"] == exp.index) == exp.text
    prefill.check_integrity()
    decode.check_integrity()
