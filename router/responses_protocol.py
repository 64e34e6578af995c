"""POST /v1/responses (the OpenAI Responses API) request body, translated to a chat request.

Served: `input` as text or a list of items (messages, with input_text / output_text parts;
`function_call` items of earlier turns; `function_call_output` items answering them),
`instructions` (the system turn), function `tools` in the Responses flat shape,
`tool_choice`, `parallel_tool_calls`, `text.format` (text, json_object, json_schema),
`max_output_tokens`, `temperature`, `top_p`, `stream`.

Stateless: nothing is stored, so `store: true`, `previous_response_id`, `conversation`,
`background` and `item_reference` items are refused with a 400. OpenAI's default for an
omitted `store` is true, but every conversation here travels in full in `input` (as the
Agents SDK sends it), so an omitted store is read as false rather than refused.

Accepted, not used: `user`, `metadata`, `service_tier`, `prompt_cache_key`,
`prompt_cache_retention`, `safety_identifier`, `truncation: "disabled"`, `include` values
`reasoning.encrypted_content` and `message.output_text.logprobs` (no reasoning items are made;
logprobs are not returned on this API), `max_tool_calls` (no built-in tools), `reasoning`
with no effort, `stream_options.include_obfuscation`. Everything else is refused.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from router.openai_protocol import (
    ChatCompletionRequest,
    InvalidField,
    Unused,
    field_errors,
    in_body_order,
    refusal,
)
from router.structured_output import ResponseFormat, constraint

ACCEPTED_INCLUDES = ("reasoning.encrypted_content", "message.output_text.logprobs")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class InputText(_Strict):
    type: Literal["input_text", "output_text", "text"] = Field(description="A text part.")
    text: str = Field(description="The text.")
    annotations: list[Any] | None = Field(None, description="Accepted, not used.")
    logprobs: list[Any] | None = Field(None, description="Accepted, not used.")


class Refusal(_Strict):
    type: Literal["refusal"] = Field(description="An earlier refusal (rendered as text).")
    refusal: str = Field(description="Its text.")


class MessageItem(_Strict):
    """A message: the user's, the system's / developer's, or an earlier assistant turn."""

    type: Literal["message"] = Field("message", description="Always 'message'.")
    role: Literal["user", "assistant", "system", "developer"] = Field(description="Its author.")
    content: str | list[InputText | Refusal] = Field(description="Text or text parts.")
    id: str | None = Field(None, description="Accepted, not used.")
    status: str | None = Field(None, description="Accepted, not used.")
    phase: str | None = Field(None, description="Accepted, not used.")

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text if isinstance(p, InputText) else p.refusal for p in self.content)


class FunctionCallItem(_Strict):
    """A call an earlier turn made."""

    type: Literal["function_call"] = Field(description="Always 'function_call'.")
    call_id: str = Field(description="The call's id (its output answers it).")
    name: str = Field(description="The function.")
    arguments: str = Field(description="JSON text.")
    id: str | None = Field(None, description="Accepted, not used.")
    status: str | None = Field(None, description="Accepted, not used.")


class FunctionCallOutputItem(_Strict):
    """What a call returned."""

    type: Literal["function_call_output"] = Field(description="Always 'function_call_output'.")
    call_id: str = Field(description="The call it answers.")
    output: str | list[InputText] = Field(description="The result, text or text parts.")
    id: str | None = Field(None, description="Accepted, not used.")
    status: str | None = Field(None, description="Accepted, not used.")

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem


class FunctionTool(_Strict):
    """A function tool in the Responses flat shape."""

    type: Literal["function"] = Field(description="Only function tools are served.")
    name: str = Field(description="The function's name.")
    description: str | None = Field(None, description="What it does.")
    parameters: dict[str, Any] | None = Field(None, description="JSON schema of its arguments.")
    strict: bool | None = Field(None, description="Accepted; schemas are enforced anyway.")


class NamedFunction(_Strict):
    type: Literal["function"] = Field(description="Always 'function'.")
    name: str = Field(description="The function the reply calls.")


class AllowedToolsChoice(_Strict):
    type: Literal["allowed_tools"] = Field(description="Always 'allowed_tools'.")
    mode: Literal["auto", "required"] = Field(description="As tool_choice auto / required.")
    tools: list[NamedFunction] = Field(min_length=1, description="The tools allowed.")


class TextFormat(_Strict):
    """text.format: text, json_object, or json_schema (flat: name, schema, strict)."""

    type: Literal["text", "json_object", "json_schema"] = Field(description="The format.")
    name: str | None = Field(None, description="json_schema: the schema's name.")
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="The schema.")
    strict: bool | None = Field(None, description="Accepted; the schema is always enforced.")
    description: str | None = Field(None, description="Accepted, not used.")


class TextConfig(_Strict):
    format: TextFormat | None = Field(None, description="The output format.")
    verbosity: None = Field(None, description="Only null (verbosity is not served).")


