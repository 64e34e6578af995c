"""The OpenAI door's agent features over a scripted router (known output texts through the
real tokenizer), with the real `openai` SDK: tool calls parsed, streamed as delta.tool_calls
that the SDK's stream helper assembles into the non-streamed message; tools rendered and
required calls sent as a structural tag; n choices by index; chat and legacy logprobs;
completions echo and batched prompts; refusals naming every bad field."""

from __future__ import annotations

import json
from contextlib import contextmanager

import httpx
import openai
import pytest

from router.chat_template import ChatRenderer
from router.openai_http import create_app
from router.tool_calls import call_text, structural_tag
from tests.router.scripted import ScriptedRouter
from tests.router.serving import http_serving

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
TWO_CALLS = (
    "Let me check.\n"
    + call_text("get_weather", '{"city": "Paris"}')
    + "\n"
    + call_text("get_time", '{"tz": "CET"}')
)


@contextmanager
def serve(tokenizer, texts: list[str], step: int = 2, finish: str = "stop"):
    router = ScriptedRouter(tokenizer, texts, step, finish)
    with http_serving(create_app(router, ["tiny"], tokenizer=tokenizer)) as (url, _):
        with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
            yield client, router, url


def calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


@pytest.mark.parametrize("step", [1, 3])
def test_tool_calls_streamed_assemble_into_the_non_streamed_message(tokenizer, step):
    with serve(tokenizer, [TWO_CALLS], step) as (client, _, _):
        reply = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS)
        with client.chat.completions.stream(model="tiny", messages=ASK, tools=TOOLS) as stream:
            chunks = [e.chunk for e in stream if e.type == "chunk"]
            streamed = stream.get_final_completion()
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    assert calls(choice.message) == [
        ("get_weather", '{"city": "Paris"}'),
        ("get_time", '{"tz": "CET"}'),
    ]
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)
    assert streamed.choices[0].finish_reason == "tool_calls"
    assert streamed.choices[0].message.content == "Let me check."
    assert calls(streamed.choices[0].message) == calls(choice.message)
    # each call opens with its id and name (arguments ""), then only argument fragments
    firsts = {}
    for chunk in chunks:
        for d in chunk.choices[0].delta.tool_calls or []:
            if d.index not in firsts:
                firsts[d.index] = d
                assert d.id.startswith("call_") and d.function.name and d.function.arguments == ""
            else:
                assert d.id is None and d.function.name is None
    assert sorted(firsts) == [0, 1]


def test_tool_choice_none_keeps_text_and_parallel_false_keeps_one_call(tokenizer):
    with serve(tokenizer, [TWO_CALLS]) as (client, _, _):
        plain = client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice="none"
        )
        one = client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, parallel_tool_calls=False
        )
        untooled = client.chat.completions.create(model="tiny", messages=ASK)
    assert plain.choices[0].message.content == TWO_CALLS and not plain.choices[0].message.tool_calls
    assert untooled.choices[0].message.content == TWO_CALLS
    assert calls(one.choices[0].message) == [("get_weather", '{"city": "Paris"}')]


def test_required_and_named_calls_are_a_structural_tag_and_tools_are_rendered(tokenizer):
    text = call_text("get_weather", '{"city": "Paris"}')
    with serve(tokenizer, [text]) as (client, router, _):
        reply = client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice="required"
        )
        prompt, params = router.calls[-1]
        client.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            parallel_tool_calls=False,
        )
        _, named = router.calls[-1]
    assert reply.choices[0].message.content is None
    assert calls(reply.choices[0].message) == [("get_weather", '{"city": "Paris"}')]
    both = [("get_weather", WEATHER), ("get_time", {"type": "object"})]
    assert params["structured_output"] == {"structural_tag": structural_tag(both, True)}
    tag = structural_tag([("get_weather", WEATHER)], False)
    assert named["structured_output"] == {"structural_tag": tag}
    assert prompt == ChatRenderer(tokenizer).render(ASK, TOOLS)


