"""The benchmark's clients: one streamed request per request spec, recorded as a timeline
(perf/bench/timeline.py). GrpcClient uses only the public baton.v1.Inference API, HttpClient
only the OpenAI-compatible /v1/completions (streamed, token-id prompts; router/openai_http.py).
scrape_counters reads, from a /metrics page, the counters a run's summary takes the rise of: the
KV bytes the prefill workers sent, each worker's engine steps and their time, the bytes loaded
from KV tiers and the decode -> prefill pulls (their count, bytes and the router's decisions)."""

from __future__ import annotations

import json
import sys
import time

import grpc
import httpx

from perf.bench.servers import chunk_tokens, reconcile, request_fields, server_kind
from perf.bench.timeline import OK, RequestRecord
from perf.bench.workloads import RequestSpec
from router.proto import inference_pb2 as pb
from router.proto import inference_pb2_grpc as pb_grpc


class GrpcClient:
    """An aio channel to one router; times are seconds since `start` (a perf_counter value)."""

    def __init__(self, address: str, start: float, api_key: str | None = None) -> None:
        self.address = address
        self.start = start
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None

    def now(self) -> float:
        return time.perf_counter() - self.start

    async def workers(self, timeout: float = 30.0) -> dict[str, list[str]]:
        """Worker ids by role, from ClusterStatus."""
        status = await self.stub.ClusterStatus(
            pb.ClusterStatusRequest(), timeout=timeout, metadata=self.metadata
        )
        out: dict[str, list[str]] = {}
        for w in status.workers:
            out.setdefault(w.role, []).append(w.worker_id)
        return out

    async def kv_blocks(self, timeout: float = 30.0) -> int:
        """The largest decode worker's KV blocks, from ClusterStatus (free blocks count the
        evictable cached ones: on an idle cluster, all of them)."""
        status = await self.stub.ClusterStatus(
            pb.ClusterStatusRequest(), timeout=timeout, metadata=self.metadata
        )
        return max((w.free_blocks for w in status.workers if w.role == "decode"), default=0)

    async def generate(
        self, spec: RequestSpec, run_id: str, timeout: float
    ) -> tuple[RequestRecord, list[int]]:
        """Stream one request greedily to exactly max_tokens tokens; (record, answer ids).
        A failure is recorded with its status code, never raised."""
        request = pb.GenerateRequest(
            request_id=f"{run_id}-{spec.request_id}",
            prompt_token_ids=pb.TokenIds(ids=spec.prompt_token_ids),
            sampling=pb.SamplingParams(
                max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True
            ),
            cache_salt=spec.cache_salt or "",
        )
        if spec.session_id is not None:  # unique per run, as the request ids are
            request.session_id = f"{run_id}-{spec.session_id}"
            if spec.retention_seconds is not None:
                request.retention_seconds = spec.retention_seconds
        chunks: list[tuple[float, int]] = []
        answer: list[int] = []
        usage, status, error = None, OK, ""
        send = self.now()
        try:
            async for reply in self.stub.Generate(request, timeout=timeout, metadata=self.metadata):
                if reply.token_ids:
                    chunks.append((self.now(), len(reply.token_ids)))
                    answer += reply.token_ids
                if reply.HasField("usage"):
                    usage = reply.usage
        except grpc.aio.AioRpcError as exc:
            status, error = exc.code().name, exc.details() or ""
        record = RequestRecord(
            request_id=spec.request_id,
            send_s=send,
            end_s=self.now(),
            chunks=tuple(chunks),
            prompt_tokens=len(spec.prompt_token_ids),
            cached_tokens=usage.cached_tokens if usage else 0,
            prefill_worker=usage.prefill_worker if usage else "",
            decode_worker=usage.decode_worker if usage else "",
            status=status,
            error=error,
            kind=spec.kind,
            tenant=spec.tenant,
            server_request_id=request.request_id,
        )
        return record, answer

    async def close(self) -> None:
        await self.channel.close()


RETRIES = 1  # sends again of a request whose connection closed before any reply (see below)


