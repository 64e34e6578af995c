"""The OpenAI-compatible HTTP front door: a second translation of Router.generate.

POST /v1/completions and /v1/chat/completions (streamed as server-sent events or not),
GET /v1/models, /health and /metrics. /health is open: 200 while the router can serve a new
request in its current shape, else 503 (router/readiness.py; the body names the healthy
pools). Each request is checked once before it reaches the router's queue: API key, body,
model, prompt length, sampling values, then admission. Errors use OpenAI's shape with the
status from router.errors, each one counted (baton:request_errors_total{door="http"}); a
client that goes away aborts its request on both workers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import InvalidRequestError, PromptTooLongError
from engine.sampling_params import SamplingParams
from router.admission import Admission
from router.errors import Unauthenticated, UnknownModel, classify, error_reason
from router.openai_protocol import ChatCompletionRequest, CompletionRequest, parse
from router.openai_responses import Reply, UnknownRoute, error_body, raise_if_failed
from router.router import Router
from router.security import ApiKeys
from router.stream import TokenStream

logger = logging.getLogger(__name__)
STREAM_THREADS = 512  # every open stream holds a thread while it waits for tokens
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class OpenAIDoor:
    """What the routes share: the router, the served names and the checks before it."""

    def __init__(
        self,
        router: Router,
        model_names: Sequence[str],
        tokenizer=None,
        api_keys: ApiKeys | None = None,
        admission: Admission | None = None,
    ) -> None:
        if not model_names:
            raise ValueError("model_names needs the served model's name")
        self.router = router
        self.model_names = list(model_names)
        self.tokenizer = tokenizer
        self.api_keys = api_keys or ApiKeys()
        self.admission = admission or Admission()
        self.executor = ThreadPoolExecutor(STREAM_THREADS, thread_name_prefix="http-stream")
        self.created = int(time.time())

    def close(self) -> None:
        """Let the stream threads go (after the server stopped)."""
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def run(self, fn, *args):
        """fn(*args) on a pool thread (Router and tokenizer calls block)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def authorize(self, request: Request) -> None:
        if not self.api_keys.check(request.headers.get("authorization")):
            raise Unauthenticated("missing or invalid API key (Authorization: Bearer <key>)")

    async def prompt_ids(self, req) -> list[int]:
        """The prompt as token ids: given ids, encoded text or the chat template's output."""
        if isinstance(req, CompletionRequest):
            prompt = req.prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
                prompt = prompt[0]  # a one-element batch
            if isinstance(prompt, list):
                return list(prompt)
            self._need_tokenizer("a text prompt")
            return list(await self.run(self.tokenizer.encode, prompt)) if prompt else []
        self._need_tokenizer("messages")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        ids = await self.run(
            lambda: self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True
            )
        )
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def _need_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise InvalidRequestError(
                f"{what} needs a tokenizer; this server takes token-id prompts only"
            )

    def sampling(self, req, n_prompt: int) -> dict:
        """The validated sampling dict; the prompt must leave room for one new token."""
        limit = self.router.max_model_len
        if not n_prompt:
            raise InvalidRequestError("prompt is empty")
        if limit is not None and n_prompt >= limit:
            raise PromptTooLongError(
                f"prompt has {n_prompt} tokens; this model's maximum context length is "
                f"{limit} tokens (including at least one generated token)"
            )
        max_tokens = req.max_tokens
        if isinstance(req, ChatCompletionRequest):
            max_tokens = req.max_completion_tokens or max_tokens
            if max_tokens is None and limit is not None:
                max_tokens = limit - n_prompt  # chat: until the end of the context
        params = req.sampling(max_tokens)
        SamplingParams(**params)  # raises InvalidRequestError naming the field
        return params

    async def generate(self, request: Request, kind: str) -> Response:
        """Shared path of both generation endpoints."""
        self.authorize(request)
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from None
        req = parse(ChatCompletionRequest if kind == "chat" else CompletionRequest, body)
        if req.model not in self.model_names:
            raise UnknownModel(
                f"model {req.model!r} is not served here; models: {', '.join(self.model_names)}"
            )
        ids = await self.prompt_ids(req)
        params = self.sampling(req, len(ids))
        ticket = self.admission.admit()
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        request_id = f"{prefix}-{uuid.uuid4().hex[:24]}"
        stream = TokenStream(self.router, self.executor, request_id, ids, params, req.cache_salt)
        reply = Reply(kind, request_id, req.model, len(ids), req.return_token_ids)
        try:
            # The first output comes before any byte is sent: a refusal (no worker, no KV)
            # is still an HTTP status, also for a streamed request.
            first = await _unless_disconnected(request, stream.next())
            ticket.release()
            if first is not None and first["finished"]:  # failed before any token: a status
                raise_if_failed(request_id, first["finish_reason"], first.get("error"))
            if req.stream:
                return _EventStream(
                    self._events(stream, reply, first, req.include_usage),
                    on_close=stream.close,
                    media_type="text/event-stream",
                    headers={"x-request-id": request_id},
                )
            out = first
            while out is not None:
                reply.add(out)
                out = await _unless_disconnected(request, stream.next())
            reply.raise_if_failed()
            return JSONResponse(reply.body(), headers=reply.headers())
        except BaseException:
            stream.close()
            raise
        finally:
            ticket.release()
            if not req.stream:
                stream.close()

    async def _events(
        self, stream: TokenStream, reply: Reply, first: dict, usage: bool
    ) -> AsyncIterator[str]:
        """Server-sent events: chunks as outputs arrive, then `data: [DONE]`."""
        try:
            out = first
            if reply.kind == "chat":
                yield _sse(reply.chunk(None, role=True))
            while out is not None:
                reply.add(out)
                if out["finished"]:
                    reply.raise_if_failed()
                    yield _sse(reply.chunk(out, final=not usage))
                    if usage:
                        yield _sse(reply.usage_chunk())
                else:
                    yield _sse(reply.chunk(out))
                out = await stream.next()
        except Exception as exc:  # noqa: BLE001 - headers are sent: the error is an event
            self.count_error(exc, _status(exc))
            yield _sse(error_body(exc))
        finally:
            stream.close()
        yield "data: [DONE]\n\n"

    async def models(self, request: Request) -> Response:
        """GET /v1/models: the served name and its aliases."""
        self.authorize(request)
        card = {"object": "model", "created": self.created, "owned_by": "baton"}
        card["max_model_len"] = self.router.max_model_len
        data = [{"id": name, **card} for name in self.model_names]
        return JSONResponse({"object": "list", "data": data})

    async def metrics(self, request: Request, metrics_text: Callable[[], str] | None) -> Response:
        """GET /metrics: the Prometheus text (404 when no metrics function is given)."""
        self.authorize(request)
        if metrics_text is None:
            raise UnknownRoute("metrics are not enabled on this server")
        return Response(await self.run(metrics_text), media_type=METRICS_CONTENT_TYPE)

    # ---- health and error counts ---------------------------------------------------------
    def health(self) -> Response:
        """GET /health: 200 while a new request can be served, 503 otherwise."""
        ready = self.router.readiness()
        return JSONResponse(ready.body(), status_code=200 if ready.serving else 503)

    def count_error(self, exc: BaseException, status: int) -> None:
        """A request answered with an error: baton:request_errors_total{door="http"}."""
        reason = "unknown_route" if isinstance(exc, UnknownRoute) else error_reason(exc)
        self.router.metrics.request_error("http", status, reason)


