"""`baton`: serve a local cluster, or talk to one over gRPC.

    baton serve [--model M] [--prefill N] [--decode N] [--host H] [--port P]
    baton generate "prompt" [--max-tokens N] [--temperature T] [--address H:P]
    baton chat [--system TEXT] [--address H:P]
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cluster.local import LocalOptions


def local_options(manifest) -> LocalOptions:
    """LocalOptions of a validated deploy.manifest.Manifest (single-machine serving)."""
    from cluster.local import LocalOptions

    spec = manifest.spec
    engine = spec.engine.model_dump(exclude_none=True)
    extra = {k: v for k, v in engine.items() if k not in ("block_size", "chunk_size",
                                                           "kv_cache_memory_gb")}
    extra["dtype"] = spec.model.dtype
    if spec.prefill.resources != spec.decode.resources:
        raise ValueError("baton serve runs every worker with the same resources; use the "
                         "same spec.prefill.resources and spec.decode.resources")
    return LocalOptions(
        model=spec.model.path, prefill=spec.prefill.replicas, decode=spec.decode.replicas,
        host=spec.router.host, port=spec.router.port, policy=spec.router.policy,
        block_size=spec.engine.block_size, chunk_size=spec.engine.chunk_size,
        kv_cache_memory_gb=spec.engine.kv_cache_memory_gb,
        local_prefill_tokens=spec.router.local_prefill_tokens,
        resources=dict(spec.prefill.resources), engine_extra=extra,
        transfer=spec.transfer.model_dump())


def _serve(args: argparse.Namespace) -> int:
    from cluster.local import LocalCluster, LocalOptions

    if args.file:
        from deploy.manifest import ManifestError, load_manifest

        try:
            options = local_options(load_manifest(args.file))
        except (ManifestError, ValueError) as exc:
            print(f"error: {args.file}:\n{exc}", file=sys.stderr)
            return 2
    else:
        options = LocalOptions(model=args.model, prefill=args.prefill, decode=args.decode,
                               host=args.host, port=args.port, policy=args.policy,
                               block_size=args.block_size, chunk_size=args.chunk_size,
                               kv_cache_memory_gb=args.kv_cache_memory_gb,
                               threads=args.threads,
                               local_prefill_tokens=args.local_prefill_tokens)
    stop = threading.Event()
    cluster = LocalCluster(options)
    try:
        cluster.start(log=lambda m: print(m, flush=True))
        for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs its own
            signal.signal(sig, lambda *_: stop.set())
        print(f"Baton is serving {args.model} on {cluster.address} (gRPC baton.v1.Inference)."
              f"\nTry:  baton generate \"Hello\" --address {cluster.address}\n"
              "Ctrl-C stops everything.", flush=True)
        while not stop.wait(0.5):
            pass
        print("\nshutting down ...", flush=True)
    finally:
        cluster.close()
    print("stopped: server, workers, controller and placement group removed", flush=True)
    return 0


def _client(address: str):
    import grpc

    from router.proto import inference_pb2_grpc as pb_grpc

    return pb_grpc.InferenceStub(grpc.insecure_channel(address))


def _stream(stub, request, timeout: float) -> tuple[int, str]:
    """Print tokens as they arrive and usage at the end; returns (exit code, text)."""
    import grpc

    start = time.perf_counter()
    first = None
    text = []
    try:
        for reply in stub.Generate(request, timeout=timeout):
            if first is None:
                first = time.perf_counter() - start
            text.append(reply.text)
            print(reply.text, end="", flush=True)
            if reply.finish_reason:
                u = reply.usage
                print(f"\n[{reply.finish_reason}] prompt {u.prompt_tokens} tokens "
                      f"({u.cached_tokens} cached), {u.completion_tokens} generated, "
                      f"TTFT {first * 1000:.0f} ms, prefill {u.prefill_worker}, "
                      f"decode {u.decode_worker}", file=sys.stderr)
    except grpc.RpcError as err:
        print(f"\nerror: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1, "".join(text)
    return 0, "".join(text)


def _sampling(args: argparse.Namespace):
    from router.proto import inference_pb2 as pb

    return pb.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)


def _generate(args: argparse.Namespace) -> int:
    from router.proto import inference_pb2 as pb

    if args.raw:
        request = pb.GenerateRequest(prompt=args.prompt, sampling=_sampling(args))
    else:  # instruct models answer a user turn, not raw text
        request = pb.GenerateRequest(
            messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=args.prompt)]),
            sampling=_sampling(args))
    return _stream(_client(args.address), request, args.timeout)[0]


def _chat(args: argparse.Namespace) -> int:
    from router.proto import inference_pb2 as pb

    stub = _client(args.address)
    history = [pb.ChatMessage(role="system", content=args.system)] if args.system else []
    while True:
        try:
            line = input("you> ")
        except EOFError:
            return 0
        if not line.strip():
            continue
        history.append(pb.ChatMessage(role="user", content=line))
        request = pb.GenerateRequest(messages=pb.ChatMessages(messages=history),
                                     sampling=_sampling(args))
        print("baton> ", end="", flush=True)
        _, answer = _stream(stub, request, args.timeout)
        history.append(pb.ChatMessage(role="assistant", content=answer))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="baton", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start a local Ray cluster and the gRPC server")
    serve.add_argument("-f", "--file", help="a Baton manifest (deploy/examples/local.yaml); "
                                            "its values replace the flags below")
    serve.add_argument("--model", default="smollm2-135m-instruct")
    serve.add_argument("--prefill", type=int, default=1, help="prefill workers")
    serve.add_argument("--decode", type=int, default=1, help="decode workers")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=50051)
    serve.add_argument("--policy", default="cache_aware",
                       help="cache_aware | round_robin | least_loaded | random")
    serve.add_argument("--block-size", type=int, default=16)
    serve.add_argument("--chunk-size", type=int, default=1024)
    serve.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    serve.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    serve.add_argument("--local-prefill-tokens", type=int, default=0,
                       help="prefill on the decode worker (no KV transfer) when its uncached "
                            "tail is at most this many tokens; 0 always disaggregates")
    serve.set_defaults(run=_serve)
    for name, fn, text in (("generate", _generate, "stream one completion"),
                           ("chat", _chat, "interactive chat")):
        p = sub.add_parser(name, help=text)
        if name == "generate":
            p.add_argument("prompt")
            p.add_argument("--raw", action="store_true",
                           help="send the text as is instead of as a chat user turn")
        else:
            p.add_argument("--system", default="")
        p.add_argument("--address", default="127.0.0.1:50051")
        p.add_argument("--max-tokens", type=int, default=128)
        p.add_argument("--temperature", type=float, default=0.0)
        p.add_argument("--timeout", type=float, default=600.0, help="deadline in seconds")
        p.set_defaults(run=fn)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
