"""The OpenAI-compatible HTTP front door: a second translation of Router.generate.

POST /v1/completions, /v1/chat/completions and /v1/responses (streamed as server-sent events
or not),
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

from engine.errors import InvalidRequestError
from router.admission import Admission
from router.chat_template import ChatRenderer
from router.errors import Unauthenticated, UnknownModel, classify, error_reason
from router.openai_logprobs import TokenText
from router.openai_protocol import ChatCompletionRequest, CompletionRequest, parse
from router.openai_responses import Reply, UnknownRoute, error_body
from router.openai_run import Prepared, Run, choice_options, sampling_for, session_for
from router.responses_output import ResponseBuilder
from router.responses_protocol import parse_responses
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
        chat_template: str | None = None,
    ) -> None:
        if not model_names:
            raise ValueError("model_names needs the served model's name")
        self.router = router
        self.model_names = list(model_names)
        self.tokenizer = tokenizer
        self.renderer = ChatRenderer(tokenizer, chat_template) if tokenizer is not None else None
        self.token_text = TokenText(tokenizer)
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

    async def body(self, request: Request) -> object:
        """The request's JSON body, once its API key is checked."""
        self.authorize(request)
        try:
            return await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from None

    def check_model(self, model: str) -> None:
        if model not in self.model_names:
            raise UnknownModel(
                f"model {model!r} is not served here; models: {', '.join(self.model_names)}"
            )

    async def prepare(self, req) -> Prepared:
        """Prompt ids, echo texts and sampling dicts of a parsed request."""
        limit = self.router.max_model_len
        echo_texts = None
        if isinstance(req, CompletionRequest):
            prompts = [await self._completion_ids(p) for p in req.prompts()]
            if req.echo:
                echo_texts = [
                    p if isinstance(p, str) else await self._decode(ids)
                    for p, ids in zip(req.prompts(), prompts, strict=True)
                ]
        else:
            self._need_tokenizer("messages")
            messages = [m.template_dict() for m in req.messages]
            tools = list(req.plan.offered) or None
            if self.renderer is None:  # made with the tokenizer
                raise RuntimeError("a tokenizer without a chat renderer")
            ids = await self.run(self.renderer.render, messages, tools, req.chat_template_kwargs)
            prompts = [ids]
        params = [sampling_for(req, len(ids), limit) for ids in prompts]
        options = choice_options(req, self.token_text)
        session = session_for(req, self.router)
        return Prepared(prompts, params, options, req.n, req.cache_salt, echo_texts, session)

    async def _completion_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return list(prompt)
        self._need_tokenizer("a text prompt")
        return list(await self.run(self.tokenizer.encode, prompt)) if prompt else []

    async def _decode(self, ids: list[int]) -> str:
        return await self.run(self.tokenizer.decode, ids) if self.tokenizer is not None else ""

    def _need_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise InvalidRequestError(
                f"{what} needs a tokenizer; this server takes token-id prompts only"
            )

    async def open(self, request: Request, prepared: Prepared, reply: Reply) -> Run:
        """Admit the request and start its streams; returns once each has its first output
        (a refusal before then raises its status)."""
        ticket = self.admission.admit()
        streams = []
        try:
            for i, (ids, params) in enumerate(zip(prepared.prompts, prepared.params, strict=True)):
                request_id = (
                    reply.request_id if len(prepared.prompts) == 1 else f"{reply.request_id}-{i}"
                )
                streams.append(
                    TokenStream(
                        self.router,
                        self.executor,
                        request_id,
                        ids,
                        params,
                        prepared.cache_salt,
                        prepared.session,
                    )
                )
            run = Run(streams, reply, prepared)
            await _unless_disconnected(request, run.start())
            return run
        except BaseException:
            for s in streams:
                s.close()
            raise
        finally:
            ticket.release()

    async def generate(self, request: Request, kind: str) -> Response:
        """Shared path of /v1/completions and /v1/chat/completions."""
        cls = ChatCompletionRequest if kind == "chat" else CompletionRequest
        req = parse(cls, await self.body(request))
        self.check_model(req.model)
        prepared = await self.prepare(req)
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        reply = Reply(
            f"{prefix}-{uuid.uuid4().hex[:24]}",
            req.model,
            [len(ids) for ids in prepared.prompts],
            prepared.options,
            n=req.n,
            with_token_ids=req.return_token_ids,
        )
        run = await self.open(request, prepared, reply)
        if req.stream:
            return _EventStream(
                self._events(run, req.include_usage, req.continuous_usage),
                on_close=run.close,
                media_type="text/event-stream",
                headers={"x-request-id": reply.request_id},
            )
        try:
            await collect(request, run)
            return JSONResponse(reply.body(), headers=reply.headers())
        finally:
            run.close()

    async def responses(self, request: Request) -> Response:
        """POST /v1/responses: a chat request underneath, Responses items and events."""
        req, chat = parse_responses(await self.body(request))
        self.check_model(req.model)
        prepared = await self.prepare(chat)
        reply = Reply(
            f"resp-{uuid.uuid4().hex[:24]}",
            req.model,
            [len(ids) for ids in prepared.prompts],
            prepared.options,
        )
        run = await self.open(request, prepared, reply)
        builder = ResponseBuilder(req, req.model)
        if req.stream:
            return _EventStream(
                self._response_events(run, builder),
                on_close=run.close,
                media_type="text/event-stream",
                headers={"x-request-id": reply.request_id},
            )
        try:
            await collect(request, run, lambda delta: builder.feed(delta.events))
            builder.finish(reply.choices[0].finish(), reply.usage())
            return JSONResponse(builder.body(), headers=reply.headers())
        finally:
            run.close()

    async def _response_events(self, run: Run, builder: ResponseBuilder) -> AsyncIterator[str]:
        """The Responses API's server-sent events."""
        try:
            for event in builder.start():
                yield _sse(event, event["type"])
            async for _, delta in run.deltas():
                for event in builder.feed(delta.events):
                    yield _sse(event, event["type"])
            reason = run.reply.choices[0].finish()
            for event in builder.finish(reason, run.reply.usage()):
                yield _sse(event, event["type"])
        except Exception as exc:  # noqa: BLE001 - headers are sent: the error is an event
            self.count_error(exc, _status(exc))
            yield _sse(builder.error(error_body(exc)["error"]), "error")
        finally:
            run.close()

    async def _events(self, run: Run, usage: bool, continuous: bool) -> AsyncIterator[str]:
        """Server-sent events: chunks as outputs arrive, then `data: [DONE]`."""
        reply = run.reply
        try:
            if reply.kind == "chat":
                for chunk in reply.opening_chunks():
                    yield _sse(chunk)
            async for index, delta in run.deltas():
                if not delta.empty():
                    yield _sse(reply.chunk(index, delta, usage=continuous))
            if usage:
                yield _sse(reply.usage_chunk())
        except Exception as exc:  # noqa: BLE001 - headers are sent: the error is an event
            self.count_error(exc, _status(exc))
            yield _sse(error_body(exc))
        finally:
            run.close()
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
    chat_template: str | None = None,
) -> FastAPI:
    """The FastAPI app of the OpenAI-compatible API over `router`. model_names[0] is the
    served model's name, the rest its aliases; without a tokenizer prompts must be token
    ids; metrics_text (None: /metrics is 404) returns the Prometheus exposition text;
    chat_template (Jinja) replaces the tokenizer's (router/chat_template.py)."""
    door = OpenAIDoor(router, model_names, tokenizer, api_keys, admission, chat_template)
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

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await _answer(door, door.responses(request))

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


async def collect(request: Request, run: Run, on_delta: Callable | None = None) -> None:
    """Take every output of a non-streamed request (the client leaving aborts it)."""
    deltas = run.deltas().__aiter__()
    while True:
        try:
            _, delta = await _unless_disconnected(request, deltas.__anext__())
        except StopAsyncIteration:
            break
        if on_delta is not None:
            on_delta(delta)
    run.reply.raise_if_failed()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(data: dict, event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, separators=(',', ':'))}\n\n"