class HttpClient:
    """Keep-alive httpx connections to an OpenAI-compatible server's /v1/completions (a
    Baton router's HTTP door, or another server: base URL such as http://127.0.0.1:8000);
    times are seconds since `start`. `model`: the name sent in each request (None: the first
    one /v1/models lists); `kind`: the server's (perf/bench/servers.py; None: from
    /v1/models), which decides the fields that make an answer exactly max_tokens long.
    A request whose kept-alive connection the server closed before it sent any reply (a
    server closes idle or used-up connections as it likes: llama-server's after 5 s idle or
    100 requests) is sent again, once, on a fresh connection: it was never seen."""

    def __init__(
        self,
        url: str,
        start: float,
        api_key: str | None = None,
        model: str | None = None,
        kind: str | None = None,
    ) -> None:
        self.address = url.rstrip("/")
        self.start = start
        self.model = model
        self.kind = kind
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.http = httpx.AsyncClient(
            base_url=self.address, headers=headers, limits=limits, timeout=None, trust_env=False
        )

    def now(self) -> float:
        return time.perf_counter() - self.start

    async def workers(self, timeout: float = 30.0) -> dict[str, list[str]]:
        """The HTTP door has no ClusterStatus: no worker list (load balance counts the workers
        the records name). Learns the model name and the server's kind from /v1/models when
        they were not given."""
        if self.model is None or self.kind is None:
            reply = await self.http.get("/v1/models", timeout=timeout)
            reply.raise_for_status()
            self.model = self.model or reply.json()["data"][0]["id"]
            self.kind = self.kind or server_kind(reply.json())
        return {}

    async def generate(
        self, spec: RequestSpec, run_id: str, timeout: float
    ) -> tuple[RequestRecord, list[int]]:
        """Stream one request greedily to exactly max_tokens tokens; (record, answer ids).
        A failure is recorded as HTTP_<status> (or the stream's error type), never raised."""
        body = {
            "model": self.model,
            "prompt": list(spec.prompt_token_ids),
            "max_tokens": spec.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            **request_fields(self.kind or "baton", spec.max_tokens),
        }
        if spec.cache_salt:
            body["cache_salt"] = spec.cache_salt
        if spec.session_id is not None:  # unique per run, as the request ids are
            body["session_id"] = f"{run_id}-{spec.session_id}"
            if spec.retention_seconds is not None:
                body["retention_seconds"] = spec.retention_seconds
        chunks: list[tuple[float, int]] = []
        answer: list[int] = []
        cached, status, error, server_id = 0, OK, "", ""
        workers: dict[str, str] = {}  # the last chunk's "baton": the workers that served it
        completion_tokens = None
        send = self.now()
        for attempt in range(RETRIES + 1):
            replied = False
            try:
                async with self.http.stream(
                    "POST", "/v1/completions", json=body, timeout=timeout
                ) as reply:
                    replied = True
                    server_id = reply.headers.get("x-request-id", "")
                    if reply.status_code != 200:
                        status, error = f"HTTP_{reply.status_code}", _message(await reply.aread())
                    else:
                        async for line in reply.aiter_lines():
                            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                                continue
                            event = json.loads(line[5:])
                            if "error" in event:
                                status, error = _error_status(event["error"]), _message(event)
                                continue
                            count = 0
                            for choice in event.get("choices") or []:
                                got = chunk_tokens(choice)
                                count += got if isinstance(got, int) else len(got)
                                answer += [] if isinstance(got, int) else got
                            if count:
                                chunks.append((self.now(), count))
                            usage = event.get("usage") or {}
                            completion_tokens = usage.get("completion_tokens", completion_tokens)
                            details = usage.get("prompt_tokens_details") or {}
                            cached = details.get("cached_tokens", cached) or 0
                            workers = event.get("baton") or workers
            except httpx.TimeoutException as exc:
                status, error = "DEADLINE_EXCEEDED", str(exc)
            except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
                if not replied and attempt < RETRIES:
                    continue  # a kept-alive connection the server closed as this was sent
                status, error = "UNAVAILABLE", f"{type(exc).__name__}: {exc}"
            except httpx.HTTPError as exc:
                status, error = "UNAVAILABLE", f"{type(exc).__name__}: {exc}"
            break
        if status == OK:
            reconcile(chunks, completion_tokens)
        record = RequestRecord(
            request_id=spec.request_id,
            send_s=send,
            end_s=self.now(),
            chunks=tuple(chunks),
            prompt_tokens=len(spec.prompt_token_ids),
            cached_tokens=cached,
            prefill_worker=workers.get("prefill_worker", ""),
            decode_worker=workers.get("decode_worker", ""),
            status=status,
            error=error,
            kind=spec.kind,
            tenant=spec.tenant,
            server_request_id=server_id,
        )
        return record, answer

    async def close(self) -> None:
        await self.http.aclose()


