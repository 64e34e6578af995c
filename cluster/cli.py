"""`baton serve`, `baton generate` and `baton chat`: serve a local cluster, or talk to one over
gRPC (the `baton` entry point, baton/cli.py, dispatches to the *_main functions here).

baton serve [--model M] [--prefill N] [--decode N] [--host H] [--port P]
baton generate "prompt" [--max-tokens N] [--temperature T] [--address H:P]
baton chat [--system TEXT] [--address H:P]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

import grpc

from cluster.local import API_KEY_ENV, LocalCluster, LocalOptions, add_serve_flags
from deploy.manifest import ManifestError, load_manifest
from router.proto import inference_pb2 as pb
from router.proto import inference_pb2_grpc as pb_grpc


def _serve(args: argparse.Namespace) -> int:
    stop = threading.Event()
    try:  # a bad manifest, bad flags or resources Ray cannot give: exit 2
        manifest = (
            load_manifest(args.file) if args.file else LocalOptions.from_args(args).manifest()
        )
        if getattr(args, "api_key", None):  # the local router actor inherits it
            os.environ[API_KEY_ENV] = args.api_key
        cluster = LocalCluster(manifest)
        try:
            cluster.start(log=lambda m: print(m, flush=True))
            for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which sets its own
                signal.signal(sig, lambda *_: stop.set())
            http = cluster.http_address
            print(
                f"Baton is serving {manifest.spec.model.path} on {cluster.address} "
                "(gRPC baton.v1.Inference)"
                + (f" and {http} (OpenAI-compatible HTTP)" if http else "")
                + "."
                + f'\nTry:  baton generate "Hello" --address {cluster.address}'
                + (
                    f"\n      curl {http}/v1/chat/completions -H 'Content-Type: application/json' "
                    f'-d \'{{"model": "{manifest.spec.model.path}", "messages": '
                    f'[{{"role": "user", "content": "Hello"}}]}}\''
                    if http
                    else ""
                )
                + "\nCtrl-C stops everything.",
                flush=True,
            )
            while not stop.wait(0.5):
                pass
            print("\nshutting down ...", flush=True)
        finally:
            cluster.close()
    except ManifestError as exc:
        print(f"error: {args.file or 'bad flags'}:\n{exc}", file=sys.stderr)
        return 2
    print("stopped: server, workers, controller and placement groups removed", flush=True)
    return 0


def _client(args: argparse.Namespace):
    """A stub for --address: TLS when --tls-ca is given, the API key as `authorization`."""
    if args.tls_ca:
        with open(args.tls_ca, "rb") as f:
            channel = grpc.secure_channel(args.address, grpc.ssl_channel_credentials(f.read()))
    else:
        channel = grpc.insecure_channel(args.address)
    if args.api_key:
        channel = grpc.intercept_channel(channel, _BearerKey(args.api_key))
    return pb_grpc.InferenceStub(channel)


class _BearerKey(grpc.UnaryStreamClientInterceptor):
    """Adds `authorization: Bearer KEY` to each Generate call."""

    def __init__(self, key: str) -> None:
        self.metadata = (("authorization", f"Bearer {key}"),)

    def intercept_unary_stream(self, continuation, details, request):
        details = details._replace(metadata=tuple(details.metadata or ()) + self.metadata)
        return continuation(details, request)


def _stream(stub, request, timeout: float) -> tuple[int, str]:
    """Print tokens as they arrive and usage at the end; returns (exit code, text)."""
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
                print(
                    f"\n[{reply.finish_reason}] prompt {u.prompt_tokens} tokens "
                    f"({u.cached_tokens} cached), {u.completion_tokens} generated, "
                    f"TTFT {first * 1000:.0f} ms, prefill {u.prefill_worker}, "
                    f"decode {u.decode_worker}",
                    file=sys.stderr,
                )
    except grpc.RpcError as err:
        print(f"\nerror: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1, "".join(text)
    return 0, "".join(text)


def _sampling(args: argparse.Namespace):
    return pb.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)


def _generate(args: argparse.Namespace) -> int:
    if args.raw:
        request = pb.GenerateRequest(prompt=args.prompt, sampling=_sampling(args))
    else:  # instruct models answer a user turn, not raw text
        request = pb.GenerateRequest(
            messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=args.prompt)]),
            sampling=_sampling(args),
        )
    return _stream(_client(args), request, args.timeout)[0]


def _chat(args: argparse.Namespace) -> int:
    stub = _client(args)
    history = [pb.ChatMessage(role="system", content=args.system)] if args.system else []
    while True:
        try:
            line = input("you> ")
        except EOFError:
            return 0
        if not line.strip():
            continue
        history.append(pb.ChatMessage(role="user", content=line))
        request = pb.GenerateRequest(
            messages=pb.ChatMessages(messages=history), sampling=_sampling(args)
        )
        print("baton> ", end="", flush=True)
        _, answer = _stream(stub, request, args.timeout)
        history.append(pb.ChatMessage(role="assistant", content=answer))


def serve_parser() -> argparse.ArgumentParser:
    """`baton serve`'s flags: a manifest, or local.yaml with the flags applied."""
    p = argparse.ArgumentParser(
        prog="baton serve", description="Start a local Ray cluster and the gRPC server."
    )
    p.add_argument(
        "-f",
        "--file",
        help="a Baton manifest; without it, "
        "deploy/examples/local.yaml with the flags below applied",
    )
    add_serve_flags(p)  # types, choices and help: the manifest fields they set
    p.add_argument(
        "--api-key",
        help=f"clients must send this key (HTTP `Authorization: Bearer`, gRPC `authorization` "
        f"metadata); it is passed to the router in ${API_KEY_ENV}, never written to a manifest",
    )
    return p


def client_parser(name: str) -> argparse.ArgumentParser:
    """`baton generate` / `baton chat`'s flags: the server, sampling and credentials."""
    if name == "generate":
        p = argparse.ArgumentParser(prog="baton generate", description="Stream one completion.")
        p.add_argument("prompt")
        p.add_argument(
            "--raw",
            action="store_true",
            help="send the text as is instead of as a chat user turn",
        )
    else:
        p = argparse.ArgumentParser(prog="baton chat", description="Interactive chat.")
        p.add_argument("--system", default="")
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=600.0, help="deadline in seconds")
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"sent as `authorization: Bearer KEY` (default: ${API_KEY_ENV})",
    )
    p.add_argument("--tls-ca", help="PEM CA bundle: connect over TLS, trusting this CA")
    return p


def run_one_line(command: Callable[[], int]) -> int:
    """Run a command; an exception it lets through is printed as one line (exit 1), never a
    traceback; Ctrl-C exits 130."""
    try:
        return command()
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - one line, never a traceback
        # Deferred: cluster.controller pulls in ray and torch (~1.5 s), needed only here.
        from cluster.controller import short_error

        print(f"error: {short_error(exc)}", file=sys.stderr)
        return 1


def serve_main(argv: list[str]) -> int:
    """`baton serve`."""
    args = serve_parser().parse_args(argv)
    return run_one_line(lambda: _serve(args))


def generate_main(argv: list[str]) -> int:
    """`baton generate`."""
    args = client_parser("generate").parse_args(argv)
    return run_one_line(lambda: _generate(args))


def chat_main(argv: list[str]) -> int:
    """`baton chat`."""
    args = client_parser("chat").parse_args(argv)
    return run_one_line(lambda: _chat(args))
