"""OpenAI response bodies, stream chunks and error bodies, built from Router.generate's
output dicts and from exceptions (router.errors gives the status).

A reply has len(prompts) * n choices: the output of prompt i with choice index j (the
worker's `index`, for n > 1) is choice i * n + j. Usage counts every prompt once and every
choice's tokens.
"""

from __future__ import annotations

import logging
import time

from router.errors import INTERNAL, RequestFailed, classify
from router.openai_choices import Choice, ChoiceOptions, Delta

logger = logging.getLogger(__name__)


def raise_if_failed(request_id: str, finish_reason: str | None, error: str | None) -> None:
    """Raise RequestFailed for an output that says the request failed (a worker's error, or
    the router's deadline)."""
    if finish_reason == "error" or (finish_reason == "abort" and error):
        raise RequestFailed(f"request {request_id} failed: {error}")


class Reply:
    """One HTTP request's reply as its outputs stream in: add() each, then body() or chunks."""

    def __init__(
        self,
        request_id: str,
        model: str,
        prompt_tokens: list[int],
        options: ChoiceOptions,
        *,
        n: int = 1,
        with_token_ids: bool = False,
    ) -> None:
        self.kind = options.kind  # "chat" or "completion"
        self.request_id = request_id
        self.model = model
        self.prompt_tokens = prompt_tokens  # per prompt
        self.n = n
        self.with_token_ids = with_token_ids
        self.created = int(time.time())
        self.choices = [Choice(i, options) for i in range(len(prompt_tokens) * n)]
        self.cached_tokens = [0] * len(prompt_tokens)
        self.finish_reason: str | None = None  # a failure's, for raise_if_failed
        self.error: str | None = None
        self.workers = {"prefill_worker": "", "decode_worker": ""}

    def add(self, out: dict, prompt: int = 0) -> tuple[Choice, Delta]:
        """Take one output dict of Router.generate for prompt `prompt`."""
        choice = self.choices[prompt * self.n + (out.get("index") or 0)]
        self.cached_tokens[prompt] = out.get("num_cached_tokens") or 0
        if out["finished"]:
            if out["finish_reason"] in ("error", "abort") and out.get("error"):
                self.finish_reason, self.error = out["finish_reason"], out.get("error")
            for name in self.workers:
                self.workers[name] = out.get(name) or self.workers[name]
        return choice, choice.add(out)

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)

    def raise_if_failed(self) -> None:
        """Raise RequestFailed when a worker reported the request as failed."""
        raise_if_failed(self.request_id, self.finish_reason, self.error)

    def usage(self) -> dict:
        prompt = sum(self.prompt_tokens)
        completion = sum(0 if c.options.drop_generated else len(c.token_ids) for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens)},
        }

    def headers(self) -> dict:
        return {
            "x-request-id": self.request_id,
            "x-baton-prefill-worker": self.workers["prefill_worker"],
            "x-baton-decode-worker": self.workers["decode_worker"],
        }

    def body(self) -> dict:
        """The whole (non-streamed) response."""
        choices = []
        for c in self.choices:
            choice = c.body()
            if self.with_token_ids:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        return {
            **self._head("chat.completion" if self.kind == "chat" else "text_completion"),
            "choices": choices,
            "usage": self.usage(),
            "baton": dict(self.workers),
        }

    def opening_chunks(self) -> list[dict]:
        """Chat's first chunk of each choice: the assistant role."""
        opening: dict = {"delta": {"role": "assistant", "content": ""}}
        if self.with_token_ids:
            opening["token_ids"] = []
        return [self._chunk(c.index, opening, None) for c in self.choices]

    def chunk(self, index: int, delta: Delta, *, usage: bool = False) -> dict:
        """A stream chunk with one choice's delta; the last chunk of the reply also names the
        workers; usage=True: it carries the usage so far (continuous_usage_stats)."""
        if self.kind == "chat":
            body: dict = {"content": delta.text}
            if delta.tool_calls:
                body["tool_calls"] = delta.tool_calls
            choice: dict = {"delta": body}
            logprobs: dict | list | None = (
                {"content": delta.logprobs, "refusal": None} if delta.logprobs else None
            )
        else:
            choice = {"text": delta.text}
            logprobs = delta.logprobs
        if self.with_token_ids:
            choice["token_ids"] = delta.token_ids
        chunk = self._chunk(index, choice, delta.finish_reason, logprobs)
        if usage:
            chunk["usage"] = self.usage()
        if self.finished and delta.finish_reason:
            chunk["baton"] = dict(self.workers)
        return chunk

    def usage_chunk(self) -> dict:
        """The last chunk when stream_options.include_usage: no choices, the usage."""
        return {
            **self._head(self._chunk_object()),
            "choices": [],
            "usage": self.usage(),
            "baton": dict(self.workers),
        }

    def _chunk(self, index: int, choice: dict, finish: str | None, logprobs=None) -> dict:
        entry = {"index": index, **choice, "finish_reason": finish, "logprobs": logprobs}
        return {**self._head(self._chunk_object()), "choices": [entry]}

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def _head(self, obj: str) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}


class UnknownRoute(Exception):
    """A path this server does not serve."""


def error_body(exc: BaseException) -> dict:
    """{"error": {message, type, param, code}} for `exc` (logged when unexpected)."""
    kind = classify(exc)
    if kind is INTERNAL and not isinstance(exc, RequestFailed | UnknownRoute):
        logger.error("request failed", exc_info=exc)
    error_type = "not_found_error" if isinstance(exc, UnknownRoute) else kind.openai_type
    return {
        "error": {
            "message": str(exc) or type(exc).__name__,
            "type": error_type,
            "param": getattr(exc, "param", None),
            "code": kind.openai_code,
        }
    }
