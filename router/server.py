"""The gRPC front door: baton.v1.Inference over a Router, plus grpc.health.v1 and reflection.

Errors are status codes with messages a user can act on, never a traceback: bad parameters
or an empty prompt -> INVALID_ARGUMENT, prompt over max_model_len -> OUT_OF_RANGE, admission
refused (a prompt that can never fit, or no free decode KV blocks after the router's wait) ->
RESOURCE_EXHAUSTED, no worker, or the migration limit passed -> UNAVAILABLE; a client cancel
or deadline aborts the request on its workers. Every error answer is counted by code and
reason (baton:request_errors_total{door="grpc"}). Health (router/grpc_health.py) is SERVING
while the router can serve a new request in its current shape.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.errors import InvalidRequestError, PromptTooLongError
from engine.sampling_params import SamplingParams
from router.chat_template import ChatRenderer
from router.errors import RequestFailed, grpc_labels, grpc_status, is_known
from router.grpc_health import RouterHealth
from router.proto import inference_pb2 as pb
from router.proto import inference_pb2_grpc as pb_grpc
from router.router import Router
from router.security import TLSFiles, add_port
from router.sessions import SessionHint, session_hint

logger = logging.getLogger(__name__)
SERVICE = "baton.v1.Inference"
STREAM_THREADS = 512


# Optional scalar fields of the proto's SamplingParams, passed as they are (floats rounded to
# 6 digits: a proto float is 32-bit, so 0.7 arrives as 0.699999988).
_SCALARS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "n",
)


def sampling_dict(msg: pb.SamplingParams) -> dict:
    """The proto's sampling message as SamplingParams keyword arguments (unset -> default)."""
    out: dict = {}
    for name in _SCALARS:
        if msg.HasField(name):
            value = getattr(msg, name)
            out[name] = round(value, 6) if isinstance(value, float) else value
    if msg.stop:
        out["stop"] = list(msg.stop)
    if msg.stop_token_ids:
        out["stop_token_ids"] = list(msg.stop_token_ids)
    if msg.logit_bias:
        out["logit_bias"] = {k: round(v, 6) for k, v in msg.logit_bias.items()}
    if msg.HasField("structured_output"):
        out["structured_output"] = structured_output_dict(msg.structured_output)
    out["ignore_eos"] = msg.ignore_eos
    return out


def structured_output_dict(msg: pb.StructuredOutput) -> dict:
    """The proto's constraint as the sampling dict's structured_output."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise InvalidRequestError(
            "sampling.structured_output must set one of json, json_object, regex, choice, "
            "grammar or structural_tag"
        )
    value = getattr(msg, kind)
    out = {kind: list(value.choices) if kind == "choice" else value}
    if msg.disable_any_whitespace:
        out["disable_any_whitespace"] = True
    return out


def token_logprobs(entries) -> list[pb.TokenLogprob]:
    """Worker logprob entries ([id, logprob, [[id, logprob], ...]]) as proto messages."""
    return [
        pb.TokenLogprob(
            token_id=token_id,
            logprob=logprob,
            top=[pb.TopLogprob(token_id=i, logprob=lp) for i, lp in top],
        )
        for token_id, logprob, top in entries
    ]


def session_of(request: pb.GenerateRequest) -> SessionHint | None:
    """The request's session_id / retention_seconds (InvalidRequestError naming the field)."""
    return session_hint(
        request.session_id if request.HasField("session_id") else None,
        request.retention_seconds if request.HasField("retention_seconds") else None,
    )


