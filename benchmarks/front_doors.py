"""Front-door overhead: one request through gRPC vs the OpenAI HTTP API vs Router.generate.

    python -m benchmarks.front_doors [--model smollm2-135m-instruct] [-n 40] [--json FILE]

One process: a Router over in-process prefill + decode workers, and both front doors (gRPC
`Generate`, FastAPI/uvicorn OpenAI completions) served on free loopback ports from one asyncio
loop in a background thread, as the router actor serves them. Every request sends the same
token-id prompt (cached after the first, so prefill is tiny), greedy, ignore_eos, one at a
time. The doors alternate request by request and round by round, so a drift of a shared
machine's speed hits them alike:

  (a) max_tokens=1: end-to-end latency = the per-request overhead of each door;
  (b) max_tokens=32 streamed: time to first token and the mean gap between tokens.

Each door's overhead is its median minus the median of Router.generate iterated directly in
this thread (no door, no serialization, no socket).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import sys
import threading
import time
import uuid

import grpc
import httpx
import torch

from decode_worker.worker import DecodeWorker
from perf.stats import percentile
from prefill_worker.worker import PrefillWorker
from router.http_server import start_http_server
from router.openai_http import create_app
from router.proto import inference_pb2 as pb
from router.proto import inference_pb2_grpc as pb_grpc
from router.router import Router
from router.server import start_server

MODEL_NAME = "bench"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "n/a"


class Sample:
    """One request's timings in seconds: end to end, first token, and each token's arrival."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.arrivals: list[tuple[float, int]] = []  # (time, tokens in this message)
        self.end = start

    def tokens(self, n: int) -> None:
        if n:
            self.arrivals.append((time.perf_counter(), n))

    def done(self) -> Sample:
        self.end = time.perf_counter()
        return self

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def ttft(self) -> float:
        return self.arrivals[0][0] - self.start

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.arrivals)

    @property
    def itl(self) -> float:
        """Mean gap between tokens after the first (messages carrying several tokens count
        each one)."""
        return (self.arrivals[-1][0] - self.arrivals[0][0]) / max(1, self.num_tokens - 1)


