"""Chat completions' messages, tools and tool_choice (pydantic), and the ToolPlan a request's
tools come to: which functions may be called, whether a call is required, how many.

Messages: system / developer (rendered as system) / user / assistant / tool; content is text
or a list of text parts; an assistant message may carry `tool_calls` (content null), a tool
message answers one by `tool_call_id`. Fields the openai SDK sends back when a reply's message
is appended to the history as is (refusal, annotations, audio, function_call: null) are
accepted and not used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    """A text part of a message's content (the only kind this server takes)."""

    type: Literal["text"] = Field(description="Always 'text'.")
    text: str = Field(description="The text.")


class CalledFunction(_Strict):
    """The function an earlier assistant turn called."""

    name: str = Field(description="The function's name.")
    arguments: str = Field(description="Its arguments, JSON text.")


class AssistantToolCall(_Strict):
    """One tool call of an earlier assistant turn."""

    id: str = Field(description="The call's id (tool messages answer it).")
    type: Literal["function"] = Field("function", description="Always 'function'.")
    function: CalledFunction = Field(description="The function called.")


class ChatMessage(_Strict):
    """One chat message; the chat template turns the list into the prompt."""

    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="Who wrote the message (developer is rendered as system)."
    )
    content: str | list[TextPart] | None = Field(None, description="Text or text parts.")
    name: str | None = Field(None, description="Optional author name (passed to the template).")
    tool_calls: list[AssistantToolCall] | None = Field(
        None, description="An assistant turn's calls."
    )
    tool_call_id: str | None = Field(None, description="The call a tool message answers.")
    refusal: str | None = Field(None, description="Accepted, not used.")
    annotations: list[Any] | None = Field(None, description="Accepted, not used.")
    audio: None = Field(None, description="Accepted when null.")
    function_call: None = Field(None, description="Accepted when null (use tool_calls).")
    reasoning_content: str | None = Field(None, description="Accepted, not rendered.")

    @model_validator(mode="after")
    def _role_fields(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id (the call it answers)")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def template_dict(self) -> dict:
        """The message as chat templates take it (router/chat_template.py)."""
        role = "system" if self.role == "developer" else self.role
        out: dict = {"role": role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class FunctionDefinition(_Strict):
    """A function the model may call."""

    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$", description="The function's name.")
    description: str | None = Field(None, description="What it does (shown to the model).")
    parameters: dict[str, Any] | None = Field(
        None, description="JSON schema of its arguments (enforced for required/named calls)."
    )
    strict: bool | None = Field(None, description="Accepted; see `parameters`.")


class Tool(_Strict):
    """A tool: only functions are served."""

    type: Literal["function"] = Field(description="Always 'function'.")
    function: FunctionDefinition = Field(description="The function.")


class FunctionName(_Strict):
    name: str = Field(description="The function's name.")


class NamedToolChoice(_Strict):
    """tool_choice naming one function: the reply calls it."""

    type: Literal["function"] = Field(description="Always 'function'.")
    function: FunctionName = Field(description="The function to call.")


class AllowedTools(_Strict):
    mode: Literal["auto", "required"] = Field(description="As tool_choice auto / required.")
    tools: list[NamedToolChoice] = Field(min_length=1, description="The tools allowed.")


class AllowedToolsChoice(_Strict):
    """tool_choice restricting the calls to some of the tools."""

    type: Literal["allowed_tools"] = Field(description="Always 'allowed_tools'.")
    allowed_tools: AllowedTools = Field(description="The mode and the tools allowed.")


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolsChoice


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a request's tools come to. mode: none (no calls parsed), auto (calls parsed from
    free output), required (the grammar makes the output one or more calls to `callable`)."""

    offered: tuple[dict, ...]  # every tool, as rendered into the prompt
    callable: tuple[tuple[str, dict | None], ...]  # (name, parameters) the output may call
    mode: Literal["none", "auto", "required"]
    parallel: bool

    @property
    def parses_calls(self) -> bool:
        return self.mode != "none" and bool(self.callable)

    @property
    def max_calls(self) -> int | None:
        return None if self.parallel else 1


def tool_plan(
    tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool | None
) -> ToolPlan:
    """The ToolPlan of tools + tool_choice + parallel_tool_calls; raises ValueError (naming
    tool_choice) when the choice names a function that is not offered."""
    tools = tools or []
    offered = tuple(t.model_dump(exclude_none=True) for t in tools)
    functions = {t.function.name: t.function.parameters for t in tools}
    if choice is None:
        choice = "auto" if tools else "none"
    mode: Literal["none", "auto", "required"]
    names = list(functions)
    if isinstance(choice, NamedToolChoice):
        names, mode = [choice.function.name], "required"
    elif isinstance(choice, AllowedToolsChoice):
        names = [t.function.name for t in choice.allowed_tools.tools]
        mode = choice.allowed_tools.mode
    else:
        mode = choice
    missing = [n for n in names if n not in functions]
    if missing:
        raise ValueError(f"tool_choice names {', '.join(missing)}, which tools does not offer")
    if mode == "required" and not names:
        raise ValueError("tool_choice 'required' needs at least one tool in tools")
    return ToolPlan(
        offered=offered,
        callable=tuple((n, functions[n]) for n in names) if mode != "none" else (),
        mode=mode,
        parallel=parallel is not False,
    )


def check_unique_names(tools: list[Tool] | None) -> list[Tool] | None:
    """Tools must have distinct function names (a call is matched by name)."""
    names = [t.function.name for t in tools or []]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"function names must be unique; repeated: {', '.join(repeated)}")
    return tools
