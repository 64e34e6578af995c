"""The OpenAI-compatible API's request bodies (pydantic) and their translation to the
Router's sampling dict.

Compatibility policy: a field that would change the output is served or refused, never
ignored; a field that does not change the output is accepted. A refusal (400) names every
refused or invalid field at once: `param` is the first, the message lists them all.

Accepted and not used (they do not change the tokens): `user`, `metadata`, `service_tier`,
`prompt_cache_key` (routing is cache-aware anyway; `cache_salt` is the isolation key),
`prompt_cache_retention`, `safety_identifier`, `store` (false or omitted: nothing is stored),
`prediction` (a latency hint), `stream_options.include_obfuscation`, `modalities: ["text"]`,
`response_format: {"type": "text"}`, `strict` of schemas and functions (a response_format
schema is always enforced; a function's parameters are enforced whenever tool_choice requires
a call, strict or not), and in messages what the SDK echoes back (`refusal`, `annotations`,
null `audio`).

Refused: `store: true`, `audio`, `web_search_options`, `reasoning_effort`, `verbosity`,
`suffix`, `best_of` other than n, the legacy `functions` / `function_call` (use `tools` /
`tool_choice`), content parts other than text, tools other than functions, vLLM's older
`guided_*` fields (use `structured_outputs`), and every field not declared here.

Served extensions (as vLLM): `top_k`, `min_p`, `repetition_penalty`, `min_tokens`,
`ignore_eos`, `stop_token_ids`, `include_stop_str_in_output`, `return_token_ids`,
`cache_salt`, `structured_outputs`, `chat_template_kwargs`,
`stream_options.continuous_usage_stats` (a running usage on every chunk), and Baton's
`session_id` / `retention_seconds` (router/sessions.py: the conversation's next turn goes
back to the workers holding its context, which keep its blocks that long).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from engine.errors import InvalidRequestError
from engine.structured_output import StructuredOutput
from router.chat_protocol import ChatMessage, Tool, ToolChoice, ToolPlan, check_unique_names
from router.chat_protocol import tool_plan as make_tool_plan
from router.structured_output import Constraint, ResponseFormat, StructuredOutputs, constraint
from router.tool_calls import structural_tag

if TYPE_CHECKING:
    from pydantic_core import ErrorDetails

# Undeclared fields whose refusal says what to send instead.
HINTS = {
    "functions": "use tools",
    "function_call": "use tool_choice",
    "guided_json": "use structured_outputs.json",
    "guided_regex": "use structured_outputs.regex",
    "guided_choice": "use structured_outputs.choice",
    "guided_grammar": "use structured_outputs.grammar",
    "guided_decoding_backend": "the grammar engine is xgrammar",
    "max_completion_tokens": "on /v1/completions, use max_tokens",
}


class InvalidField(InvalidRequestError):
    """Request fields with values this server refuses: `param` names the first, `params`
    all of them (the message lists each with its reason)."""

    def __init__(self, param: str | None, message: str, params: list[str] | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.params = params if params is not None else ([param] if param else [])


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class StreamOptions(_Strict):
    """Options of a streamed response."""

    include_usage: bool = Field(False, description="Send a last chunk with the usage.")
    continuous_usage_stats: bool = Field(
        False, description="Extension: every chunk carries the usage so far."
    )
    include_obfuscation: bool | None = Field(None, description="Accepted, not used.")


# Fields declared so that their refusal says why; any value but the default is refused.
REFUSED = {
    "audio": "audio output is not served",
    "web_search_options": "web search is not served",
    "reasoning_effort": "reasoning effort is not served",
    "verbosity": "verbosity is not served",
    "suffix": "suffix (insertion) is not served",
}


class Unused(_Strict):
    """Fields every generation endpoint accepts and does not use (they change no token)."""

    user: str | None = Field(None, description="End-user id (accepted, not used).")
    metadata: dict[str, Any] | None = Field(None, description="Accepted, not used.")
    service_tier: str | None = Field(None, description="Accepted, not used.")
    prompt_cache_key: str | None = Field(None, description="Accepted, not used.")
    prompt_cache_retention: str | None = Field(None, description="Accepted, not used.")
    safety_identifier: str | None = Field(None, description="Accepted, not used.")


class _Common(Unused):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str = Field(description="The served model's name or one of its aliases.")
    max_tokens: int | None = Field(None, ge=0, description="Most tokens to generate.")
    temperature: float | None = Field(None, ge=0, description="0 means greedy.")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int | None = Field(None, ge=-1, description="Top-k sampling (0 or -1: off).")
    min_p: float | None = Field(None, ge=0, le=1, description="Minimum probability vs the top.")
    seed: int | None = Field(None, description="Same seed, same tokens.")
    stop: str | list[str] | None = Field(None, description="Strings that end the output.")
    stream: bool = Field(False, description="Send server-sent events as tokens arrive.")
    stream_options: StreamOptions | None = Field(None, description="Options of a stream.")
    n: int = Field(1, ge=1, le=128, description="Choices per prompt.")
    presence_penalty: float = Field(0.0, ge=-2, le=2, description="OpenAI presence penalty.")
    frequency_penalty: float = Field(0.0, ge=-2, le=2, description="OpenAI frequency penalty.")
    repetition_penalty: float | None = Field(
        None, gt=0, description="Extension: multiplicative penalty on seen tokens (1: off)."
    )
    logit_bias: dict[int, float] | None = Field(
        None, description="Token id -> bias added to its logit (-100 to 100)."
    )
    min_tokens: int = Field(0, ge=0, description="Extension: no end before this many tokens.")
    response_format: ResponseFormat | None = Field(None, description="Structured output.")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="Extension: json, regex, choice, grammar or structural_tag."
    )
    store: bool | None = Field(None, description="false or omitted: nothing is stored.")
    cache_salt: str | None = Field(
        None,
        description="Extension: prefix-cache tenant; requests share cached blocks only "
        "with requests of the same salt.",
    )
    session_id: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="Extension: the conversation this request belongs to; its next turn is "
        "routed to the workers that hold its context.",
    )
    retention_seconds: float | None = Field(
        None,
        gt=0,
        description="Extension: keep the session's blocks at the lowest eviction priority "
        "this long after the request (needs session_id; at most the workers' "
        "max_retention_seconds).",
    )
    ignore_eos: bool = Field(False, description="Extension: keep going past end-of-sequence.")
    stop_token_ids: list[int] | None = Field(None, description="Extension: ids that end it.")
    include_stop_str_in_output: bool = Field(
        False, description="Extension: a matched stop string stays in the text."
    )
    return_token_ids: bool = Field(
        False, description="Extension: each choice also carries its `token_ids`."
    )
    _constraint: Constraint | None = PrivateAttr(None)

    @field_validator("store")
    @classmethod
    def _not_stored(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("store=true is not served: this server keeps no completions")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, value: dict[int, float] | None) -> dict[int, float] | None:
        bad = {k: v for k, v in (value or {}).items() if not -100 <= v <= 100 or k < 0}
        if bad:
            raise ValueError(f"biases must be in [-100, 100] for ids >= 0, got {bad}")
        return value

    def problems(self) -> list[tuple[str, str]]:
        """Cross-field refusals (param, reason), checked once every field is valid."""
        out = []
        try:
            if self._constraint is None:  # (the Responses API sets its own, from text.format)
                self._constraint = constraint(self.response_format, self.structured_outputs)
        except ValueError as exc:
            out.append(("structured_outputs", str(exc)))
        return out

    @property
    def output_constraint(self) -> Constraint | None:
        return self._constraint

    @property
    def constraint_param(self) -> str | None:
        """The field the sampling dict's structured_output comes from."""
        return self._constraint.param if self._constraint else None

    def sampling(self, max_tokens: int | None) -> dict:
        """The Router's sampling dict (unset fields keep SamplingParams' defaults and are
        left out)."""
        out: dict = {}
        for name in ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        for name in ("presence_penalty", "frequency_penalty", "min_tokens", "logit_bias"):
            if getattr(self, name):
                out[name] = getattr(self, name)
        if self.n != 1:
            out["n"] = self.n
        if max_tokens is not None:
            out["max_tokens"] = max_tokens
        if self.stop:
            out["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.include_stop_str_in_output:
            out["include_stop_str_in_output"] = True
        if self.output_constraint is not None:
            out["structured_output"] = self.output_constraint.structured_output
        out["ignore_eos"] = self.ignore_eos
        return out

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_Common):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="Text or token ids, or a batch of either (each its own choices)."
    )
    logprobs: int | None = Field(
        None, ge=0, le=5, description="Per token: its logprob and the top this-many."
    )
    echo: bool = Field(False, description="The prompt comes first in each choice's text.")
    best_of: int | None = Field(None, description="Accepted when equal to n.")
    suffix: str | None = Field(None, description=REFUSED["suffix"])

    @field_validator("suffix")
    @classmethod
    def _refused(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError(REFUSED["suffix"])
        return value

    def problems(self) -> list[tuple[str, str]]:
        out = super().problems()
        if self.best_of is not None and self.best_of != self.n:
            out.append(("best_of", f"best_of={self.best_of} is not served; only best_of == n"))
        if self.max_tokens == 0 and not self.echo:
            out.append(("max_tokens", "max_tokens=0 is served only with echo=true"))
        if not self.prompts():
            out.append(("prompt", "prompt is empty"))
        return out

    def prompts(self) -> list[str | list[int]]:
        """The batch: each a text or token ids."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            return list(p)
        return [cast("str | list[int]", p)] if p or p == "" else []  # one text or token ids

    def sampling(self, max_tokens: int | None) -> dict:
        out = super().sampling(max_tokens)
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
            if self.echo:
                out["prompt_logprobs"] = self.logprobs
        return out


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    max_completion_tokens: int | None = Field(
        None, ge=1, description="Most tokens to generate (wins over max_tokens)."
    )
    logprobs: bool | None = Field(None, description="Return each output token's logprob.")
    top_logprobs: int | None = Field(
        None, ge=0, le=20, description="With logprobs: the top this-many per token."
    )
    tools: list[Tool] | None = Field(None, description="Functions the model may call.")
    tool_choice: ToolChoice | None = Field(None, description="none, auto, required or a name.")
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call per reply.")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extension: extra variables for the chat template."
    )
    modalities: list[Literal["text"]] | None = Field(None, description="Only ['text'].")
    prediction: dict[str, Any] | None = Field(None, description="Accepted, not used.")
    audio: Any = Field(None, description=REFUSED["audio"])
    web_search_options: Any = Field(None, description=REFUSED["web_search_options"])
    reasoning_effort: Any = Field(None, description=REFUSED["reasoning_effort"])
    verbosity: Any = Field(None, description=REFUSED["verbosity"])
    _tool_plan: ToolPlan | None = PrivateAttr(None)
    _calls_or_format: dict | None = PrivateAttr(None)  # tool_choice auto + a response format

    @field_validator("audio", "web_search_options", "reasoning_effort", "verbosity")
    @classmethod
    def _refused(cls, value: Any, info) -> Any:
        if value is not None:
            raise ValueError(REFUSED[info.field_name])
        return value

    @field_validator("tools")
    @classmethod
    def _unique(cls, value: list[Tool] | None) -> list[Tool] | None:
        return check_unique_names(value)

    def problems(self) -> list[tuple[str, str]]:
        out = super().problems()
        try:
            self._tool_plan = make_tool_plan(self.tools, self.tool_choice, self.parallel_tool_calls)
        except ValueError as exc:
            out.append(("tool_choice", str(exc)))
            return out
        plan, fmt = self._tool_plan, self.output_constraint
        if plan.mode == "auto" and plan.callable and fmt is not None:
            try:  # the reply is calls, or an answer in the format
                otherwise = StructuredOutput.of(fmt.structured_output).tag_format()
                calls = list(plan.callable)
                self._calls_or_format = structural_tag(calls, plan.parallel, otherwise)
            except InvalidRequestError as exc:
                out.append((fmt.param, str(exc)))
        if self.top_logprobs and not self.logprobs:
            out.append(("top_logprobs", "top_logprobs needs logprobs=true"))
        return out

    @property
    def plan(self) -> ToolPlan:
        """The request's tools and tool_choice (made by problems(), which parse() runs)."""
        if self._tool_plan is None:
            raise RuntimeError("the tool plan is made by problems() (parse())")
        return self._tool_plan

    @property
    def constraint_param(self) -> str | None:
        return "tools" if self.plan.mode == "required" else super().constraint_param

    def sampling(self, max_tokens: int | None) -> dict:
        out = super().sampling(max_tokens)
        if self.logprobs:
            out["logprobs"] = self.top_logprobs or 0
        plan = self.plan
        if plan.mode == "required":  # the reply is calls only: a response format has no text
            tag = structural_tag(list(plan.callable), plan.parallel)
            out["structured_output"] = {"structural_tag": tag}
        elif self._calls_or_format is not None:
            out["structured_output"] = {"structural_tag": self._calls_or_format}
        return out


def parse(cls: type[_Common], body: object) -> _Common:
    """Validate a JSON body; raises InvalidField naming every bad field."""
    if not isinstance(body, dict):
        raise InvalidField(None, "the request body must be a JSON object")
    try:
        request = cls.model_validate(body)
    except ValidationError as exc:
        raise refusal(in_body_order(field_errors(exc), body)) from None
    problems = request.problems()
    if problems:
        raise refusal(in_body_order(problems, body))
    return request


def in_body_order(
    problems: Sequence[tuple[str | None, str]], body: dict
) -> list[tuple[str | None, str]]:
    """Problems sorted as their top-level fields appear in the request body."""
    keys = {k: i for i, k in enumerate(body)}
    return sorted(problems, key=lambda p: keys.get((p[0] or "").split(".")[0], len(keys)))


def refusal(problems: Sequence[tuple[str | None, str]]) -> InvalidField:
    """One InvalidField for all (param, reason) problems."""
    params = [p for p, _ in problems if p]
    if len(problems) == 1:
        return InvalidField(problems[0][0], problems[0][1], params)
    listed = "; ".join(reason for _, reason in problems)
    return InvalidField(
        params[0] if params else None, f"{len(problems)} fields refused: {listed}", params
    )


def field_errors(exc: ValidationError, prefix: str = "") -> list[tuple[str | None, str]]:
    """Every validation error as (field path, a sentence that names it). A field that fails
    every member of a union reports one error: the first of the member that got furthest."""
    chosen: dict[
        tuple, tuple[int, str | None, ErrorDetails]
    ] = {}  # union field -> (depth, member, err)
    order: list[tuple] = []
    for error in exc.errors(include_url=False):
        loc = [str(p) for p in error["loc"]]
        tag = next((i for i, p in enumerate(loc) if _union_tag(p)), None)
        key = tuple(loc) if tag is None else tuple(loc[:tag])
        member = None if tag is None else loc[tag]
        depth = len(loc)
        if key not in chosen:
            order.append(key)
        best = chosen.get(key)
        if best is None or (member != best[1] and depth > best[0]):
            chosen[key] = (depth, member, error)
    return [_sentence(chosen[key][2], prefix) for key in order]


def _sentence(error: ErrorDetails, prefix: str) -> tuple[str | None, str]:
    loc = [str(p) for p in error["loc"] if not _union_tag(str(p))]
    field = prefix + ".".join(loc) if loc else (prefix.rstrip(".") or None)
    if error["type"] == "extra_forbidden":
        hint = HINTS.get(field or "")
        why = f"; {hint}" if hint else ""
        return field, f"unsupported field '{field}': this server does not take it{why}"
    if error["type"] == "missing":
        return field, f"field '{field}' is required"
    msg = error["msg"].removeprefix("Value error, ")
    return field, f"field '{field}'={_short(error.get('input'))} is invalid: {msg}"


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _union_tag(part: str) -> bool:
    """Whether a location part names a union member (pydantic's 'str', 'list[int]', ...)."""
    return (
        part in {"str", "int", "float", "bool", "none"}
        or part.startswith(
            ("list[", "dict[", "function-", "literal[", "nullable[", "tagged-union[")
        )
        or part[:1].isupper()
    )
