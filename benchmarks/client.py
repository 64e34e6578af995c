"""The benchmark's gRPC client: one streamed Generate per request spec, recorded as a timeline
(benchmarks/timeline.py). It uses only the public baton.v1.Inference API."""

from __future__ import annotations

import time

import grpc

from benchmarks.timeline import OK, RequestRecord
from benchmarks.workloads import RequestSpec
from router.proto import inference_pb2 as pb
from router.proto import inference_pb2_grpc as pb_grpc


class GrpcClient:
    """An aio channel to one router; times are seconds since `start` (a perf_counter value)."""

    def __init__(self, address: str, start: float) -> None:
        self.address = address
        self.start = start
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = pb_grpc.InferenceStub(self.channel)

    def now(self) -> float:
        return time.perf_counter() - self.start

    async def workers(self, timeout: float = 30.0) -> dict[str, list[str]]:
        """Worker ids by role, from ClusterStatus."""
        status = await self.stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=timeout)
        out: dict[str, list[str]] = {}
        for w in status.workers:
            out.setdefault(w.role, []).append(w.worker_id)
        return out

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
        chunks: list[tuple[float, int]] = []
        answer: list[int] = []
        usage, status, error = None, OK, ""
        send = self.now()
        try:
            async for reply in self.stub.Generate(request, timeout=timeout):
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
        )
        return record, answer

    async def close(self) -> None:
        await self.channel.close()
