"""`baton bench`: drive a running Baton cluster with a workload and report what it did.

    baton bench --address 127.0.0.1:50051 --workload agentic \\
        --num-requests 200 --request-rate 4 --slo ttft=500,tpot=50 --out runs/agentic
    baton bench --manifest deploy/examples/local.yaml --workload long-prompt ...
    baton bench --door http --address http://127.0.0.1:8000 --api-key K ...
    baton bench compare runs/a runs/b [--out runs/compare.png]
    baton bench --url http://127.0.0.1:8000 --label baton --url http://127.0.0.1:8080 \
        --label llama.cpp --workload shared-prefix --streams 1,4,16 --num-requests 32

The cluster is reached only through a public front door: gRPC (default) or, with --door http,
the OpenAI-compatible /v1/completions (streamed, token-id prompts); how requests are paced is
perf/bench/driver.py's docstring. The same --seed gives the same arrivals and prompts (and,
greedy as every request is, the same answers). With --manifest a local cluster (Ray in this
process) is started for the run and torn down after it. With --url (repeated) any
OpenAI-compatible servers are driven one after another with the same workload and seed and
shown side by side (perf/bench/side_by_side.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from dataclasses import replace
from pathlib import Path

from perf.bench.driver import BenchConfig, bench
from perf.bench.flags import add_run_args, run_config, workload_options
from perf.bench.report import compare_table, parse_slo, table
from perf.bench.timeline import RequestRecord, read_results, write_results
from perf.bench.workloads import TokenSpace, make_workload


class Progress:
    """A progress bar on stderr: tqdm where installed, else a plain updating line."""

    def __init__(self, total: int | None, enabled: bool = True) -> None:
        self.total, self.done, self.enabled, self.bar = total, 0, enabled, None
        if enabled:
            with contextlib.suppress(ImportError):
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="req", file=sys.stderr)

    def update(self, record: RequestRecord) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        elif self.enabled:
            print(f"\r{self.done}/{self.total or '?'} requests", end="", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            print(file=sys.stderr)


# ---- command line ----------------------------------------------------------------------------
def run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="baton bench", description=__doc__.split("\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--address",
        help="a running router: HOST:PORT (gRPC) or its HTTP base URL with --door http",
    )
    where.add_argument("--manifest", help="start a local cluster from this manifest for the run")
    where.add_argument(
        "--url",
        action="append",
        help="an OpenAI-compatible server's base URL (repeat: each is run alone, in turn, and "
        "the runs are shown side by side)",
    )
    p.add_argument("--label", action="append", help="with --url: the column name of each")
    p.add_argument(
        "--streams",
        help="with --url: concurrent streams, e.g. 1,4,16 (default: --max-concurrency, else 1)",
    )
    p.add_argument(
        "--warmup", type=int, default=1, help="with --url: requests sent one at a time first"
    )
    p.add_argument(
        "--door",
        choices=("grpc", "http"),
        default="grpc",
        help="the front door to send requests to (with --manifest: the cluster's gRPC or HTTP "
        "address)",
    )
    p.add_argument("--api-key", help="sent as Authorization: Bearer (gRPC metadata or header)")
    p.add_argument("--model", help="--door http: the model name sent (default: /v1/models' first)")
    p.add_argument(
        "--metrics-url",
        help="a Prometheus /metrics page of the cluster (default with --door http: ADDRESS/metrics)"
        "; KV bytes moved = the rise of baton:kv_transfer_bytes_total over the run, summed over "
        "workers. Without one (gRPC and no --metrics-url) kv_bytes_moved stays null",
    )
    add_run_args(p)
    p.add_argument("--out", help="directory for results.json and the plots")
    p.add_argument("--tokenizer", help="a model directory: draw ids from its vocabulary")
    p.add_argument("--vocab-size", type=int, default=49152, help="without --tokenizer")
    p.add_argument("--block-size", type=int, default=16, help="the cluster's (oracle cache)")
    p.add_argument("--hash-seed", default="baton", help="the cluster's (oracle cache)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-plots", action="store_true")
    return p


def run_command(args: argparse.Namespace) -> int:
    """`baton bench [run]`: one measured run. Exit 0 when every request succeeded, 1 when some
    failed, 2 on bad options."""
    try:
        workload = make_workload(args.workload, workload_options(args.option))
        slo = parse_slo(args.slo)
        config = run_config(
            args, timeout_s=args.timeout, block_size=args.block_size, hash_seed=args.hash_seed
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.url:
        return side_by_side_command(args, workload, config)
    tokenizer_dir, cluster = args.tokenizer, None
    if args.manifest:
        cluster, config, tokenizer_dir = start_cluster(args.manifest, config, tokenizer_dir)
    progress = Progress(config.num_requests, enabled=not args.no_progress)
    try:
        tokens = token_space(args, tokenizer_dir)
        address = args.address
        if cluster is not None:
            address = cluster.http_address if args.door == "http" else cluster.address
            if address is None:
                raise SystemExit("the manifest's cluster has no HTTP door (spec.router.http_port)")
        elif args.door == "http" and "://" not in address:
            address = f"http://{address}"
        run = bench(
            address,
            workload,
            tokens,
            config,
            slo,
            progress,
            door=args.door,
            api_key=args.api_key,
            metrics_url=args.metrics_url,
            model=args.model,
        )
        summary, records = asyncio.run(run)
    finally:
        progress.close()
        if cluster is not None:
            cluster.close()
    print(table(summary))
    if args.out:
        path = write_results(args.out, summary, records)
        if not args.no_plots:
            try:
                from perf.bench.plots import run_figures

                run_figures(records, args.out)
            except ImportError as exc:  # matplotlib is a test/bench extra
                print(f"no plots ({exc}); pip install matplotlib", file=sys.stderr)
        print(f"results: {path}")
    return 0 if summary["failed"] == 0 else 1


def token_space(args: argparse.Namespace, tokenizer_dir: str | None) -> TokenSpace:
    """Prompt ids from the tokenizer's vocabulary (special tokens left out), else [100,
    --vocab-size)."""
    if not tokenizer_dir:
        return TokenSpace(high=args.vocab_size)
    from engine.tokenizer import load_tokenizer

    return TokenSpace.from_tokenizer(load_tokenizer(Path(tokenizer_dir)))


def side_by_side_command(args: argparse.Namespace, workload, config: BenchConfig) -> int:
    """`baton bench --url A --url B ...`: every server at every stream count, one table.
    Exit 0 when every request succeeded, 1 when some failed, 2 on bad options."""
    from perf.bench.side_by_side import (
        parse_streams,
        run_side_by_side,
        side_by_side_table,
        targets_of,
    )

    try:
        targets = targets_of(args.url, args.label)
        streams = parse_streams(args.streams or str(args.max_concurrency or 1))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.model:
        targets = [replace(t, model=args.model) for t in targets]
    tokens = token_space(args, args.tokenizer)
    results = run_side_by_side(
        targets,
        workload,
        tokens,
        config,
        streams,
        args.warmup,
        args.api_key,
        log=lambda m: print(m, file=sys.stderr),
    )
    title = f"{args.workload} (seed {config.seed}, {config.num_requests} requests a run)"
    print(side_by_side_table(results, title))
    if args.out:
        path = write_side_by_side(args.out, results)
        print(f"results: {path}")
    failed = sum(s["failed"] for by_label in results.values() for s in by_label.values())
    return 0 if failed == 0 else 1


def write_side_by_side(out_dir: str, results: dict[int, dict[str, dict]]) -> Path:
    """side_by_side.json: {"runs": [{"streams", "label", "summary"}, ...]}."""
    import json

    path = Path(out_dir) / "side_by_side.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    runs = [
        {"streams": n, "label": label, "summary": summary}
        for n, by_label in results.items()
        for label, summary in by_label.items()
    ]
    path.write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    return path


def start_cluster(manifest_path: str, config: BenchConfig, tokenizer_dir: str | None):
    """A LocalCluster (Ray in this process) from the manifest; the config takes its block size
    and hash seed, the token space its model's tokenizer unless one was given."""
    from cluster.local import LocalCluster
    from deploy.manifest import load_manifest
    from engine.model_resolver import resolve_model

    manifest = load_manifest(manifest_path)
    engine = manifest.spec.engine_for("prefill")
    config = replace(config, block_size=engine.block_size, hash_seed=str(engine.hash_seed))
    if tokenizer_dir is None and not manifest.spec.model.skip_tokenizer_init:
        tokenizer_dir = str(resolve_model(manifest.spec.model.path))
    cluster = LocalCluster(manifest).start(log=lambda m: print(m, file=sys.stderr))
    return cluster, config, tokenizer_dir


def compare_command(argv: list[str]) -> int:
    """`baton bench compare DIR...`: one table and one figure for several runs."""
    p = argparse.ArgumentParser(prog="baton bench compare")
    p.add_argument("runs", nargs="+", help="directories (or results.json files) of runs")
    p.add_argument("--out", help="the figure's path (default: no figure)")
    args = p.parse_args(argv)
    runs = {
        Path(r).name if Path(r).is_dir() else Path(r).parent.name: read_results(r)
        for r in args.runs
    }
    print(compare_table({name: summary for name, (summary, _) in runs.items()}))
    if args.out:
        from perf.bench.plots import compare_figure

        print(f"figure: {compare_figure(runs, Path(args.out))}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compare"]:
        return compare_command(argv[1:])
    if argv[:1] == ["run"]:
        argv = argv[1:]
    return run_command(run_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