class InferenceServicer(pb_grpc.InferenceServicer):
    """Implements baton.v1.Inference with a Router (blocking calls run in threads)."""

    def __init__(self, router: Router, tokenizer=None, chat_template: str | None = None):
        self.router = router
        self.tokenizer = tokenizer
        self.renderer = ChatRenderer(tokenizer, chat_template) if tokenizer is not None else None

    def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("input")
        if kind == "prompt_token_ids":
            return list(request.prompt_token_ids.ids)
        if kind is None:
            raise InvalidRequestError("one of prompt, prompt_token_ids or messages is required")
        if self.tokenizer is None:
            raise InvalidRequestError(
                f"{kind} needs a tokenizer; this server takes prompt_token_ids only"
            )
        if kind == "prompt":
            return self.tokenizer.encode(request.prompt) if request.prompt else []
        messages = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.content}
            for m in request.messages.messages
        ]
        if not messages:
            raise InvalidRequestError("messages is empty")
        if self.renderer is None:  # made with the tokenizer
            raise RuntimeError("a tokenizer without a chat renderer")
        return self.renderer.render(messages)

    async def Generate(self, request, context):  # noqa: N802 - gRPC method name
        request_id = request.request_id or f"req-{uuid.uuid4().hex[:12]}"
        try:
            ids = self._prompt_ids(request)
            params = sampling_dict(request.sampling)
            SamplingParams(**params)  # validate before any worker is touched
            if not ids:
                raise InvalidRequestError("prompt is empty")
            limit = self.router.max_model_len
            if limit is not None and len(ids) >= limit:
                raise PromptTooLongError(f"prompt has {len(ids)} tokens; max_model_len is {limit}")
            session = session_of(request)
            if session is not None:
                self.router.check_session(session)
        except InvalidRequestError as exc:
            self._count(exc)
            await context.abort(grpc_status(exc), str(exc))
        stream = self.router.generate(request_id, ids, params, request.cache_salt or None, session)
        completion = 0
        try:
            while True:
                out = await asyncio.to_thread(next, stream, None)  # outputs are dicts
                if out is None:
                    return
                completion += len(out["token_ids"])
                reply = pb.GenerateResponse(
                    request_id=request_id,
                    token_ids=out["token_ids"],
                    text=out.get("text") or "",
                    index=out.get("index") or 0,
                    logprobs=token_logprobs(out.get("logprobs") or []),
                    prompt_logprobs=token_logprobs((out.get("prompt_logprobs") or [None])[1:]),
                )
                reply.finish_reason = out.get("finish_reason") or ""
                if out["finished"]:
                    if out["finish_reason"] == "error":
                        failed = RequestFailed(f"request {request_id} failed: {out['error']}")
                        self._count(failed)
                        await context.abort(grpc_status(failed), str(failed))
                    reply.usage.CopyFrom(
                        pb.Usage(
                            prompt_tokens=len(ids),
                            completion_tokens=completion,
                            cached_tokens=out["num_cached_tokens"],
                            prefill_worker=out.get("prefill_worker", ""),
                            decode_worker=out.get("decode_worker", ""),
                        )
                    )
                yield reply
                if out["finished"]:
                    return
        except asyncio.CancelledError:  # client cancel or deadline
            await asyncio.to_thread(self.router.abort, request_id)
            raise
        except grpc.aio.AbortError:  # context.abort above: the status is already set
            raise
        except Exception as exc:  # noqa: BLE001 - router/errors.py maps it; no traceback leaves
            if not is_known(exc):
                logger.error("request %s failed", request_id, exc_info=exc)
            self._count(exc)
            await context.abort(grpc_status(exc), str(exc) or type(exc).__name__)
        finally:
            stream.close()

    def _count(self, exc: BaseException) -> None:
        """A request answered with an error: baton:request_errors_total{door="grpc"}."""
        self.router.metrics.request_error("grpc", *grpc_labels(exc))

    async def Abort(self, request, context):  # noqa: N802
        found = await asyncio.to_thread(self.router.abort, request.request_id)
        return pb.AbortResponse(found=found)

    async def ClusterStatus(self, request, context):  # noqa: N802
        workers = await asyncio.to_thread(self.router.status)
        reply = pb.ClusterStatusResponse(cache_hit_rate=self.router.hit_rate())
        for w in workers:
            status = pb.WorkerStatus(worker_id=w.worker_id, role=w.role, healthy=w.healthy)
            if w.stats is not None:
                status.running_requests = w.stats.num_requests
                status.kv_usage = w.stats.kv_usage
                status.cache_hit_rate = w.stats.hit_rate
                status.free_blocks = w.stats.free_blocks
            reply.workers.append(status)
        return reply


async def start_server(
    router: Router,
    host: str = "127.0.0.1",
    port: int = 50051,
    tokenizer=None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    tls: TLSFiles | None = None,
    chat_template: str | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Start the aio server (TLS when given; interceptors such as router.security's key
    check and router.admission's bound run before the servicer; chat_template replaces the
    tokenizer's); returns (server, bound port). Port 0 picks a free one."""
    # Every open stream holds a thread while it waits for its next tokens: asyncio's default
    # pool (cpus + 4 threads) would queue streams behind each other.
    asyncio.get_running_loop().set_default_executor(
        ThreadPoolExecutor(max_workers=STREAM_THREADS, thread_name_prefix="stream")
    )
    server = grpc.aio.server(interceptors=list(interceptors))
    servicer = InferenceServicer(router, tokenizer, chat_template)
    pb_grpc.add_InferenceServicer_to_server(servicer, server)
    # SERVING while the router can serve a new request (router/readiness.py)
    health_servicer = RouterHealth(router, (SERVICE, ""))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    bound = add_port(server, f"{host}:{port}", tls)
    await server.start()
    await health_servicer.refresh()
    return server, bound