def test_n_choices_by_index_streamed_and_not_with_usage_of_all(tokenizer):
    texts = ["red", "green and blue"]
    tokens = sum(len(tokenizer.encode(t)) for t in texts)
    with serve(tokenizer, texts) as (client, router, _):
        reply = client.chat.completions.create(model="tiny", messages=ASK, n=2, seed=7)
        assert router.calls[-1][1]["n"] == 2 and router.calls[-1][1]["seed"] == 7
        chunks = list(
            client.chat.completions.create(
                model="tiny", messages=ASK, n=2, stream=True, stream_options={"include_usage": True}
            )
        )
    assert [c.message.content for c in reply.choices] == texts
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.usage.completion_tokens == tokens
    got = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        for c in chunk.choices:
            got[c.index] += c.delta.content or ""
    assert [got[0], got[1]] == texts
    assert chunks[-1].usage.completion_tokens == tokens


def test_chat_logprobs_streamed_and_not(tokenizer):
    text = "hello world"
    ids = tokenizer.encode(text)
    with serve(tokenizer, [text]) as (client, router, _):
        reply = client.chat.completions.create(
            model="tiny", messages=ASK, logprobs=True, top_logprobs=2
        )
        assert router.calls[-1][1]["logprobs"] == 2
        chunks = list(
            client.chat.completions.create(
                model="tiny", messages=ASK, logprobs=True, top_logprobs=2, stream=True
            )
        )
    content = reply.choices[0].logprobs.content
    assert [c.token for c in content] == [tokenizer.decode([i]) for i in ids]
    assert [bytes(c.bytes).decode() for c in content] == [tokenizer.decode([i]) for i in ids]
    assert [c.logprob for c in content] == [-0.25] * len(ids)
    first = content[0].top_logprobs
    assert [(t.token, t.logprob) for t in first] == [
        (tokenizer.decode([ids[0]]), -0.25),
        (tokenizer.decode([ids[0] + 1]), -2.0),
    ]
    streamed = [
        c
        for ch in chunks
        for choice in ch.choices
        if choice.logprobs
        for c in choice.logprobs.content
    ]
    assert [c.model_dump() for c in streamed] == [c.model_dump() for c in content]


def test_completion_echo_with_prompt_logprobs_and_echo_only(tokenizer):
    prompt, generated = "the city", " is Paris"
    p_ids, g_ids = tokenizer.encode(prompt), tokenizer.encode(generated)
    with serve(tokenizer, [generated]) as (client, router, _):
        reply = client.completions.create(model="tiny", prompt=prompt, echo=True, logprobs=1)
        assert router.calls[-1][1]["prompt_logprobs"] == 1
        only = client.completions.create(model="tiny", prompt=prompt, echo=True, max_tokens=0)
        assert router.calls[-1][1]["max_tokens"] == 1
        plain = client.completions.create(model="tiny", prompt=prompt, echo=True)
    choice = reply.choices[0]
    assert choice.text == prompt + generated
    tokens = [tokenizer.decode([i]) for i in p_ids + g_ids]
    lp = choice.logprobs
    assert lp.tokens == tokens
    assert lp.token_logprobs == [None] + [-0.25] * (len(tokens) - 1)
    assert lp.top_logprobs[0] is None
    assert lp.top_logprobs[1] == {tokens[1]: -0.25}
    offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert lp.text_offset == offsets
    assert only.choices[0].text == prompt and only.usage.completion_tokens == 0
    assert plain.choices[0].text == prompt + generated and plain.choices[0].logprobs is None


def test_batched_prompts_are_requests_of_their_own_with_choices_by_prompt(tokenizer):
    texts = ["red", "blue"]
    with serve(tokenizer, texts) as (client, router, _):
        reply = client.completions.create(model="tiny", prompt=["one", "two two"], n=2)
        prompts = sorted(p for p, _ in router.calls[-2:])
        chunks = list(
            client.completions.create(model="tiny", prompt=[[5, 6], [7, 8, 9]], stream=True)
        )
    assert prompts == sorted([tokenizer.encode("one"), tokenizer.encode("two two")])
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert [c.text for c in reply.choices] == texts * 2
    assert reply.usage.prompt_tokens == len(tokenizer.encode("one")) + len(
        tokenizer.encode("two two")
    )
    assert reply.usage.completion_tokens == 2 * sum(len(tokenizer.encode(t)) for t in texts)
    by_index: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            by_index[c.index] = by_index.get(c.index, "") + c.text
    assert by_index == {0: "red", 1: "red"}


