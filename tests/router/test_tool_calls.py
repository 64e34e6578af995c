"""The Hermes tool-call format: the parser's content and calls for whole outputs, the same
calls assembled from any split of the output into stream pieces, and the structural tag that
xgrammar compiles for tool_choice required / named (outputs it accepts and refuses)."""

from __future__ import annotations

import json
import random

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string as accepts

from router.tool_calls import (
    ArgumentsDelta,
    CallStarted,
    TextDelta,
    ToolCallParser,
    call_text,
    parse_tool_calls,
    structural_tag,
)

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
PARIS = call_text("get_weather", '{"city": "Paris", "unit": "c"}')


def calls_of(text: str, max_calls=None):
    content, calls = parse_tool_calls(text, max_calls)
    return content, [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("plain text", "plain text", []),
        ("  spaced  \n", "  spaced  \n", []),
        (PARIS, None, [("get_weather", '{"city": "Paris", "unit": "c"}')]),
        (
            "Let me check.\n" + PARIS + "\n" + call_text("noop", "{}"),
            "Let me check.",
            [("get_weather", '{"city": "Paris", "unit": "c"}'), ("noop", "{}")],
        ),
        # the arguments are the model's text, whitespace inside kept
        (
            '<tool_call>{"name":"f","arguments":{ "a" : [1,2] }  }\n</tool_call>',
            None,
            [("f", '{ "a" : [1,2] }')],
        ),
        # a block whose header is not a call's is text, also what follows it
        ("<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),
        ('<tool_call>{"name": 3}</tool_call>', '<tool_call>{"name": 3}</tool_call>', []),
        # cut by max_tokens: the call keeps the arguments written so far
        ('<tool_call>\n{"name": "f", "arguments": {"a": 1', None, [("f", '{"a": 1')]),
        ('<tool_call>\n{"name": "f", "argu', '<tool_call>\n{"name": "f", "argu', []),
        ("half a tag <tool", "half a tag <tool", []),
        ('<tool_call>\n{"name": "f\\"q", "arguments": {}}\n</tool_call>', None, [('f"q', "{}")]),
    ],
)
def test_whole_outputs(text, content, calls):
    assert calls_of(text) == (content, calls)


def test_parallel_false_keeps_the_first_call_only():
    text = PARIS + "\n" + call_text("noop", "{}") + " and more"
    assert calls_of(text, max_calls=1) == (
        None,
        [("get_weather", '{"city": "Paris", "unit": "c"}')],
    )


def assemble(pieces: list[str]) -> tuple[str | None, list[tuple[str, str]], list]:
    parser = ToolCallParser()
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    text, calls = "", []
    for e in events:
        if isinstance(e, TextDelta):
            text += e.text
        elif isinstance(e, CallStarted):
            assert e.index == len(calls) and e.id.startswith("call_") and len(e.id) == 29
            calls.append([e.name, ""])
        else:
            assert isinstance(e, ArgumentsDelta)
            calls[e.index][1] += e.text
    return (text or None) if calls else text, [tuple(c) for c in calls], events


PIECES = [
    "Sure. ",
    PARIS,
    "\n",
    call_text("noop", "{}"),
    " trailing",
    "<tool_call>garbage</tool_call>",
    "<tool",
    "  \n",
    '<tool_call>\n{"name": "g", "arguments": {"a": "}}"}  }  \n</tool_call>',
    '<tool_call>{"name": "h", "arguments": {"z": 1}',
]


def test_any_split_of_a_stream_assembles_into_the_whole_outputs_calls():
    rng = random.Random(7)
    for _ in range(1500):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 5)))
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 10))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        content, calls, _ = assemble(pieces)
        assert (content, calls) == calls_of(text), (text, pieces)


def test_arguments_stream_as_they_arrive_and_the_name_comes_first():
    pieces = ['<tool_call>\n{"name": "get_', 'weather", "arguments": {"ci', 'ty": "Pa', 'ris"}']
    pieces += ["}\n</", "tool_call>"]
    _, calls, events = assemble(pieces)
    assert calls == [("get_weather", '{"city": "Paris"}')]
    kinds = [(type(e).__name__, getattr(e, "text", getattr(e, "name", None))) for e in events]
    assert kinds == [
        ("CallStarted", "get_weather"),
        ("ArgumentsDelta", '{"ci'),
        ("ArgumentsDelta", 'ty": "Pa'),
        ("ArgumentsDelta", 'ris"'),  # a last `}` waits: it may be the call object's own
        ("ArgumentsDelta", "}"),  # the next `}` shows it was the arguments'
    ]


@pytest.mark.parametrize("parallel", [True, False])
def test_structural_tag_accepts_only_schema_valid_calls(parallel):
    tag = structural_tag([("get_weather", WEATHER), ("noop", None)], parallel)
    grammar = xgr.Grammar.from_structural_tag(json.dumps(tag))
    two = PARIS + "\n" + call_text("noop", '{"x": 1}')
    assert accepts(grammar, PARIS)
    assert accepts(grammar, two) is parallel
    assert not accepts(grammar, "")  # at least one call
    assert not accepts(grammar, "I will call it. " + PARIS)  # nothing but calls
    assert not accepts(grammar, PARIS.replace('"c"', '"kelvin"'))  # enum of the schema
    assert not accepts(grammar, call_text("get_weather", '{"city": "Paris"}'))  # required unit
    assert not accepts(grammar, call_text("other", "{}"))  # only the tools named
    for text in (PARIS, two):
        if accepts(grammar, text):
            assert calls_of(text)[0] is None  # what the grammar lets out parses as calls only
