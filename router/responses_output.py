"""The Responses API's output: items (`message`, `function_call`) and stream events built from
a chat choice's text and call events, so the streamed and the whole response are made from
the same sequence.

Events of one response, in order: response.created, response.in_progress; per message item
output_item.added, content_part.added, output_text.delta..., output_text.done,
content_part.done, output_item.done; per call output_item.added,
function_call_arguments.delta..., function_call_arguments.done, output_item.done; then
response.completed (response.incomplete when max_output_tokens cut it).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from router.tool_calls import ArgumentsDelta, CallStarted, TextDelta


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class ResponseBuilder:
    """One response: feed() each chunk's events, finish() at the end; events() are the
    stream's, body() the whole response."""

    def __init__(self, request, model: str) -> None:
        self.id = _id("resp")
        self.request = request
        self.model = model
        self.created = int(time.time())
        self.items: list[dict] = []
        self._open: dict | None = None  # the item still being written
        self._sequence = 0
        self.usage: dict | None = None
        self.status = "in_progress"

    def start(self) -> list[dict]:
        """response.created and response.in_progress."""
        return [
            self._event("response.created", response=self.body()),
            self._event("response.in_progress", response=self.body()),
        ]

    def feed(self, events: list) -> list[dict]:
        """The stream events of a choice's text and call events."""
        out: list[dict] = []
        for event in events:
            if isinstance(event, TextDelta):
                if self._open is None or self._open["type"] != "message":
                    out += self._close()
                    out += self._open_message()
                message = self._open_item()
                part = message["content"][0]
                part["text"] += event.text
                out.append(
                    self._text_event(
                        "response.output_text.delta", message, delta=event.text, logprobs=[]
                    )
                )
            elif isinstance(event, CallStarted):
                out += self._close()
                item = {
                    "id": _id("fc"),
                    "type": "function_call",
                    "call_id": event.id,
                    "name": event.name,
                    "arguments": "",
                    "status": "in_progress",
                }
                out += self._add(item)
            elif isinstance(event, ArgumentsDelta):
                call = self._open_item()  # opened by its CallStarted
                call["arguments"] += event.text
                out.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=call["id"],
                        output_index=len(self.items) - 1,
                        delta=event.text,
                    )
                )
        return out

    def finish(self, finish_reason: str | None, usage: dict) -> list[dict]:
        """Close the open item; response.completed (or .incomplete after max_output_tokens)."""
        cut = finish_reason == "length"
        out = self._close("incomplete" if cut else "completed")
        self.usage = {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                "cache_write_tokens": 0,
            },
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        }
        self.status = "incomplete" if cut else "completed"
        kind = "response.incomplete" if cut else "response.completed"
        out.append(self._event(kind, response=self.body()))
        return out

    def error(self, error: dict) -> dict:
        """The stream's `error` event for an error body's error."""
        return self._event(
            "error", message=error["message"], code=error["code"], param=error["param"]
        )

    def body(self) -> dict:
        """The response object (as it stands)."""
        req = self.request
        fmt = (
            req.text.format.model_dump(by_alias=True, exclude_none=True)
            if (req.text and req.text.format)
            else {"type": "text"}
        )
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": self.status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if self.status == "incomplete"
            else None,
            "instructions": req.instructions,
            "metadata": req.metadata or {},
            "model": self.model,
            "output": [dict(item) for item in self.items],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": req.temperature,
            "tool_choice": _dump(req.tool_choice) if req.tool_choice is not None else "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "top_p": req.top_p,
            "max_output_tokens": req.max_output_tokens,
            "previous_response_id": None,
            "store": False,
            "text": {"format": fmt},
            "truncation": "disabled",
            "usage": self.usage,
            "user": req.user,
        }

    def _open_item(self) -> dict:
        """The item still being written."""
        if self._open is None:
            raise RuntimeError("an output event with no output item open")
        return self._open

    def _open_message(self) -> list[dict]:
        item: dict[str, Any] = {
            "id": _id("msg"),
            "type": "message",
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        out = self._add(item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item["content"].append(part)
        out.append(self._text_event("response.content_part.added", item, part=dict(part)))
        return out

    def _add(self, item: dict) -> list[dict]:
        self.items.append(item)
        self._open = item
        shown = {**item, "content": []} if item["type"] == "message" else dict(item)
        return [
            self._event("response.output_item.added", output_index=len(self.items) - 1, item=shown)
        ]

    def _close(self, status: str = "completed") -> list[dict]:
        item = self._open
        if item is None:
            return []
        self._open = None
        item["status"] = status
        index = len(self.items) - 1
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out.append(
                self._text_event("response.output_text.done", item, text=part["text"], logprobs=[])
            )
            out.append(self._text_event("response.content_part.done", item, part=dict(part)))
        else:
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        out.append(self._event("response.output_item.done", output_index=index, item=dict(item)))
        return out

    def _text_event(self, kind: str, item: dict, **fields) -> dict:
        """An event of the (last) message item's one text part."""
        index = self.items.index(item)
        return self._event(kind, item_id=item["id"], output_index=index, content_index=0, **fields)

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event


def _dump(choice) -> object:
    return choice if isinstance(choice, str) else choice.model_dump()
