"""OpenAI response bodies, stream chunks and error bodies, built from Router.generate's
output dicts and from exceptions (router.errors gives the status)."""

from __future__ import annotations

import logging
import time

from router.errors import INTERNAL, RequestFailed, classify

logger = logging.getLogger(__name__)

# The engine's finish reasons as OpenAI's ("abort": stopped by the server, not the model).
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


def raise_if_failed(request_id: str, finish_reason: str | None, error: str | None) -> None:
    """Raise RequestFailed for an output that says the request failed (a worker's error, or
    the router's deadline)."""
    if finish_reason == "error" or (finish_reason == "abort" and error):
        raise RequestFailed(f"request {request_id} failed: {error}")


class Reply:
    """One request's reply as it streams in: add() each output, then body() or chunks."""

    def __init__(
        self, kind: str, request_id: str, model: str, prompt_tokens: int, with_token_ids: bool
    ) -> None:
        self.kind = kind  # "chat" or "completion"
        self.request_id = request_id
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.with_token_ids = with_token_ids
        self.created = int(time.time())
        self.text = ""
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.cached_tokens = 0
        self.workers = {"prefill_worker": "", "decode_worker": ""}

    def add(self, out: dict) -> None:
        """Take one output dict of Router.generate."""
        self.text += out.get("text") or ""
        self.token_ids += out["token_ids"]
        self.cached_tokens = out.get("num_cached_tokens") or 0
        if out["finished"]:
            self.finish_reason = out["finish_reason"]
            self.error = out.get("error")
            for name in self.workers:
                self.workers[name] = out.get(name) or ""

    def raise_if_failed(self) -> None:
        """Raise RequestFailed when a worker reported the request as failed."""
        raise_if_failed(self.request_id, self.finish_reason, self.error)

    def usage(self) -> dict:
        completion = len(self.token_ids)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def headers(self) -> dict:
        return {
            "x-request-id": self.request_id,
            "x-baton-prefill-worker": self.workers["prefill_worker"],
            "x-baton-decode-worker": self.workers["decode_worker"],
        }

    def body(self) -> dict:
        """The whole (non-streamed) response."""
        choice: dict = {"index": 0, "finish_reason": self._finish(), "logprobs": None}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": self.text}
        else:
            choice["text"] = self.text
        if self.with_token_ids:
            choice["token_ids"] = self.token_ids
        return {
            **self._head("chat.completion" if self.kind == "chat" else "text_completion"),
            "choices": [choice],
            "usage": self.usage(),
            "baton": dict(self.workers),
        }

    def chunk(self, out: dict | None, *, role: bool = False, final: bool = False) -> dict:
        """A stream chunk with `out`'s new text (role=True: the chat's opening chunk);
        final=True: the last chunk, which also names the workers."""
        text = (out.get("text") or "") if out else ""
        finished = bool(out and out["finished"])
        choice: dict = {
            "index": 0,
            "finish_reason": self._finish() if finished else None,
            "logprobs": None,
        }
        if self.kind == "chat":
            choice["delta"] = {"role": "assistant", "content": ""} if role else {"content": text}
        else:
            choice["text"] = text
        if self.with_token_ids:
            choice["token_ids"] = list(out["token_ids"]) if out else []
        chunk = {**self._head(self._chunk_object()), "choices": [choice]}
        if final:
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

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def _head(self, obj: str) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    def _finish(self) -> str | None:
        return FINISH_REASONS.get(self.finish_reason or "", self.finish_reason)


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
