"""Tool calls in the Hermes format: the grammar that enforces them and the parser that finds
them in a model's output, streamed or whole.

A call is written `<tool_call>\\n{"name": "NAME", "arguments": {...}}\\n</tool_call>` (the
format of the Hermes, Qwen2.5/Qwen3 and SmolLM3 templates and of router/chat_template.py's
default). The parser commits to a call once its header `{"name": "...", "arguments": ` is
complete and streams the arguments as they arrive; a block whose header does not parse stays
text. The arguments of a call are the exact text the model wrote between the header and the
object's closing `}`; the non-streamed reply runs the same parser over the whole text, so a
streamed reply assembles into exactly the calls of the non-streamed one.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

BEGIN = "<tool_call>"
END = "</tool_call>"
# The text between two parallel calls, and the one way the grammar lets a call be written.
SEPARATOR = "\n"
# Most consecutive whitespace characters inside enforced arguments: room for indentation,
# none for the endless whitespace a weak model can fall into when the grammar allows it.
MAX_WHITESPACE = 8
_HEADER = ("{", '"name"', ":", None, ",", '"arguments"', ":")  # None: the name's JSON string
_WHITESPACE = " \t\n\r"


def call_text(name: str, arguments: str) -> str:
    """One call as the model writes it (the history's earlier calls are rendered so)."""
    return f'{BEGIN}\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n{END}'


def structural_tag(
    functions: list[tuple[str, dict | None]], parallel: bool, otherwise: dict | None = None
) -> dict:
    """The xgrammar structural tag for tool_choice `required` (or one named function): the
    output is one call (parallel=False) or several separated by a newline, each to one of
    `functions` ((name, parameters JSON schema)) with arguments valid for its schema, and
    nothing else (at most MAX_WHITESPACE whitespace characters in a row).

    otherwise: a structural-tag format the output may match instead of the calls
    (tool_choice `auto` with a response format: calls, or the formatted answer)."""
    tags = [
        {
            "type": "tag",
            "begin": f'{BEGIN}\n{{"name": {json.dumps(name)}, "arguments": ',
            "content": {
                "type": "json_schema",
                "json_schema": parameters or {"type": "object"},
                "max_whitespace_cnt": MAX_WHITESPACE,
            },
            "end": f"}}\n{END}",
        }
        for name, parameters in functions
    ]
    calls = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": SEPARATOR,
        "at_least_one": True,
        "stop_after_first": not parallel,
    }
    if otherwise is not None:
        calls = {"type": "or", "elements": [calls, otherwise]}
    return {"type": "structural_tag", "format": calls}


@dataclass(frozen=True, slots=True)
class TextDelta:
    """Text outside any call."""

    text: str


@dataclass(frozen=True, slots=True)
class CallStarted:
    """A call's header is complete: its index among the calls, a new id and the name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ArgumentsDelta:
    """More of call `index`'s arguments text."""

    index: int
    text: str


Event = TextDelta | CallStarted | ArgumentsDelta