# ---- the doors: each sends one request and returns its Sample --------------------------------
class Direct:
    """Router.generate iterated in this thread: the baseline every door adds to."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def send(self, prompt: list[int], max_tokens: int, stream: bool) -> Sample:
        params = dict(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        s = Sample(time.perf_counter())
        for out in self.router.generate(f"direct-{uuid.uuid4().hex[:12]}", prompt, params):
            s.tokens(len(out["token_ids"]))
        return s.done()


class GrpcDoor:
    def __init__(self, port: int) -> None:
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = pb_grpc.InferenceStub(self.channel)

    def send(self, prompt: list[int], max_tokens: int, stream: bool) -> Sample:
        req = pb.GenerateRequest(
            prompt_token_ids=pb.TokenIds(ids=prompt),
            sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        )
        s = Sample(time.perf_counter())
        for reply in self.stub.Generate(req, timeout=120):
            s.tokens(len(reply.token_ids))
        return s.done()

    def close(self) -> None:
        self.channel.close()


class HttpDoor:
    """POST /v1/completions over one keep-alive httpx connection; streamed or not."""

    def __init__(self, port: int, nodelay: bool = True) -> None:
        # TCP_NODELAY on the client's socket, as grpc sets on its own, so that only the
        # server's side differs between the doors.
        nodelay = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)] if nodelay else []
        self.client = httpx.Client(
            base_url=f"http://127.0.0.1:{port}",
            timeout=120,
            transport=httpx.HTTPTransport(socket_options=nodelay),
        )

    def body(self, prompt: list[int], max_tokens: int, stream: bool) -> dict:
        return dict(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
            return_token_ids=True,
            stream=stream,
        )

    def send(self, prompt: list[int], max_tokens: int, stream: bool) -> Sample:
        body = self.body(prompt, max_tokens, stream)
        s = Sample(time.perf_counter())
        if not stream:
            r = self.client.post("/v1/completions", json=body)
            r.raise_for_status()
            s.tokens(len(r.json()["choices"][0]["token_ids"]))
            return s.done()
        with self.client.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"stream error: {chunk['error']}")
                for choice in chunk.get("choices", []):
                    s.tokens(len(choice.get("token_ids") or []))
        return s.done()

    def close(self) -> None:
        self.client.close()


# ---- serving -----------------------------------------------------------------------------------
class Serving:
    """Router over an in-process worker pair, both doors on one loop in a daemon thread."""

    def __init__(self, options: dict) -> None:
        self.p, self.d = PrefillWorker("p0", options), DecodeWorker("d0", options)
        self.d.connect_prefill("p0", self.p.connect_decode("d0", self.d), self.p)
        self.router = Router(
            {"p0": self.p},
            {"d0": self.d},
            block_size=options["block_size"],
            hash_seed="baton",
            max_model_len=options["max_model_len"],
        )
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.grpc_server, self.grpc_port = self.run(start_server(self.router, port=0))
        app = create_app(self.router, [MODEL_NAME])
        self.http_server, self.http_port = self.run(start_http_server(app, "127.0.0.1", 0))

    def run(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.run(self.http_server.stop(grace=1.0))
        self.run(self.grpc_server.stop(1))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
        self.p.shutdown()
        self.d.shutdown()


def measure(doors: dict, prompt: list[int], n: int, max_tokens: int, stream_of: dict) -> dict:
    """n rounds; in each, every door sends one request (the order rotates every round)."""
    samples: dict[str, list[Sample]] = {name: [] for name in doors}
    names = list(doors)
    for i in range(n):
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            s = doors[name].send(prompt, max_tokens, stream_of[name])
            if s.num_tokens != max_tokens:
                raise RuntimeError(f"{name}: {s.num_tokens} tokens, expected {max_tokens}")
            samples[name].append(s)
    return samples


def summary(samples: list[Sample], streamed: bool) -> dict:
    out = {}
    metrics = {"e2e": [s.e2e for s in samples]}
    if streamed:
        metrics["ttft"] = [s.ttft for s in samples]
        if samples[0].num_tokens > 1:
            metrics["itl"] = [s.itl for s in samples]
    for key, xs in metrics.items():
        out[f"{key}_p50_ms"] = 1000 * percentile(xs, 50)
        out[f"{key}_p90_ms"] = 1000 * percentile(xs, 90)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("-n", "--num-requests", type=int, default=40, help="per door and mode")
    p.add_argument("--stream-tokens", type=int, default=32, help="max_tokens of mode (b)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--warmup", type=int, default=3, help="uncounted requests per door")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    options = dict(
        model=args.model,
        dtype="float32",
        block_size=16,
        kv_cache_memory_gb=0.25,
        max_model_len=2048,
    )
    log(f"loading {args.model} into a prefill and a decode worker")
    serving = Serving(options)
    grpc_door, http_door = GrpcDoor(serving.grpc_port), HttpDoor(serving.http_port)
    all_doors = {
        "direct": Direct(serving.router),
        "grpc": grpc_door,
        "http": http_door,
        "http-sse": http_door,
    }
    stream_of = {"direct": True, "grpc": True, "http": False, "http-sse": True}
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(100, 10000, (args.prompt_len,), generator=g).tolist()
    figures: dict[str, dict] = {}
    load_before = loadavg()
    try:
        log(f"warm-up: {args.warmup} requests per door")
        measure(all_doors, prompt, args.warmup, 2, stream_of)
        log(f"(a) max_tokens=1: {args.num_requests} rounds x {len(all_doors)} doors")
        a = measure(all_doors, prompt, args.num_requests, 1, stream_of)
        figures["a"] = {name: summary(xs, streamed=False) for name, xs in a.items()}
        doors_b = {k: v for k, v in all_doors.items() if k != "http"}
        log(f"(b) max_tokens={args.stream_tokens} streamed: {args.num_requests} rounds x 3 doors")
        b = measure(doors_b, prompt, args.num_requests, args.stream_tokens, stream_of)
        figures["b"] = {name: summary(xs, streamed=True) for name, xs in b.items()}
    finally:
        grpc_door.close()
        http_door.close()
        serving.close()
    load_after = loadavg()

    print(
        f"machine: {os.cpu_count()} cores, {cpu_model()}; load {load_before} before, "
        f"{load_after} after; model {args.model}; prompt {args.prompt_len} token ids (cached), "
        f"N={args.num_requests} per door and mode; torch threads {args.threads}"
    )

    def row(door: str, key: str, table: dict) -> str:
        f = table[door]
        base = table["direct"][f"{key}_p50_ms"]
        over = f[f"{key}_p50_ms"] - base
        return (
            f"{f[f'{key}_p50_ms']:9.2f} {f[f'{key}_p90_ms']:9.2f} "
            f"{'-' if door == 'direct' else f'{over:+.2f}':>9}"
        )

    print("\n(a) max_tokens=1, end-to-end latency (ms)")
    print(f"{'door':10} {'p50':>9} {'p90':>9} {'overhead':>9}")
    for door in figures["a"]:
        print(f"{door:10} {row(door, 'e2e', figures['a'])}")
    print(
        f"\n(b) max_tokens={args.stream_tokens} streamed (ms): TTFT p50 / p90 / overhead, "
        "inter-token gap p50 / p90 / overhead, end-to-end p50"
    )
    print(
        f"{'door':10} {'ttft p50':>9} {'p90':>9} {'overhead':>9} {'itl p50':>9} {'p90':>9} ", end=""
    )
    print(f"{'overhead':>9} {'e2e p50':>9}")
    for door, f in figures["b"].items():
        print(
            f"{door:10} {row(door, 'ttft', figures['b'])} {row(door, 'itl', figures['b'])} "
            f"{f['e2e_p50_ms']:9.2f}"
        )
    a_, b_ = figures["a"], figures["b"]
    diff = {
        "a_e2e_http_minus_grpc_ms": a_["http"]["e2e_p50_ms"] - a_["grpc"]["e2e_p50_ms"],
        "a_e2e_sse_minus_grpc_ms": a_["http-sse"]["e2e_p50_ms"] - a_["grpc"]["e2e_p50_ms"],
        "b_ttft_sse_minus_grpc_ms": b_["http-sse"]["ttft_p50_ms"] - b_["grpc"]["ttft_p50_ms"],
        "b_itl_sse_minus_grpc_ms": b_["http-sse"]["itl_p50_ms"] - b_["grpc"]["itl_p50_ms"],
    }
    print(
        "\nHTTP - gRPC (medians, ms): "
        f"(a) non-streamed {diff['a_e2e_http_minus_grpc_ms']:+.2f}, "
        f"SSE {diff['a_e2e_sse_minus_grpc_ms']:+.2f}; "
        f"(b) TTFT {diff['b_ttft_sse_minus_grpc_ms']:+.2f}, "
        f"inter-token gap {diff['b_itl_sse_minus_grpc_ms']:+.3f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(
                    figures=figures,
                    http_minus_grpc=diff,
                    cores=os.cpu_count(),
                    cpu=cpu_model(),
                    load=[load_before, load_after],
                    model=args.model,
                    n=args.num_requests,
                ),
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
