"""A stream of greedy gRPC requests that runs while a deploy command changes the cluster."""

from __future__ import annotations

import threading
import time

import grpc

from router.proto import inference_pb2 as pb
from router.proto import inference_pb2_grpc as pb_grpc
from tests.helpers import random_prompts

MAX_TOKENS = 24


def stream_prompt(k: int) -> list[int]:
    """The k-th request's prompt: every one is new, so no cached prefix pulls it to the old
    workers (cache-aware routing sends a new prompt to the emptier cache)."""
    return random_prompts([9 + (7 * k) % 45], seed=10_000 + k)[0]


class RequestStream:
    """Threads sending greedy requests back to back until stopped; records every outcome."""

    def __init__(self, address: str, threads: int = 3) -> None:
        self.stub = pb_grpc.InferenceStub(grpc.insecure_channel(address))
        self.results: list[tuple[int, list[int], str, str, str]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(threads)]

    def __enter__(self) -> RequestStream:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)

    def _run(self, offset: int) -> None:
        k = offset
        while not self._stop.is_set():
            request = pb.GenerateRequest(
                prompt_token_ids=pb.TokenIds(ids=stream_prompt(k)),
                sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
            )
            try:
                replies = list(self.stub.Generate(request, timeout=120))
            except grpc.RpcError as err:
                self.errors.append(f"{err.code().name}: {err.details()}")
                continue
            last = replies[-1]
            self.results.append(
                (
                    k,
                    [t for r in replies for t in r.token_ids],
                    last.finish_reason,
                    last.usage.prefill_worker,
                    last.usage.decode_worker,
                )
            )
            k += len(self._threads)

    def wait_for(self, count: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while len(self.results) < count and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(self.results) >= count, (len(self.results), self.errors)
