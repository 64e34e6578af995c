"""`make demo`: a local Baton cluster (1 prefill + 1 decode worker on Ray, gRPC front door)
answering questions that share a long system prompt; shows tokens streaming, the cached
tokens growing and which workers served each request, then the same cluster through its
OpenAI-compatible HTTP door (a `curl` of /v1/chat/completions) and a few lines of its
Prometheus /metrics, then shuts everything down."""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import time
import urllib.request

import grpc

from cluster.local import LocalCluster, LocalOptions
from engine.demo import QUESTIONS, SYSTEM
from router.proto import inference_pb2 as pb
from router.proto import inference_pb2_grpc as pb_grpc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--max-tokens", type=int, default=40)
    args = p.parse_args(argv)
    cluster = LocalCluster(
        LocalOptions(model=args.model, port=0, http_port=0, kv_cache_memory_gb=0.5)
    )
    try:
        cluster.start(log=lambda m: print(m, flush=True))
        address, http_address = cluster.address, cluster.http_address
        if address is None or http_address is None:  # start() sets both (HTTP is asked for)
            raise RuntimeError("the local cluster did not report its addresses")
        print(f"gRPC server on {address}\n", flush=True)
        stub = pb_grpc.InferenceStub(grpc.insecure_channel(address))
        for question in QUESTIONS:
            request = pb.GenerateRequest(
                messages=pb.ChatMessages(
                    messages=[
                        pb.ChatMessage(role="system", content=SYSTEM),
                        pb.ChatMessage(role="user", content=question),
                    ]
                ),
                sampling=pb.SamplingParams(max_tokens=args.max_tokens, temperature=0.0),
            )
            print(f"Q: {question}\nA: ", end="", flush=True)
            start, first = time.perf_counter(), None
            for reply in stub.Generate(request, timeout=300):
                first = first or time.perf_counter() - start
                print(reply.text, end="", flush=True)
                if reply.finish_reason:
                    u = reply.usage
                    print(
                        f"\n   prompt {u.prompt_tokens} tokens, cached {u.cached_tokens}, "
                        f"TTFT {first * 1000:.0f} ms, {u.completion_tokens} tokens, "
                        f"prefill {u.prefill_worker} -> decode {u.decode_worker}\n",
                        flush=True,
                    )
        status = stub.ClusterStatus(pb.ClusterStatusRequest())
        for w in status.workers:
            print(
                f"{w.worker_id:10} {w.role:8} healthy={w.healthy} kv_usage={w.kv_usage:.3f} "
                f"cache_hit_rate={w.cache_hit_rate:.2f}"
            )
        print(f"router prefix-cache hit rate: {status.cache_hit_rate:.2f}\n")
        show_http(http_address, args.model, SYSTEM, QUESTIONS[0], args.max_tokens)
    finally:
        print("shutting down ...", flush=True)
        cluster.close()
    return 0


# Series of /metrics the demo prints (one line each, summed over their labels).
METRIC_LINES = (
    "baton:time_to_first_token_seconds_count",
    "baton:e2e_request_latency_seconds_count",
    "baton:prompt_tokens_total",
    "baton:prefix_cache_hits_total",
    "baton:kv_transfer_bytes_total",
)


def show_http(base: str, model: str, system: str, question: str, max_tokens: int) -> None:
    """curl one chat completion over HTTP, then print a few /metrics lines."""
    body = json.dumps(
        {
            "model": model,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
    )
    url = f"{base}/v1/chat/completions"
    command = ["curl", "-s", url, "-H", "Content-Type: application/json", "-d", body]
    shown = f"curl -s {url} -H 'Content-Type: application/json' -d '{{...}}'"
    print(f"$ {shown}", flush=True)
    if shutil.which("curl"):
        out = subprocess.run(command, capture_output=True, text=True, timeout=300).stdout
    else:  # the same request without curl
        request = urllib.request.Request(url, body.encode(), {"Content-Type": "application/json"})
        out = urllib.request.urlopen(request, timeout=300).read().decode()
    reply = json.loads(out)
    print(json.dumps(reply, indent=1)[:1500], flush=True)
    print(f"\n$ curl -s {base}/metrics | grep ...", flush=True)
    text = urllib.request.urlopen(f"{base}/metrics", timeout=60).read().decode()
    for name in METRIC_LINES:
        values = [line for line in text.splitlines() if line.startswith(name)]
        for line in values[:3]:
            print(line)
    print(f"(full: curl {shlex.quote(base + '/metrics')})\n", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
