"""What agents and eval harnesses send, end to end: the real `openai` SDK against the HTTP
door over real prefill and decode workers on the tiny Llama with its tokenizer. The grammar
engine makes `chat.completions.parse` return the pydantic model and tool_choice=required
return calls valid for the function's schema; logprobs equal the offline engine's; echo
returns the prompt's logprobs; n=2 returns two choices; the Responses API answers as chat
does."""

from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Literal

import jsonschema
import openai
import pytest
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel

from decode_worker.worker import DecodeWorker
from engine import LLM, SamplingParams
from prefill_worker.worker import PrefillWorker
from router.chat_template import ChatRenderer
from router.openai_http import create_app
from router.router import Router
from tests.router.serving import http_serving

MAX_LEN = 1024
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Pick(BaseModel):
    color: Literal["red", "green", "blue"]
    ok: bool


@pytest.fixture(scope="module")
def options(tiny_llama_tok) -> dict:
    return dict(
        model=tiny_llama_tok,
        block_size=4,
        num_kv_blocks=512,
        chunk_size=16,
        max_model_len=MAX_LEN,
    )


@pytest.fixture(scope="module")
def offline(options):
    return LLM(**options)


@contextmanager
def serving(router, tokenizer):
    app = create_app(router, ["tiny"], tokenizer=tokenizer)
    with http_serving(app) as (url, _):
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120) as c:
            yield c


@pytest.fixture(scope="module")
def client(options, tokenizer):
    """A disaggregated pair: prefill worker p0, decode worker d0."""
    p, d = PrefillWorker("p0", options), DecodeWorker("d0", options)
    d.connect_prefill("p0", p.connect_decode("d0", d), p)
    router = Router({"p0": p}, {"d0": d}, block_size=4, hash_seed="baton", max_model_len=MAX_LEN)
    try:
        with serving(router, tokenizer) as c:
            yield c
    finally:
        p.shutdown()
        d.shutdown()


@pytest.fixture(scope="module")
def aggregated_client(options, tokenizer):
    """One decode worker that prefills too."""
    d = DecodeWorker("d1", options)
    router = Router(
        {}, {"d1": d}, block_size=4, hash_seed="baton", max_model_len=MAX_LEN, aggregated=True
    )
    try:
        with serving(router, tokenizer) as c:
            yield c
    finally:
        d.shutdown()


def offline_text(offline, tokenizer, messages, tools=None, **sampling) -> tuple[str, list]:
    ids = ChatRenderer(tokenizer).render(messages, tools)
    out = offline.generate([ids], SamplingParams(temperature=0.0, **sampling))[0]
    return out.text, out


def test_parse_returns_the_pydantic_model_the_grammar_enforced(client, offline, tokenizer):
    # compact JSON: a random model left any whitespace would write only spaces
    compact = {"structured_outputs": {"disable_any_whitespace": True}}
    reply = client.chat.completions.parse(
        model="tiny",
        messages=ASK,
        response_format=Pick,
        temperature=0,
        max_completion_tokens=60,
        extra_body=compact,
    )
    message = reply.choices[0].message
    assert isinstance(message.parsed, Pick)
    assert Pick.model_validate_json(message.content) == message.parsed
    expected, _ = offline_text(
        offline,
        tokenizer,
        ASK,
        max_tokens=60,
        structured_output={"json": to_strict_json_schema(Pick), "disable_any_whitespace": True},
    )
    assert message.content == expected


def test_required_tool_calls_validate_against_the_schema_streamed_and_not(client):
    kwargs = dict(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_completion_tokens=300,
    )
    reply = client.chat.completions.create(**kwargs)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    with client.chat.completions.stream(**kwargs) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (call.function.name, call.function.arguments)
    ]


