"""POST /v1/responses over a scripted router with the real `openai` SDK: text and function
calls as output items, the streamed events in order and assembled by the SDK into the same
response, the input items (messages, function_call, function_call_output, instructions)
rendered as the chat history they mean, text.format as the sampling constraint, and the
stateless refusals."""

from __future__ import annotations

import httpx
import pytest

from router.chat_template import ChatRenderer
from router.tool_calls import call_text, structural_tag
from tests.router.test_openai_agents import TWO_CALLS, WEATHER, serve

TOOLS = [
    {"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True},
    {"type": "function", "name": "get_time", "parameters": {"type": "object"}, "strict": False},
]


def items(response) -> list[tuple]:
    out = []
    for item in response.output:
        if item.type == "message":
            out.append(("message", item.role, [c.text for c in item.content], item.status))
        else:
            out.append(("function_call", item.name, item.arguments, item.status))
    return out


EXPECTED = [
    ("message", "assistant", ["Let me check."], "completed"),
    ("function_call", "get_weather", '{"city": "Paris"}', "completed"),
    ("function_call", "get_time", '{"tz": "CET"}', "completed"),
]


@pytest.mark.parametrize("step", [1, 4])
def test_text_and_calls_are_items_streamed_and_not(tokenizer, step):
    with serve(tokenizer, [TWO_CALLS], step) as (client, router, _):
        response = client.responses.create(model="tiny", input="Weather?", tools=TOOLS)
        with client.responses.stream(model="tiny", input="Weather?", tools=TOOLS) as stream:
            events = list(stream)
            final = stream.get_final_response()
    assert response.status == "completed" and response.object == "response"
    assert items(response) == EXPECTED
    assert [i.call_id.startswith("call_") for i in response.output[1:]] == [True, True]
    assert response.output_text == "Let me check."
    tokens = len(tokenizer.encode(TWO_CALLS))
    assert (response.usage.output_tokens, response.usage.total_tokens) == (
        tokens,
        tokens + response.usage.input_tokens,
    )
    assert items(final) == EXPECTED and final.status == "completed"
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    opened = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert opened == ["message", "function_call", "function_call"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "Let me check."
    arguments = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert arguments == ['{"city": "Paris"}', '{"tz": "CET"}']
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == '{"city": "Paris"}{"tz": "CET"}'


def test_input_items_are_the_chat_history(tokenizer):
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
        },
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    with serve(tokenizer, ["It is sunny."]) as (client, router, _):
        response = client.responses.create(
            model="tiny", instructions="Be brief.", input=history, tools=TOOLS
        )
        prompt = router.calls[-1][0]
    assert items(response) == [("message", "assistant", ["It is sunny."], "completed")]
    chat_tools = [
        {
            "type": "function",
            "function": {k: v for k, v in t.items() if k != "type"},
        }
        for t in TOOLS
    ]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    assert prompt == ChatRenderer(tokenizer).render(messages, chat_tools)


def test_format_tool_choice_and_max_output_tokens_reach_the_sampling_dict(tokenizer):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    with serve(tokenizer, ['{"ok": true}'], finish="length") as (client, router, url):
        response = client.responses.create(
            model="tiny",
            input="ok?",
            text={"format": {"type": "json_schema", "name": "r", "schema": schema}},
            max_output_tokens=9,
            temperature=0,
        )
        params = router.calls[-1][1]
        client.responses.create(
            model="tiny",
            input="call",
            tools=TOOLS,
            tool_choice={"type": "function", "name": "get_time"},
        )
        named = router.calls[-1][1]
        bad = httpx.post(
            f"{url}/v1/responses",
            json={
                "model": "tiny",
                "input": "x",
                "text": {"format": {"type": "json_schema", "name": "r", "schema": {"type": "no"}}},
            },
        )
    assert params["structured_output"] == {"json": schema}
    assert (params["max_tokens"], params["temperature"]) == (9, 0)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert named["structured_output"] == {
        "structural_tag": structural_tag([("get_time", {"type": "object"})], True)
    }
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text.format.schema"


def test_a_forced_call_is_a_function_call_item(tokenizer):
    text = call_text("get_weather", '{"city": "Oslo"}')
    with serve(tokenizer, [text]) as (client, _, _):
        response = client.responses.create(
            model="tiny", input="x", tools=TOOLS, tool_choice="required"
        )
    assert items(response) == [("function_call", "get_weather", '{"city": "Oslo"}', "completed")]


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"store": True}, "store", "stores no responses"),
        ({"previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type", "'function'"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0", None),
        ({"tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "nope"),
    ],
)
def test_stateless_and_unserved_fields_are_refused(tokenizer, extra, param, words):
    with serve(tokenizer, ["x"]) as (_, router, url):
        reply = httpx.post(f"{url}/v1/responses", json={"model": "tiny", "input": "hi", **extra})
        assert router.calls == []
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"].startswith(param)
    if words:
        assert words in error["message"]