def _message(raw: bytes | dict) -> str:
    """An OpenAI error body's message (or the raw text)."""
    try:
        data = json.loads(raw) if isinstance(raw, bytes) else raw
        return str(data["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw.decode(errors="replace")[:500] if isinstance(raw, bytes) else str(raw)


def _error_status(error: dict) -> str:
    """A mid-stream error event (headers already sent as 200): its code or type."""
    code = error.get("code")
    return f"HTTP_{code}" if isinstance(code, int) else str(error.get("type") or "STREAM_ERROR")


KV_BYTES = "baton:kv_transfer_bytes_total"
KV_SECONDS = "baton:kv_transfer_time_seconds_sum"
KV_TRANSFERS = "baton:kv_transfer_time_seconds_count"
STEP_SECONDS = "baton:engine_step_duration_seconds_sum"
STEPS = "baton:engine_step_duration_seconds_count"
# Summed over workers (by the label named, if any): the KV tier's and the pulls' figures.
SUMMED = {
    "tier_read_bytes": ("baton:kv_tier_read_bytes_total", None),
    "tier_written_bytes": ("baton:kv_tier_written_bytes_total", None),
    "tier_dropped_writes": ("baton:kv_tier_dropped_writes_total", None),
    "tier_loads": ("baton:kv_tier_load_seconds_count", None),
    "tier_load_s": ("baton:kv_tier_load_seconds_sum", None),
    "pulls": ("baton:kv_pull_seconds_count", None),
    "pull_bytes": ("baton:kv_pull_bytes_total", None),
    "pull_decisions": ("baton:router_pull_decisions_total", "decision"),
}


async def scrape_counters(url: str, api_key: str | None = None, timeout: float = 30.0):
    """{"kv_bytes": KV bytes sent, summed over workers (None if no worker reports them),
    "kv_time": [transfers, seconds] summed over workers, "steps": {worker: [steps, seconds]}}
    from the Prometheus text at `url` (a /metrics page);
    None (with a warning on stderr) when the page cannot be read, e.g. 404: metrics are not
    enabled, or 401: a wrong key."""
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(headers=headers, timeout=timeout, trust_env=False) as http:
            reply = await http.get(url)
    except httpx.HTTPError as exc:
        print(f"no metrics: {url}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None
    if reply.status_code != 200:
        print(f"no metrics: {url}: HTTP {reply.status_code}", file=sys.stderr)
        return None
    kv_bytes, kv_time = None, [0.0, 0.0]
    steps: dict[str, list[float]] = {}  # worker -> [steps, their seconds]
    sums: dict[str, float] = {}  # SUMMED key (":" label value) -> total
    by_name = {name: (key, label) for key, (name, label) in SUMMED.items()}
    for family in text_string_to_metric_families(reply.text):
        for sample in family.samples:
            if sample.name in by_name:
                key, label = by_name[sample.name]
                key = f"{key}:{sample.labels.get(label, '')}" if label else key
                sums[key] = sums.get(key, 0.0) + sample.value
            if sample.name == KV_BYTES:
                kv_bytes = (kv_bytes or 0.0) + sample.value
            elif sample.name in (KV_TRANSFERS, KV_SECONDS):
                kv_time[sample.name == KV_SECONDS] += sample.value
            elif sample.name in (STEPS, STEP_SECONDS):
                worker = steps.setdefault(sample.labels.get("worker", ""), [0.0, 0.0])
                worker[sample.name == STEP_SECONDS] += sample.value
    return {"kv_bytes": kv_bytes, "kv_time": kv_time, "steps": steps, "sums": sums}


def counter_rise(before: dict, after: dict) -> dict:
    """What scrape_counters' figures rose by over a run: {"kv_bytes_moved": int or None,
    "kv_transfers", "kv_transfer_s" (their summed time: prefill done -> decode side
    acknowledges), "engine_steps": {worker: {"steps", "busy_s"}}} (a worker absent before
    counts from 0)."""
    moved = None
    if before["kv_bytes"] is not None and after["kv_bytes"] is not None:
        moved = int(after["kv_bytes"] - before["kv_bytes"])
    steps = {}
    for worker, (n, seconds) in sorted(after["steps"].items()):
        n_before, seconds_before = before["steps"].get(worker, (0.0, 0.0))
        steps[worker] = {"steps": int(n - n_before), "busy_s": round(seconds - seconds_before, 6)}
    (transfers_before, kv_s_before), (transfers, kv_s) = before["kv_time"], after["kv_time"]
    summed = {k: v - before.get("sums", {}).get(k, 0.0) for k, v in after.get("sums", {}).items()}
    return {
        "kv_bytes_moved": moved,
        "kv_transfers": int(transfers - transfers_before),
        "kv_transfer_s": round(kv_s - kv_s_before, 6),
        "engine_steps": steps,
        # the KV tier's bytes loaded and written, writes dropped, loads and their summed
        # time, and the decode -> prefill pulls over the run
        "tier_read_bytes": int(summed.get("tier_read_bytes", 0)),
        "tier_written_bytes": int(summed.get("tier_written_bytes", 0)),
        "tier_dropped_writes": int(summed.get("tier_dropped_writes", 0)),
        "tier_loads": int(summed.get("tier_loads", 0)),
        "tier_load_s": round(summed.get("tier_load_s", 0.0), 6),
        "pulls": int(summed.get("pulls", 0)),
        "pull_bytes": int(summed.get("pull_bytes", 0)),
        "pull_decisions": {
            k.partition(":")[2]: int(v)
            for k, v in summed.items()
            if k.startswith("pull_decisions:")
        },
    }
