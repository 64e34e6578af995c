"""One HTTP generation request from its parsed body to the Router's streams: prompts (text,
ids or rendered chat), sampling dicts checked by SamplingParams, then one Router.generate
stream per prompt, run concurrently and merged as their outputs arrive."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.errors import InvalidRequestError, PromptTooLongError
from engine.sampling_params import SamplingParams
from router.openai_choices import ChoiceOptions, Delta
from router.openai_logprobs import TokenText
from router.openai_protocol import ChatCompletionRequest, CompletionRequest, InvalidField
from router.openai_responses import Reply, raise_if_failed
from router.sessions import SessionFieldError, SessionHint, session_hint
from router.stream import TokenStream, merged

# SamplingParams names a bad field `sampling.<name>` (structured_output's: `structured_output.`)
_SAMPLING_FIELD = re.compile(r"\bsampling\.([a-z_]+)|\b(structured_output)\b")


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request ready for the router: per prompt its ids, echo text and sampling dict."""

    prompts: list[list[int]]
    params: list[dict]
    options: ChoiceOptions
    n: int
    cache_salt: str | None
    echo_texts: list[str] | None = None  # completions' echo: each prompt's text
    session: SessionHint | None = None  # the session_id / retention_seconds extension


class Run:
    """The streams of one prepared request (one per prompt) and its Reply."""

    def __init__(self, streams: list[TokenStream], reply: Reply, prepared: Prepared) -> None:
        self.streams = streams
        self.reply = reply
        self.prepared = prepared
        self.firsts: list[dict | None] = []
        self._echoed: set[int] = set()  # choices whose prompt was echoed
        self._prompt_logprobs: dict[int, list] = {}  # per prompt, from its first output

    async def start(self) -> None:
        """Each stream's first output (concurrently): a refusal before any token (no worker,
        no KV, a worker's failure) is still an HTTP status, also for a streamed request."""
        self.firsts = list(await asyncio.gather(*(s.next() for s in self.streams)))
        for first in self.firsts:
            if first is not None and first["finished"]:
                raise_if_failed(self.reply.request_id, first["finish_reason"], first.get("error"))

    async def deltas(self) -> AsyncIterator[tuple[int, Delta]]:
        """(choice index, Delta) as outputs arrive: an echoed prompt's text first."""
        echo = self.prepared.echo_texts
        async for i, out in merged(self.streams, self.firsts):
            if out.get("prompt_logprobs") is not None:
                self._prompt_logprobs.setdefault(i, out["prompt_logprobs"])
            index = i * self.prepared.n + (out.get("index") or 0)
            if echo is not None and index not in self._echoed:
                self._echoed.add(index)
                choice = self.reply.choices[index]
                prompt_logprobs = self._prompt_logprobs.get(i)
                yield index, choice.echo(echo[i], self.prepared.prompts[i], prompt_logprobs)
            if out["finished"]:
                raise_if_failed(self.reply.request_id, out["finish_reason"], out.get("error"))
            choice, delta = self.reply.add(out, i)
            yield choice.index, delta

    def close(self) -> None:
        for s in self.streams:
            s.close()


def session_for(req, router) -> SessionHint | None:
    """The request's session_id / retention_seconds, checked against the router's bound
    (InvalidField naming the field)."""
    try:
        session = session_hint(req.session_id, req.retention_seconds)
        if session is not None:
            router.check_session(session)
    except SessionFieldError as exc:
        raise InvalidField(exc.field, str(exc)) from None
    return session


def check_prompt(n_prompt: int, limit: int | None) -> None:
    """The prompt must leave room for one new token."""
    if not n_prompt:
        raise InvalidRequestError("prompt is empty")
    if limit is not None and n_prompt >= limit:
        raise PromptTooLongError(
            f"prompt has {n_prompt} tokens; this model's maximum context length is "
            f"{limit} tokens (including at least one generated token)"
        )


def sampling_for(req, n_prompt: int, limit: int | None) -> dict:
    """The validated sampling dict of one prompt; a value SamplingParams refuses is a 400
    naming the request field it came from."""
    check_prompt(n_prompt, limit)
    max_tokens = req.max_tokens
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens or max_tokens
        if max_tokens is None and limit is not None:
            max_tokens = limit - n_prompt  # chat: until the end of the context
    if max_tokens == 0:  # echo only: generate one token and drop it
        max_tokens = 1
    params = req.sampling(max_tokens)
    try:
        SamplingParams(**params)
    except InvalidRequestError as exc:
        raise InvalidField(_request_field(req, str(exc)), str(exc)) from None
    return params


def _request_field(req, message: str) -> str | None:
    """The request field behind a SamplingParams error's `sampling.<name>`."""
    found = _SAMPLING_FIELD.search(message)
    if found is None:
        return None
    name = found.group(1) or found.group(2)
    chat = isinstance(req, ChatCompletionRequest)
    if name == "structured_output":
        return req.constraint_param
    if name == "logprobs":
        return "top_logprobs" if chat else "logprobs"
    if name == "prompt_logprobs":
        return "logprobs"
    if name == "max_tokens" and chat and req.max_completion_tokens is not None:
        return "max_completion_tokens"
    return name


def choice_options(req, token_text: TokenText) -> ChoiceOptions:
    """How the request's choices are shaped."""
    if isinstance(req, CompletionRequest):
        return ChoiceOptions(
            "completion",
            token_text,
            logprobs=req.logprobs is not None,
            drop_generated=req.max_tokens == 0,
        )
    plan = req.plan
    return ChoiceOptions(
        "chat",
        token_text,
        logprobs=bool(req.logprobs),
        parser_calls=plan.max_calls if plan.parses_calls else 0,
    )