def test_continuous_usage_on_every_chunk(tokenizer):
    text = "one two three four"
    with serve(tokenizer, [text], step=1) as (client, _, _):
        chunks = list(
            client.completions.create(
                model="tiny",
                prompt="count",
                stream=True,
                stream_options={"include_usage": True, "continuous_usage_stats": True},
            )
        )
    running = [c.usage.completion_tokens for c in chunks[:-1]]
    assert running == list(range(1, len(tokenizer.encode(text)) + 1))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == running[-1]


def test_structured_output_fields_become_the_sampling_constraint(tokenizer):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    with serve(tokenizer, ['{"ok": true}']) as (client, router, url):
        client.chat.completions.create(
            model="tiny",
            messages=ASK,
            response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
            extra_body={"structured_outputs": {"disable_any_whitespace": True}},
        )
        assert router.calls[-1][1]["structured_output"] == {
            "json": schema,
            "disable_any_whitespace": True,
        }
        client.completions.create(
            model="tiny", prompt="x", extra_body={"structured_outputs": {"choice": ["a", "b"]}}
        )
        assert router.calls[-1][1]["structured_output"] == {"choice": ["a", "b"]}
        bad = {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "nope"}}}
        reply = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": "tiny", "messages": ASK, "response_format": bad},
        )
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "response_format.json_schema.schema"
    assert "invalid JSON schema" in error["message"]


def test_a_refusal_names_every_refused_and_invalid_field(tokenizer):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
        "temperature": -1,
        "store": True,
        "functions": [],
        "tool_choice": "required",
    }
    with serve(tokenizer, ["x"]) as (_, router, url):
        reply = httpx.post(f"{url}/v1/chat/completions", json=body)
        # once every field is valid, the cross-field checks: a required call needs a tool
        required = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": "tiny", "messages": ASK, "tool_choice": "required", "user": "u1"},
        )
        assert router.calls == []
    assert required.status_code == 400 and required.json()["error"]["param"] == "tool_choice"
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "messages.0.content.0.type"
    assert error["message"] == (
        "4 fields refused: field 'messages.0.content.0.type'='image_url' is invalid: Input "
        "should be 'text'; field 'temperature'=-1 is invalid: Input should be greater than or "
        "equal to 0; field 'store'=True is invalid: store=true is not served: this server "
        "keeps no completions; unsupported field 'functions': this server does not take it; "
        "use tools"
    )


def test_history_with_tool_calls_and_results_is_accepted(tokenizer):
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]},
    ]
    with serve(tokenizer, ["It is sunny."]) as (client, router, _):
        reply = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS)
        prompt = router.calls[-1][0]
    assert reply.choices[0].message.content == "It is sunny."
    assert reply.choices[0].finish_reason == "stop"
    rendered = [
        {**m, "content": "sunny"} if m["role"] == "tool" else {**m, "content": m["content"] or ""}
        for m in history
    ]
    assert prompt == ChatRenderer(tokenizer).render(rendered, TOOLS)


def test_fields_that_do_not_change_the_output_are_accepted_and_change_nothing(tokenizer):
    bare = {"model": "tiny", "messages": ASK, "temperature": 0}
    noop = {
        **bare,
        "user": "u1",
        "metadata": {"k": "v"},
        "store": False,
        "service_tier": "auto",
        "prompt_cache_key": "conversation-7",
        "safety_identifier": "h",
        "response_format": {"type": "text"},
        "stream_options": {"include_obfuscation": False},
        "modalities": ["text"],
        "prediction": {"type": "content", "content": "x"},
        "reasoning_effort": None,
    }
    with serve(tokenizer, ["x"]) as (_, router, url):
        for body in (bare, noop):
            reply = httpx.post(f"{url}/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
    assert router.calls[0] == router.calls[1]