@pytest.mark.parametrize("mode", ["aggregated", "disaggregated"])
def test_chat_logprobs_are_the_offline_engines(mode, request, offline, tokenizer):
    client = request.getfixturevalue("client" if mode == "disaggregated" else "aggregated_client")
    reply = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        temperature=0,
        max_completion_tokens=6,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    _, out = offline_text(offline, tokenizer, ASK, max_tokens=6, logprobs=3, ignore_eos=True)
    same_logprobs(reply.choices[0].logprobs.content, out, tokenizer)


def same_logprobs(content, out, tokenizer) -> None:
    """A greedy chat reply's logprobs.content equals the offline engine output's logprobs
    (tokens as text, values within 1e-4)."""
    assert [c.token for c in content] == [tokenizer.decode([t]) for t in out.token_ids]
    expected = [lp.to_wire() for lp in out.logprobs]
    for got, (_, logprob, top) in zip(content, expected, strict=True):
        assert got.logprob == pytest.approx(logprob, abs=1e-4)
        assert [t.token for t in got.top_logprobs] == [tokenizer.decode([i]) for i, _ in top]
        assert [t.logprob for t in got.top_logprobs] == pytest.approx(
            [lp for _, lp in top], abs=1e-4
        )
        assert got.top_logprobs[0].logprob >= got.logprob  # greedy took the best


def test_completion_echo_returns_the_prompts_logprobs_first(client, offline, tokenizer):
    prompt = "the quick brown fox"
    reply = client.completions.create(
        model="tiny", prompt=prompt, echo=True, logprobs=2, max_tokens=3, temperature=0
    )
    ids = tokenizer.encode(prompt)
    choice = reply.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    assert lp.tokens[: len(ids)] == [tokenizer.decode([i]) for i in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.tokens) == len(ids) + reply.usage.completion_tokens
    out = offline.generate([ids], SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2))
    expected = [e.to_wire()[1] for e in out[0].prompt_logprobs[1:]]
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(expected, abs=1e-4)


def test_n_two_choices_are_the_offline_engines_with_usage_of_both(client, offline, tokenizer):
    request = dict(model="tiny", messages=ASK, n=2, seed=11, temperature=1.0)
    request["max_completion_tokens"] = 5
    extra = {"ignore_eos": True, "return_token_ids": True}
    reply = client.chat.completions.create(**request, extra_body=extra)
    ids = ChatRenderer(tokenizer).render(ASK)
    sampling = SamplingParams(n=2, seed=11, temperature=1.0, max_tokens=5, ignore_eos=True)
    expected = offline.generate([ids], sampling)
    assert [c.index for c in reply.choices] == [0, 1]
    assert [c.token_ids for c in reply.choices] == [o.token_ids for o in expected]
    assert [c.message.content for c in reply.choices] == [o.text for o in expected]
    assert expected[0].token_ids != expected[1].token_ids  # two draws, not one twice
    assert all(c.finish_reason == "length" for c in reply.choices)
    assert reply.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(**request, stream=True, extra_body=extra))
    got = {0: "", 1: ""}
    for chunk in chunks:
        for c in chunk.choices:
            got[c.index] += c.delta.content or ""
    assert [got[0], got[1]] == [o.text for o in expected]


def test_responses_create_and_stream_answer_as_chat(client):
    chat = client.chat.completions.create(
        model="tiny", messages=ASK, temperature=0, max_completion_tokens=8
    )
    response = client.responses.create(
        model="tiny", input=ASK[0]["content"], temperature=0, max_output_tokens=8
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.status == (
        "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    )
    with client.responses.stream(
        model="tiny", input=ASK[0]["content"], temperature=0, max_output_tokens=8
    ) as stream:
        last = list(stream)[-1]  # response.incomplete after max_output_tokens, as OpenAI's
    assert last.type == f"response.{response.status}"
    assert last.response.output_text == response.output_text
    assert last.response.usage.output_tokens == chat.usage.completion_tokens


def test_an_invalid_regex_is_a_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(
            model="tiny", prompt="x", extra_body={"structured_outputs": {"regex": "(unclosed"}}
        )
    assert err.value.body["param"] == "structured_outputs.regex"
    assert "regex" in err.value.body["message"]
