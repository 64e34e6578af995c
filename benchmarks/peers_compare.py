"""Baton, llama.cpp's llama-server and vLLM's CPU build on the same model, workload and seed,
one server at a time, one table per workload.

    python -m benchmarks.peers_compare                      # the full comparison (quiet machine)
    python -m benchmarks.peers_compare --quick              # a few requests: does it all run?
    python -m benchmarks.peers_compare --servers baton,llamacpp --streams 4 --num-requests 32

Each server is started (benchmarks/peers.py; Baton as a local cluster, aggregated unless
--baton-shape disaggregated), driven through its /v1/completions by `baton bench --url`'s
code (perf/bench/side_by_side.py: warm-up requests one at a time, then the workload at S
concurrent streams, the same seed for every server), and stopped before the next starts.
llama-server is started again for each stream count with --parallel S (its slots). Workloads:
shared-prefix (a 2,000-token system prompt shared by every request + a 64-token user turn)
and short-prompt (256-token random prompts), --output-len tokens each (greedy, exactly that
many). A server that does not start is reported with its reason and the others still run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks import peers
from perf.bench.driver import BenchConfig
from perf.bench.side_by_side import Target, parse_streams, run_target, side_by_side_table
from perf.bench.workloads import SharedPrefixWorkload, ShortPromptWorkload, TokenSpace

SERVERS = ("baton", "llamacpp", "vllm")
LABELS = {"baton": "baton", "llamacpp": "llama.cpp", "vllm": "vllm"}


def workloads(names: list[str], output_len: int, quick: bool) -> dict:
    system, user, prompt = (64, 8, 32) if quick else (2000, 64, 256)
    known = {
        "shared-prefix": SharedPrefixWorkload(system, user, output_len),
        "short-prompt": ShortPromptWorkload(prompt, output_len),
    }
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"--workloads takes {', '.join(known)}; got {unknown}")
    return {n: known[n] for n in names}


def start_baton(shape: str, threads: int, log, engine: dict | None = None):
    """A local Baton cluster (Ray in this process) with its HTTP door on a free port;
    `engine`: engine options over local.yaml's."""
    from cluster.local import LocalCluster, LocalOptions

    prefill = 0 if shape == "aggregated" else 1
    options = LocalOptions(
        model=peers.MODEL,
        prefill=prefill,
        decode=1,
        port=0,
        http_port=0,
        threads=threads,
        engine_extra=dict(engine or {}),
    )
    return LocalCluster(options).start(log=log)


def engine_option(text: str) -> tuple[str, object]:
    """KEY=VALUE (the value as JSON, else the string) as (key, value)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--baton-engine takes KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def note_settings(server: peers.Server, label: str, results: dict) -> None:
    """A peer started with settings beyond its documented ones: printed under the tables."""
    if server.settings:
        results.setdefault("_settings", {})[label] = server.settings


def run_server(kind, plan, tokens, config, streams, args, results, log) -> None:
    """Every (workload, stream count) of `plan` on one kind of server, into results
    {workload: {streams: {label: summary}}}; a server that cannot start is logged."""
    label = LABELS[kind]

    def measure(url: str, counts: list[int]) -> None:
        target = Target(label, url, model=None if kind == "baton" else peers.ALIAS)
        for name, workload in plan.items():
            for n in counts:
                log(f"{label}: {name}, {n} streams")
                summary, _ = run_target(target, workload, tokens, config, n, args.warmup)
                results.setdefault(name, {}).setdefault(n, {})[label] = summary

    try:
        if kind == "baton":
            cluster = start_baton(args.baton_shape, args.baton_threads, log, args.baton_engine)
            try:
                measure(cluster.http_address, streams)
            finally:
                cluster.close()
        elif kind == "llamacpp":
            for n in streams:  # its slots are fixed at start: one start per stream count
                with peers.start("llamacpp", parallel=n, log=log) as server:
                    note_settings(server, label, results)
                    measure(server.url, [n])
        else:
            with peers.start(kind, log=log) as server:
                note_settings(server, label, results)
                measure(server.url, streams)
    except (RuntimeError, FileNotFoundError, OSError) as exc:
        log(f"{label}: not run: {exc}")
        results.setdefault("_not_run", {})[label] = str(exc)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.peers_compare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--servers", default=",".join(SERVERS), help="of: " + ",".join(SERVERS))
    p.add_argument("--workloads", default="shared-prefix,short-prompt")
    p.add_argument("--streams", default="1,4,16")
    p.add_argument("--num-requests", type=int, default=32, help="per (server, workload, S)")
    p.add_argument("--output-len", type=int, help="tokens per answer (default 64, --quick 8)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--baton-shape", choices=("aggregated", "disaggregated"), default="aggregated")
    p.add_argument("--baton-threads", type=int, default=2, help="torch threads per worker")
    p.add_argument(
        "--baton-engine",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an engine option for Baton (JSON value), e.g. decode_stretch=0; repeatable",
    )
    p.add_argument("--quick", action="store_true", help="short prompts, 2 requests, 1 stream")
    p.add_argument("--out", help="directory for peers.json")
    args = p.parse_args(argv)
    try:
        kinds = [k for k in args.servers.split(",") if k]
        if not kinds or any(k not in SERVERS for k in kinds):
            raise ValueError(f"--servers takes {', '.join(SERVERS)}; got {args.servers!r}")
        streams = [1] if args.quick else parse_streams(args.streams)
        args.output_len = args.output_len or (8 if args.quick else 64)
        plan = workloads([w for w in args.workloads.split(",") if w], args.output_len, args.quick)
        args.baton_engine = dict(engine_option(o) for o in args.baton_engine)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from engine.model_resolver import resolve_model
    from engine.tokenizer import load_tokenizer

    tokens = TokenSpace.from_tokenizer(load_tokenizer(resolve_model(peers.MODEL)))
    requests = 2 if args.quick else args.num_requests
    config = BenchConfig(num_requests=requests, seed=args.seed, timeout_s=args.timeout)
    results: dict = {}

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    for kind in kinds:
        run_server(kind, plan, tokens, config, streams, args, results, log)
    not_run = results.pop("_not_run", {})
    settings = results.pop("_settings", {})
    for name, by_streams in results.items():
        title = f"{name} (seed {args.seed}, {requests} requests a run, {args.output_len} tokens)"
        print(side_by_side_table(dict(sorted(by_streams.items())), title) + "\n")
    for label, reason in not_run.items():
        print(f"{label}: not run: {reason.splitlines()[0]}")
    for label, why in settings.items():
        print(f"{label}: {why}")
    if args.out:
        path = Path(args.out) / "peers.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        runs = [
            {"workload": w, "streams": n, "label": label, "summary": summary}
            for w, by_streams in results.items()
            for n, by_label in by_streams.items()
            for label, summary in by_label.items()
        ]
        record = {"runs": runs, "not_run": not_run, "settings": settings}
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(f"results: {path}")
    failed = any(s["failed"] for b in results.values() for x in b.values() for s in x.values())
    return 1 if failed or not_run else 0


if __name__ == "__main__":
    sys.exit(main())
