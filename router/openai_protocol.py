"""The OpenAI-compatible API's request bodies (pydantic) and their translation to the
Router's sampling dict; field errors are rephrased to name the field.

Unknown fields are refused (400 naming them): a field that changes the output must never be
silently ignored. `cache_salt`, `ignore_eos`, `stop_token_ids` and `return_token_ids` are
extensions (as in vLLM).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.errors import InvalidRequestError


class InvalidField(InvalidRequestError):
    """A request field has a value this server refuses; `param` names the field."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    """Options of a streamed response."""

    include_usage: bool = Field(False, description="Send a last chunk with the usage.")


class ContentPart(_Strict):
    """A text part of a chat message (the only kind this server takes)."""

    type: Literal["text"] = Field(description="Always 'text'.")
    text: str = Field(description="The text.")


class ChatMessage(_Strict):
    """One chat message; the chat template turns the list into the prompt."""

    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="Who wrote the message."
    )
    content: str | list[ContentPart] | None = Field(None, description="Text or text parts.")
    name: str | None = Field(None, description="Optional author name (passed to the template).")

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class _Common(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str = Field(description="The served model's name or one of its aliases.")
    max_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    temperature: float | None = Field(None, ge=0, description="0 means greedy.")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int | None = Field(None, ge=-1, description="Top-k sampling (0 or -1: off).")
    min_p: float | None = Field(None, ge=0, le=1, description="Minimum probability vs the top.")
    seed: int | None = Field(None, description="Same seed, same tokens.")
    stop: str | list[str] | None = Field(None, description="Strings that end the output.")
    stream: bool = Field(False, description="Send server-sent events as tokens arrive.")
    stream_options: StreamOptions | None = Field(None, description="Options of a stream.")
    n: int = Field(1, description="Choices per prompt; only 1 is supported.")
    presence_penalty: float = Field(0.0, description="Only 0 is supported.")
    frequency_penalty: float = Field(0.0, description="Only 0 is supported.")
    user: str | None = Field(None, description="End-user id (accepted, not used).")
    cache_salt: str | None = Field(
        None,
        description="Extension: prefix-cache tenant; requests share cached blocks only "
        "with requests of the same salt.",
    )
    ignore_eos: bool = Field(False, description="Extension: keep going past end-of-sequence.")
    stop_token_ids: list[int] | None = Field(None, description="Extension: ids that end it.")
    return_token_ids: bool = Field(
        False, description="Extension: each choice also carries its `token_ids`."
    )

    def check_supported(self) -> None:
        """Raise InvalidField for a value this server cannot honour."""
        if self.n != 1:
            raise InvalidField("n", f"n={self.n} is not supported; only n=1")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise InvalidField(name, f"{name} is not supported yet; send 0 or omit it")

    def sampling(self, max_tokens: int | None) -> dict:
        """The Router's sampling dict (unset fields keep SamplingParams' defaults)."""
        out: dict = {}
        for name in ("temperature", "top_p", "top_k", "min_p", "seed"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if max_tokens is not None:
            out["max_tokens"] = max_tokens
        if self.stop:
            out["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        out["ignore_eos"] = self.ignore_eos
        return out

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="Text or token ids (a one-element batch is accepted)."
    )
    logprobs: int | None = Field(None, description="Not supported yet (must be unset).")

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs is not None:
            raise InvalidField("logprobs", "logprobs is not supported yet")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str | list):
            if len(self.prompt) != 1:
                raise InvalidField("prompt", "batched prompts are not supported; send one")


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    max_completion_tokens: int | None = Field(
        None, ge=1, description="Most tokens to generate (wins over max_tokens)."
    )
    logprobs: bool | None = Field(None, description="Not supported yet (must be unset/false).")
    top_logprobs: int | None = Field(None, description="Not supported yet (must be unset/0).")

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs:
            raise InvalidField("logprobs", "logprobs is not supported yet")
        if self.top_logprobs:
            raise InvalidField("top_logprobs", "top_logprobs is not supported yet")


def parse(cls: type[_Common], body: object) -> _Common:
    """Validate a JSON body; raises InvalidField naming the first bad field."""
    if not isinstance(body, dict):
        raise InvalidField(None, "the request body must be a JSON object")
    try:
        request = cls.model_validate(body)
    except ValidationError as exc:
        raise rephrase(exc) from None
    request.check_supported()
    return request


def rephrase(exc: ValidationError) -> InvalidField:
    """The first validation error as a sentence that names its field."""
    error = exc.errors(include_url=False)[0]
    loc = [str(p) for p in error["loc"] if not _union_tag(str(p))]
    field = ".".join(loc) or None
    if error["type"] == "extra_forbidden":
        return InvalidField(field, f"unsupported field '{field}': this server does not take it")
    if error["type"] == "missing":
        return InvalidField(field, f"field '{field}' is required")
    value = error.get("input")
    return InvalidField(field, f"field '{field}'={value!r} is invalid: {error['msg']}")


def _union_tag(part: str) -> bool:
    """Whether a location part names a union member (pydantic's 'str', 'list[int]', ...)."""
    return part in {"str", "int", "float", "bool"} or part.startswith(
        ("list[", "function-", "literal[", "nullable[")
    )
