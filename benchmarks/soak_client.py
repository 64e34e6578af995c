"""The soak benchmark's clients: a gRPC client that outlives router restarts, and the router's
migration counter summed over them."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import grpc

from perf.bench.client import GrpcClient
from router.proto import inference_pb2_grpc as pb_grpc

MIGRATIONS = "baton:request_migrations_total"
REFUSED_BACKOFF_S = 0.5


class MigrationCounter:
    """Polls the router's /metrics; sums the migration counter's rises, treating a drop as a
    router restart (its counter starts again at 0)."""

    def __init__(self, url: str, period_s: float = 2.0) -> None:
        self.url, self.period_s = url, period_s
        self.total, self._last = 0.0, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="migrations")

    def start(self) -> MigrationCounter:
        self._last = self._read() or 0.0
        self._thread.start()
        return self

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(30)
        self._poll()
        return int(self.total)

    def _read(self) -> float | None:
        import httpx

        try:
            text = httpx.get(self.url, timeout=10.0, trust_env=False).text
        except httpx.HTTPError:
            return None  # the router is restarting
        for line in text.splitlines():
            if line.startswith(MIGRATIONS):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def _poll(self) -> None:
        value = self._read()
        if value is None:
            return
        self.total += value - self._last if value >= self._last else value
        self._last = value

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._poll()


class SoakClient(GrpcClient):
    """The bench's gRPC client as a patient client uses it: it reconnects within a second
    after a router restart (gRPC's default backoff grows to minutes), and a request refused
    at once because no router listens (it never reached one) is sent again after
    REFUSED_BACKOFF_S, within its timeout; `refused` counts those retries. A stream cut
    mid-way is not retried: it counts as failed, as its client saw it."""

    def __init__(self, address: str, start: float) -> None:
        super().__init__(address, start)
        self.channel = grpc.aio.insecure_channel(
            address,
            options=[
                ("grpc.max_reconnect_backoff_ms", 1000),
                ("grpc.initial_reconnect_backoff_ms", 200),
            ],
        )
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.refused = 0

    async def generate(self, spec, run_id: str, timeout: float):
        first_send = self.now()
        deadline = first_send + timeout
        while True:
            record, answer = await super().generate(spec, run_id, timeout)
            record = replace(record, send_s=first_send)  # latency includes the resends
            never_reached = (
                record.status == "UNAVAILABLE"
                and not record.chunks
                and ("failed to connect" in record.error or "Connection refused" in record.error)
            )
            if not never_reached or self.now() + REFUSED_BACKOFF_S > deadline:
                return record, answer
            self.refused += 1
            await asyncio.sleep(REFUSED_BACKOFF_S)
            timeout = deadline - self.now()
