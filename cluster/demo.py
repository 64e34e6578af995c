"""`make demo`: a local Baton cluster (1 prefill + 1 decode worker on Ray, gRPC front door)
answering questions that share a long system prompt; shows tokens streaming, the cached
tokens growing and which workers served each request, then shuts everything down."""

from __future__ import annotations

import argparse
import time

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
    cluster = LocalCluster(LocalOptions(model=args.model, port=0, kv_cache_memory_gb=0.5))
    try:
        cluster.start(log=lambda m: print(m, flush=True))
        print(f"gRPC server on {cluster.address}\n", flush=True)
        stub = pb_grpc.InferenceStub(grpc.insecure_channel(cluster.address))
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
        print(f"router prefix-cache hit rate: {status.cache_hit_rate:.2f}")
    finally:
        print("shutting down ...", flush=True)
        cluster.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
