"""One choice of a reply as its worker outputs arrive: text, token ids, logprobs and (chat
with tools) the calls parsed from the text; each add() returns the Delta a stream chunk
carries, so streamed and whole replies are made from the same pieces."""

from __future__ import annotations

from dataclasses import dataclass, field

from router.openai_logprobs import LegacyLogprobs, TokenText, chat_entries
from router.tool_calls import ArgumentsDelta, CallStarted, TextDelta, ToolCallParser

# The engine's finish reasons as OpenAI's ("abort": stopped by the server, not the model).
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


@dataclass(slots=True)
class Delta:
    """What one output added to a choice."""

    text: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # chat's delta.tool_calls items
    token_ids: list[int] = field(default_factory=list)
    logprobs: dict | list | None = None  # chat: content items; completion: legacy dict
    finish_reason: str | None = None
    events: list = field(default_factory=list)  # the text and call events, in output order

    def empty(self) -> bool:
        return not (self.text or self.tool_calls or self.token_ids or self.finish_reason) and (
            not self.logprobs
        )


@dataclass(slots=True)
class ChoiceOptions:
    """How a request's choices are shaped (the same for all of them)."""

    kind: str  # "chat" or "completion"
    token_text: TokenText
    logprobs: bool = False
    parser_calls: int | None = 0  # 0: no tool-call parsing; None: any number; 1: one call
    drop_generated: bool = False  # echo with max_tokens=0: only the prompt is returned


class Choice:
    """One choice (its `index` in the reply)."""

    def __init__(self, index: int, options: ChoiceOptions) -> None:
        self.index = index
        self.options = options
        self.text = ""
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.chat_logprobs: list[dict] = []
        self.legacy = LegacyLogprobs(options.token_text)
        self.parser = ToolCallParser(options.parser_calls) if options.parser_calls != 0 else None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def echo(self, text: str, prompt_ids: list[int], prompt_logprobs: list | None) -> Delta:
        """Put the prompt first (completions' echo); its logprobs when asked for."""
        self.text += text
        self.legacy.offset = 0
        logprobs = None
        if self.options.logprobs:
            entries = prompt_logprobs if prompt_logprobs is not None else [None] * len(prompt_ids)
            logprobs = self.legacy.add(entries, prompt_ids)
        self.legacy.offset = len(self.text)
        return Delta(text=text, logprobs=logprobs)

    def add(self, out: dict) -> Delta:
        """Take one output dict of this choice."""
        delta = Delta()
        if out.get("finish_reason") or out["finished"]:  # this choice's last output
            self.finish_reason = out.get("finish_reason") or "stop"
        if self.options.drop_generated:
            delta.finish_reason = self.finish() if self.finished else None
            return delta
        text = out.get("text") or ""
        self.text += text
        self.token_ids += out["token_ids"]
        delta.token_ids = list(out["token_ids"])
        entries = out.get("logprobs")
        if self.options.logprobs and entries:
            if self.options.kind == "chat":
                items = chat_entries(entries, self.options.token_text)
                self.chat_logprobs += items
                delta.logprobs = items
            else:
                delta.logprobs = self.legacy.add(entries)
        if self.parser is None:
            delta.text = text
            delta.events = [TextDelta(text)] if text else []
        else:
            events = self.parser.feed(text)
            if self.finished:
                events += self.parser.finish()
            self._take(events, delta)
            delta.events = events
        if self.finished:
            delta.finish_reason = self.finish()
        return delta

    def _take(self, events: list, delta: Delta) -> None:
        for event in events:
            if isinstance(event, TextDelta):
                delta.text += event.text
            elif isinstance(event, CallStarted):
                delta.tool_calls.append(
                    {
                        "index": event.index,
                        "id": event.id,
                        "type": "function",
                        "function": {"name": event.name, "arguments": ""},
                    }
                )
            elif isinstance(event, ArgumentsDelta):
                # a call's first item has its id and name only, the arguments follow
                last = delta.tool_calls[-1] if delta.tool_calls else None
                if last is not None and last["index"] == event.index and "id" not in last:
                    last["function"]["arguments"] += event.text
                else:
                    delta.tool_calls.append(
                        {"index": event.index, "function": {"arguments": event.text}}
                    )

    @property
    def calls(self) -> list:
        return self.parser.calls if self.parser is not None else []

    def finish(self) -> str | None:
        """The OpenAI finish reason (tool_calls when calls ended the output)."""
        reason = FINISH_REASONS.get(self.finish_reason or "", self.finish_reason)
        if self.calls and reason == "stop":
            return "tool_calls"
        return reason

    def body(self) -> dict:
        """The choice in a non-streamed reply."""
        choice: dict = {"index": self.index, "finish_reason": self.finish(), "logprobs": None}
        if self.options.kind == "chat":
            content = self.parser.content if self.parser is not None else self.text
            message: dict = {"role": "assistant", "content": content}
            if self.calls:
                message["content"] = content or None
                message["tool_calls"] = [c.as_dict() for c in self.calls]
            choice["message"] = message
            if self.options.logprobs:
                choice["logprobs"] = {"content": self.chat_logprobs, "refusal": None}
        else:
            choice["text"] = self.text
            if self.options.logprobs:
                choice["logprobs"] = self.legacy.as_dict()
        return choice