@dataclass(slots=True)
class ToolCall:
    """One parsed call (arguments: the JSON text as the model wrote it)."""

    id: str
    name: str
    arguments: str = ""

    def as_dict(self) -> dict:
        """Chat completions' `message.tool_calls` item."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ToolCallParser:
    """Splits a model's output, fed in pieces, into text and calls (events as they become
    certain). max_calls=1 (parallel_tool_calls false): text after the first call is dropped.

    Invariants: text is never emitted while it could still begin a call (a partial `<tool_call>`
    and trailing whitespace are held back); arguments text emitted is always a prefix of the
    call's final arguments (the closing `}`, whitespace and a partial `</tool_call>` are held
    back until they are certain)."""

    max_calls: int | None = None
    calls: list[ToolCall] = field(default_factory=list)
    content: str = ""  # all text emitted so far
    _mode: str = "text"  # text | header | arguments | done
    _buffer: str = ""  # text of the current mode not emitted yet
    _held_space: str = ""  # whitespace held back in text mode
    _sent: int = 0  # arguments characters of the open call emitted

    def feed(self, text: str) -> list[Event]:
        """Take the next piece of output; the events it makes certain."""
        if self._mode == "done":
            return []
        self._buffer += text
        events: list[Event] = []
        while True:
            before = (self._mode, len(self._buffer))
            if self._mode == "text":
                self._text(events, final=False)
            elif self._mode == "header":
                self._header(events, final=False)
            elif self._mode == "arguments":
                self._arguments(events, final=False)
            if self._mode == "done" or (self._mode, len(self._buffer)) == before:
                return events

    def finish(self) -> list[Event]:
        """The output ended: flush what was held back (an unfinished call keeps the
        arguments written so far)."""
        events: list[Event] = []
        if self._mode == "header":
            self._header(events, final=True)
        if self._mode == "arguments":
            self._arguments(events, final=True)
        if self._mode == "text":
            self._text(events, final=True)
        self._mode = "done"
        return events

    def _emit_text(self, events: list[Event], text: str) -> None:
        if text:
            self.content += text
            events.append(TextDelta(text))

    def _text(self, events: list[Event], final: bool) -> None:
        start = self._buffer.find(BEGIN)
        if start >= 0:
            self._take_text(events, self._buffer[:start])
            self._buffer = self._buffer[start + len(BEGIN) :]
            self._mode = "header"
            return
        if final:
            # whitespace around calls is not content; without calls it is the model's text
            self._emit_text(events, ("" if self.calls else self._held_space) + self._buffer)
            self._buffer = self._held_space = ""
            return
        keep = _partial_suffix(self._buffer, BEGIN)
        self._take_text(events, self._buffer[: len(self._buffer) - keep])
        self._buffer = self._buffer[len(self._buffer) - keep :]

    def _take_text(self, events: list[Event], text: str) -> None:
        """Emit `text` but for its trailing whitespace, which is held back."""
        body = text.rstrip(_WHITESPACE)
        if body:
            self._emit_text(events, self._held_space + body)
            self._held_space = ""
        self._held_space += text[len(body) :]

    def _header(self, events: list[Event], final: bool) -> None:
        state, name, end = _scan_header(self._buffer)
        if state == "ok":
            call = ToolCall(new_call_id(), name)
            self.calls.append(call)
            events.append(CallStarted(len(self.calls) - 1, call.id, call.name))
            self._buffer = self._buffer[end:]
            self._held_space = ""  # the whitespace before a call is not content
            self._sent = 0
            self._mode = "arguments"
        elif state == "fail" or final:
            # not a call: the tag is text, and what follows is read as text again
            self._emit_text(events, self._held_space + BEGIN)
            self._held_space = ""
            self._mode = "text"

    def _arguments(self, events: list[Event], final: bool) -> None:
        end = self._buffer.find(END)
        cut = end if end >= 0 else len(self._buffer) - _partial_suffix(self._buffer, END)
        arguments = _close(self._buffer[:cut])
        call = self.calls[-1]
        if len(arguments) > self._sent:
            events.append(ArgumentsDelta(len(self.calls) - 1, arguments[self._sent :]))
            call.arguments = arguments
            self._sent = len(arguments)
        if end >= 0 or final:
            self._buffer = self._buffer[end + len(END) :] if end >= 0 else ""
            full = self.max_calls is not None and len(self.calls) >= self.max_calls
            self._mode = "done" if full else "text"


def _close(text: str) -> str:
    """The arguments in `text` (what follows the header): without the trailing whitespace,
    the call object's closing `}` and the whitespace before it."""
    text = text.rstrip(_WHITESPACE)
    if text.endswith("}"):
        text = text[:-1].rstrip(_WHITESPACE)
    return text


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _scan_header(text: str) -> tuple[str, str, int]:
    """("ok", name, index where the arguments start), ("fail", "", 0) when `text` cannot be a
    call's header, ("need", "", 0) when it may become one."""
    i = 0
    name = ""
    for part in _HEADER:
        i = _skip_space(text, i)
        if i == len(text):
            return "need", "", 0
        if part is None:
            if text[i] != '"':
                return "fail", "", 0
            j = i + 1
            while j < len(text) and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            if j >= len(text):
                return "need", "", 0
            try:
                name = json.loads(text[i : j + 1])
            except json.JSONDecodeError:
                return "fail", "", 0
            i = j + 1
            continue
        n = min(len(part), len(text) - i)
        if text[i : i + n] != part[:n]:
            return "fail", "", 0
        if n < len(part):
            return "need", "", 0
        i += n
    i = _skip_space(text, i)
    return ("ok", name, i) if i < len(text) else ("need", "", 0)


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def parse_tool_calls(text: str, max_calls: int | None = None) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output: the streaming parser run over it at once
    (content None when there are calls and no other text)."""
    parser = ToolCallParser(max_calls)
    parser.feed(text)
    parser.finish()
    content = parser.content
    return (content or None) if parser.calls else content, parser.calls
