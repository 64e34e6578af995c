"""A request that offers tools and asks for a response format, as agent frameworks send it
(the OpenAI Agents SDK with an `output_type` sends both on every turn): with tool_choice
required or a named function the reply is calls (the format shapes text, and there is none);
with auto it is calls or an answer in the format, one grammar for both. Each kind of format
nests in that grammar with the language the engine compiles for it alone, and JSON formats
allow at most MAX_WHITESPACE_RUN whitespace characters in a row."""

from __future__ import annotations

import json

import httpx
import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string as accepts

from engine.structured_output import MAX_WHITESPACE_RUN, StructuredOutput
from router.tool_calls import call_text, structural_tag
from tests.router.test_openai_agents import ASK, TOOLS, WEATHER, serve

ANSWER = {
    "type": "object",
    "properties": {"sunny": {"type": "boolean"}},
    "required": ["sunny"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
PARIS = call_text("get_weather", '{"city": "Paris"}')
BOTH = [("get_weather", WEATHER), ("get_time", {"type": "object"})]


def alone(spec: StructuredOutput) -> xgr.Grammar:
    """The grammar of `spec` by itself, built with the engine's options (engine/grammar.py)."""
    match spec.kind:
        case "json":
            return xgr.Grammar.from_json_schema(spec.json, **spec.json_options())
        case "json_object":
            options = spec.json_options()
            return xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False, **options)
        case "regex":
            return xgr.Grammar.from_regex(spec.regex)
        case "choice":
            return xgr.Grammar.from_ebnf(spec.choice_ebnf())
        case "grammar":
            return xgr.Grammar.from_ebnf(spec.grammar)
    return xgr.Grammar.from_structural_tag(spec.structural_tag)


TAG = {
    "type": "structural_tag",
    "format": {"type": "tag", "begin": "<a>", "content": {"type": "any_text"}, "end": "</a>"},
}


@pytest.mark.parametrize(
    ("spec", "texts"),
    [
        ({"json": ANSWER}, {'{"sunny": true}': True, '{"sunny": 1}': False, "[]": False}),
        ({"json": ANSWER, "disable_any_whitespace": True}, {'{ "sunny": true}': False}),
        ({"json_object": True}, {'{"any": [1, 2]}': True, "[1]": False}),
        ({"regex": "[ab]+c"}, {"abac": True, "abca": False}),
        ({"choice": ["yes", "no"]}, {"no": True, "maybe": False}),
        ({"grammar": 'root ::= "x" "y"*'}, {"xyy": True, "yx": False}),
        ({"structural_tag": TAG}, {"<a>hi</a>": True, "<b>hi</b>": False}),
    ],
)
def test_a_format_nested_in_a_tag_accepts_what_it_accepts_alone(spec, texts):
    spec = StructuredOutput.of(spec)
    nested = {"type": "structural_tag", "format": spec.tag_format()}
    grammar = xgr.Grammar.from_structural_tag(json.dumps(nested))
    for text, accepted in texts.items():
        assert accepts(alone(spec), text) is accepted, text
        assert accepts(grammar, text) is accepted, text


def test_json_formats_allow_a_bounded_run_of_whitespace():
    for spec in (StructuredOutput(json=json.dumps(ANSWER)), StructuredOutput(json_object=True)):
        for grammar in (
            alone(spec),
            xgr.Grammar.from_structural_tag(
                json.dumps({"type": "structural_tag", "format": spec.tag_format()})
            ),
        ):
            assert accepts(grammar, "{" + " " * MAX_WHITESPACE_RUN + '"sunny": true}')
            assert not accepts(grammar, "{" + " " * (MAX_WHITESPACE_RUN + 1) + '"sunny": true}')
            assert accepts(grammar, '{\n  "sunny":\ttrue\n}')


def test_required_or_named_calls_with_a_format_are_calls_only(tokenizer):
    with serve(tokenizer, [PARIS]) as (client, router, _):
        reply = client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", response_format=FORMAT
        )
        required = router.calls[-1][1]
        response = client.responses.create(
            model="tiny",
            input="x",
            tools=[{"type": "function", "name": n, "parameters": p} for n, p in BOTH],
            tool_choice={"type": "function", "name": "get_weather"},
            text={"format": {"type": "json_schema", "name": "a", "schema": ANSWER}},
        )
        named = router.calls[-1][1]
    assert reply.choices[0].finish_reason == "tool_calls"
    assert [c.function.arguments for c in reply.choices[0].message.tool_calls] == [
        '{"city": "Paris"}'
    ]
    assert required["structured_output"] == {"structural_tag": structural_tag(BOTH, True)}
    assert [(i.type, i.name) for i in response.output] == [("function_call", "get_weather")]
    tag = structural_tag([("get_weather", WEATHER)], True)
    assert named["structured_output"] == {"structural_tag": tag}


@pytest.mark.parametrize("text", [PARIS, '{"sunny": false}'])
def test_auto_calls_with_a_format_are_calls_or_the_formatted_answer(tokenizer, text):
    with serve(tokenizer, [text]) as (client, router, _):
        reply = client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, response_format=FORMAT
        )
        params = router.calls[-1][1]
    otherwise = StructuredOutput.of({"json": ANSWER}).tag_format()
    tag = structural_tag(BOTH, True, otherwise)
    assert params["structured_output"] == {"structural_tag": tag}
    grammar = xgr.Grammar.from_structural_tag(json.dumps(tag))
    assert accepts(grammar, PARIS) and accepts(grammar, '{"sunny": false}')
    assert not accepts(grammar, "It is sunny.") and not accepts(grammar, '{"rain": 1}')
    assert not accepts(grammar, '{"sunny": false}' + PARIS)  # one or the other
    message = reply.choices[0].message
    if text == PARIS:
        assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
        assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    else:
        assert reply.choices[0].finish_reason == "stop" and not message.tool_calls
        assert message.content == text


def test_an_invalid_format_with_auto_calls_is_a_400_naming_the_format(tokenizer):
    bad = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "no"}}}
    with serve(tokenizer, ["x"]) as (_, router, url):
        chat = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": "tiny", "messages": ASK, "tools": TOOLS, "response_format": bad},
        )
        responses = httpx.post(
            f"{url}/v1/responses",
            json={
                "model": "tiny",
                "input": "x",
                "tools": [{"type": "function", "name": "get_time"}],
                "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "no"}}},
            },
        )
    assert chat.status_code == 400
    assert chat.json()["error"]["param"] == "response_format.json_schema.schema"
    assert responses.status_code == 400 and responses.json()["error"]["param"] == (
        "text.format.schema"
    )
    assert router.calls == []