class Reasoning(_Strict):
    effort: None = Field(None, description="Only null (reasoning effort is not served).")
    summary: None = Field(None, description="Only null.")
    generate_summary: None = Field(None, description="Only null.")


class StreamOptions(_Strict):
    include_obfuscation: bool | None = Field(None, description="Accepted, not used.")


class ResponsesRequest(Unused):
    """POST /v1/responses (metadata is echoed back in the response)."""

    model: str = Field(description="The served model's name or one of its aliases.")
    input: str | list[InputItem] = Field(description="Text, or the conversation's items.")
    instructions: str | None = Field(None, description="The system turn.")
    tools: list[FunctionTool] | None = Field(None, description="Functions the model may call.")
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | AllowedToolsChoice | None = (
        Field(None, description="none, auto, required, or a function.")
    )
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call.")
    text: TextConfig | None = Field(None, description="The output format.")
    max_output_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    temperature: float | None = Field(None, ge=0, le=2, description="0 means greedy.")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus sampling mass.")
    stream: bool = Field(False, description="Send server-sent events.")
    stream_options: StreamOptions | None = Field(None, description="Accepted, not used.")
    store: bool | None = Field(None, description="Only false (or omitted): nothing is stored.")
    previous_response_id: str | None = Field(None, description="Refused: nothing is stored.")
    include: list[str] | None = Field(None, description="Accepted values only (see above).")
    truncation: Literal["disabled"] | None = Field(None, description="Only 'disabled'.")
    reasoning: Reasoning | None = Field(None, description="Only without effort.")
    max_tool_calls: int | None = Field(None, description="Accepted, not used.")
    background: bool | None = Field(None, description="Only false: responses are not stored.")
    session_id: str | None = Field(
        None, min_length=1, max_length=256, description="Extension: as on chat completions."
    )
    retention_seconds: float | None = Field(
        None, gt=0, description="Extension: as on chat completions."
    )

    @field_validator("store", "background")
    @classmethod
    def _not_stored(cls, value: bool | None, info) -> bool | None:
        if value:
            raise ValueError(
                f"{info.field_name}=true is not served: this server stores no responses; "
                f"send the whole conversation in input"
            )
        return value

    @field_validator("previous_response_id")
    @classmethod
    def _stateless(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError(
                "previous_response_id is not served: this server stores no responses; "
                "send the whole conversation in input"
            )
        return value

    @field_validator("include")
    @classmethod
    def _includes(cls, value: list[str] | None) -> list[str] | None:
        other = [v for v in value or [] if v not in ACCEPTED_INCLUDES]
        if other:
            raise ValueError(f"include values {other} are not served")
        return value


def parse_responses(body: object) -> tuple[ResponsesRequest, ChatCompletionRequest]:
    """The Responses request and the chat request it comes to; InvalidField naming every
    bad field (Responses names)."""
    if not isinstance(body, dict):
        raise InvalidField(None, "the request body must be a JSON object")
    try:
        req = ResponsesRequest.model_validate(body)
    except ValidationError as exc:
        raise refusal(in_body_order(field_errors(exc), body)) from None
    try:
        chat = ChatCompletionRequest.model_validate(_chat_body(req))
    except ValidationError as exc:
        raise refusal([(_responses_name(p), m) for p, m in field_errors(exc)]) from None
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type != "text":
        nested: dict = {"type": fmt.type}
        if fmt.type == "json_schema":
            nested["json_schema"] = {"name": fmt.name or "output", "schema": fmt.schema_}
        chat._constraint = constraint(ResponseFormat.model_validate(nested), None, "text.format")
    problems = chat.problems()
    if problems:
        raise refusal(problems)
    return req, chat


def _responses_name(param: str | None) -> str | None:
    """A chat request's field path as the Responses request names it."""
    if param is None:
        return None
    if param.startswith("messages"):
        return "input"
    return re.sub(r"^tools\.(\d+)\.function\.", r"tools.\1.", param)


def _chat_body(req: ResponsesRequest) -> dict:
    body: dict = {"model": req.model, "messages": messages(req)}
    for name in ("temperature", "top_p", "parallel_tool_calls", "session_id", "retention_seconds"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
            for t in req.tools
        ]
    choice = req.tool_choice
    if isinstance(choice, NamedFunction):
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif isinstance(choice, AllowedToolsChoice):
        tools = [{"type": "function", "function": {"name": t.name}} for t in choice.tools]
        body["tool_choice"] = {
            "type": "allowed_tools",
            "allowed_tools": {"mode": choice.mode, "tools": tools},
        }
    elif choice is not None:
        body["tool_choice"] = choice
    return body


def messages(req: ResponsesRequest) -> list[dict]:
    """The chat messages of instructions + input: consecutive function_call items join one
    assistant turn (with the assistant text just before them)."""
    out: list[dict] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    items = (
        [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    )
    for item in items:
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    if not out:
        raise InvalidField("input", "input is empty")
    return out
