"""Chat messages (with tools and tool calls) to prompt token ids, shared by both front doors.

The template is the server's `chat_template` (a manifest / `baton serve --chat-template`
override), else the tokenizer's, else DEFAULT_TEMPLATE (ChatML). A template that uses the
`tools` variable renders tools and the history's tool calls itself (transformers'
`apply_chat_template(..., tools=...)`, calls' arguments as dicts). Any other template gets the
Hermes convention folded into plain messages: the functions listed as JSON in the system turn,
earlier calls written as `<tool_call>` text in the assistant turn, tool results as
`<tool_response>` blocks in a user turn; router/tool_calls.py parses and enforces the same
call format.
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import jinja2.meta

from engine.errors import InvalidRequestError
from router.tool_calls import call_text

DEFAULT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def tools_prompt(tools: list[dict]) -> str:
    """The system-turn text that lists `tools` (chat completions' tool dicts)."""
    return TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def read_chat_template(path: str | None) -> str | None:
    """The template text of a `chat_template` option (a file path); None stays None."""
    if path is None:
        return None
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"chat_template {path!r} cannot be read: {exc}") from None
    uses_variable(text, "tools")  # a template that does not parse fails here, at start
    return text


def uses_variable(template: str, name: str) -> bool:
    """Whether a Jinja template reads the variable `name` (e.g. 'tools')."""
    try:
        parsed = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"the chat template is not valid Jinja: {exc}") from None
    return name in jinja2.meta.find_undeclared_variables(parsed)


class ChatRenderer:
    """Renders chat messages to token ids with one template (see the module docstring)."""

    def __init__(self, tokenizer, template: str | None = None) -> None:
        self.tokenizer = tokenizer
        own = getattr(tokenizer, "chat_template", None)
        self.template = template or (own if isinstance(own, str) and own else DEFAULT_TEMPLATE)
        self.supports_tools = uses_variable(self.template, "tools")

    def render(
        self, messages: list[dict], tools: list[dict] | None = None, options: dict | None = None
    ) -> list[int]:
        """Prompt ids of `messages` (role, content, tool_calls with JSON-text arguments,
        tool_call_id, name) with `tools` offered; options: extra template variables
        (chat_template_kwargs)."""
        if self.supports_tools:
            messages = [_with_argument_dicts(m) for m in messages]
        elif tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            messages, tools = fold_tools(messages, tools or []), None
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=tools or None,
                chat_template=self.template,
                add_generation_prompt=True,
                tokenize=False,
                **(options or {}),
            )
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as exc:
            raise InvalidRequestError(f"the chat template cannot render messages: {exc}") from None
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def fold_tools(messages: list[dict], tools: list[dict]) -> list[dict]:
    """Messages in plain roles (system, user, assistant) with the Hermes tool convention."""
    out: list[dict] = []
    if tools:
        if messages and messages[0]["role"] == "system":
            first, messages = messages[0], messages[1:]
            system = f"{first['content']}\n\n{tools_prompt(tools)}"
        else:
            system = tools_prompt(tools)
        out.append({"role": "system", "content": system})
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_tool_results"):  # consecutive results: one user turn
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        elif m.get("tool_calls"):
            calls = [
                call_text(c["function"]["name"], c["function"]["arguments"])
                for c in m["tool_calls"]
            ]
            content = "\n".join(([m["content"]] if m.get("content") else []) + calls)
            out.append({"role": "assistant", "content": content})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    for m in out:
        m.pop("_tool_results", None)
    return out


def _with_argument_dicts(message: dict) -> dict:
    """A message whose tool calls' arguments are dicts (what tool-aware templates expect:
    they write `arguments | tojson`); arguments that are not a JSON object stay text."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        function = dict(call["function"])
        try:
            arguments = json.loads(function["arguments"])
        except (json.JSONDecodeError, TypeError):
            arguments = None
        if isinstance(arguments, dict):
            function["arguments"] = arguments
        calls.append({**call, "function": function})
    return {**message, "tool_calls": calls}