def create_app(
    router: Router,
    model_names: Sequence[str],
    *,
    tokenizer=None,
    api_keys: ApiKeys | None = None,
    admission: Admission | None = None,
    metrics_text: Callable[[], str] | None = None,
) -> FastAPI:
    """The FastAPI app of the OpenAI-compatible API over `router`. model_names[0] is the
    served model's name, the rest its aliases; without a tokenizer prompts must be token
    ids; metrics_text (None: /metrics is 404) returns the Prometheus exposition text."""
    door = OpenAIDoor(router, model_names, tokenizer, api_keys, admission)
    app = FastAPI(title="Baton", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.door = door

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        unknown = UnknownRoute(str(exc.detail))
        door.count_error(unknown, exc.status_code)
        return JSONResponse(error_body(unknown), exc.status_code)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _answer(door, door.generate(request, "completion"))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _answer(door, door.generate(request, "chat"))

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await _answer(door, door.models(request))

    @app.get("/health")
    async def health() -> Response:
        return door.health()

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return await _answer(door, door.metrics(request, metrics_text))

    return app


class _EventStream(StreamingResponse):
    """A streamed response that runs on_close however it ends, also when the client left
    before the first chunk (then the body's generator never starts, nor its finally)."""

    def __init__(self, content, on_close: Callable[[], None], **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _answer(door: OpenAIDoor, work) -> Response:
    """The route's response, or its error in OpenAI's shape, counted (a client gone:
    nothing, as nobody is answered)."""
    try:
        return await work
    except ClientGone:
        return Response(status_code=499)
    except Exception as exc:  # noqa: BLE001 - every failure becomes an error body
        status = _status(exc)
        door.count_error(exc, status)
        return JSONResponse(error_body(exc), status_code=status)


def _status(exc: BaseException) -> int:
    return 404 if isinstance(exc, UnknownRoute) else classify(exc).http_status


class ClientGone(Exception):
    """The client closed the connection before the response was ready."""


async def _unless_disconnected(request: Request, work):
    """Await `work`, raising ClientGone as soon as the client disconnects."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        raise ClientGone()
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"
