"""`baton profile serving`: where a serving step's time goes, per cluster shape and stream count.

    baton profile serving [--model smollm2-135m-instruct] [--shapes aggregated,disaggregated]
        [--streams 1,2,4,8,16] [--requests-per-stream 4] [--rounds 1]
        [--workload shared-prefix] [--door grpc|http] [--out DIR]

For each shape (aggregated: 0 prefill + 1 decode worker, the decode worker prefilling;
disaggregated: 1 + 1) a local cluster (Ray in this process, free loopback ports) is started
from the manifest (default deploy/examples/local.yaml); then for each stream count S it sends
--warmup requests one at a time and runs the next S x --requests-per-stream requests of the
workload, S at a time (`baton bench`'s driver; seed + S + 1000 x round, so that no run repeats
a prompt an earlier one cached), and reads before and after the run: every worker's metrics
(steps, their phases, the gaps between steps), every process's threads' CPU (/proc), and the
end of the step that sampled each token. It prints one table per (shape, S, round)
(perf/serving/breakdown.py says what each line is), then each stream count's tokens/s, TTFT
p50 and ITL p50 as ratios to the first stream count's in the same round, and their median over
the rounds: on a host whose speed drifts between minutes, --rounds 3 or more alternates the
stream counts so that each ratio compares runs a minute apart. With --out it writes
serving_profile.json: {"runs": [{"shape", "streams", "round", "summary", "engines",
"token_path", "threads"}, ...], "ratios": {shape: {S: {...}}}}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import yaml

from perf.bench.driver import BenchConfig, bench
from perf.bench.flags import workload_options
from perf.bench.side_by_side import parse_streams
from perf.bench.workloads import WORKLOADS, TokenSpace, make_workload
from perf.serving.breakdown import breakdown_table, engine_breakdown, thread_breakdown, token_path
from perf.serving.ratios import ratios_table, stream_ratios

SHAPES = {"aggregated": (0, 1), "disaggregated": (1, 1)}  # (prefill, decode) replicas
ROUND_SEED_STRIDE = 1000  # round r draws seed + S + 1000 r: no two runs share a prompt
LOCAL_MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "local.yaml"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="baton profile serving", description=__doc__.split("\n")[0])
    p.add_argument("--manifest", default=str(LOCAL_MANIFEST), help="the base cluster")
    p.add_argument("--model", help="spec.model.path (default: the manifest's)")
    p.add_argument("--shapes", default="aggregated,disaggregated", help="of: " + ",".join(SHAPES))
    p.add_argument("--streams", default="1,2,4,8,16", help="concurrent streams, e.g. 1,4,16")
    p.add_argument("--requests-per-stream", type=int, default=4)
    p.add_argument(
        "--rounds", type=int, default=1, help="times through the stream counts, for the ratios"
    )
    p.add_argument("--workload", choices=list(WORKLOADS), default="shared-prefix")
    p.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a workload option (perf/bench/workloads.py)")  # fmt: skip
    p.add_argument("-e", "--engine-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a spec.engine field (YAML value), e.g. fused_decode=false")  # fmt: skip
    p.add_argument("--threads", type=int, help="torch threads per worker (spec.<pool>.threads)")
    p.add_argument("--door", choices=("grpc", "http"), default="grpc")
    p.add_argument(
        "--warmup", type=int, default=2, help="requests, one at a time, before each stream count"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--vocab-size", type=int, default=49152, help="a model without tokenizer")
    p.add_argument("--out", help="directory for serving_profile.json")
    return p


def shape_manifest(base: dict, shape: str, args: argparse.Namespace):
    """The base manifest (a dict) in this shape: replicas, free ports, the flags' fields."""
    from deploy.manifest import parse_manifest

    data = json.loads(json.dumps(base))
    spec = data["spec"]
    spec["prefill"]["replicas"], spec["decode"]["replicas"] = SHAPES[shape]
    spec["router"]["port"], spec["router"]["http_port"] = 0, 0
    if args.model:
        spec["model"]["path"] = args.model
    if args.threads:
        for pool in ("prefill", "decode"):
            spec[pool]["threads"] = args.threads
    for key, value in workload_options(args.engine_option, "--engine-option").items():
        spec["engine"][key] = yaml.safe_load(value)
    return parse_manifest(data)


def tokens_of(manifest, vocab_size: int) -> TokenSpace:
    """Prompt ids from the model's tokenizer (its special tokens left out), or [100, vocab)."""
    from engine.model_resolver import resolve_model
    from engine.tokenizer import load_tokenizer

    if manifest.spec.model.skip_tokenizer_init:
        return TokenSpace(high=vocab_size)
    return TokenSpace.from_tokenizer(load_tokenizer(resolve_model(manifest.spec.model.path)))


def profile_shape(shape: str, manifest, workload, tokens, streams: list[int], args) -> list[dict]:
    """Start the shape's cluster, warm it, profile each stream count; the runs' breakdowns."""
    from cluster.local import LocalCluster
    from perf.serving.probes import ClusterProbe

    engine = manifest.spec.engine_for("prefill")
    base = BenchConfig(
        num_requests=1,
        seed=args.seed,
        timeout_s=args.timeout,
        block_size=engine.block_size,
        hash_seed=str(engine.hash_seed),
    )
    cluster = LocalCluster(manifest).start(log=lambda m: print(m, file=sys.stderr))
    runs = []
    try:
        address = cluster.http_address if args.door == "http" else cluster.address
        if address is None:
            raise SystemExit("the cluster serves no HTTP door: profile with --door grpc")

        def run(config: BenchConfig):
            return asyncio.run(bench(address, workload, tokens, config, door=args.door))

        probe = ClusterProbe.find()
        for round_, n in ((r, n) for r in range(args.rounds) for n in streams):
            # each stream count of each round draws its own requests, the warm-up the first
            # and the run the ones after: no run repeats a prompt the cache holds whole
            drawn = replace(base, seed=args.seed + n + ROUND_SEED_STRIDE * round_)
            if args.rounds > 1 and n == streams[0]:
                print(f"-- {shape}: round {round_ + 1} of {args.rounds}", flush=True)
            if args.warmup:
                run(replace(drawn, num_requests=args.warmup, max_concurrency=1))
            config = replace(
                drawn,
                num_requests=n * args.requests_per_stream,
                max_concurrency=n,
                skip_sessions=args.warmup,
            )
            probe.token_times(True)
            metrics_before, cpu_before, t0 = probe.metrics(), probe.cpu(), time.monotonic()
            summary, records = run(config)
            cpu_after, t1, metrics_after = probe.cpu(), time.monotonic(), probe.metrics()
            times = probe.token_times(False)
            probe.refresh_names()  # threads born during the run get their names
            result = dict(
                shape=shape,
                streams=n,
                round=round_,
                summary=summary,
                engines={
                    w: engine_breakdown(metrics_before[w], metrics_after[w]) for w in metrics_after
                },
                token_path=token_path(
                    records,
                    [t for worker in times.values() for t in worker],
                    summary["config"]["start_monotonic"],
                ),
                threads=thread_breakdown(
                    cpu_before, cpu_after, {p.label: p.names for p in probe.processes}, t1 - t0
                ),
            )
            print(breakdown_table(result), flush=True)
            runs.append(result)
    finally:
        cluster.close()
    return runs


def main(argv: list[str] | None = None) -> int:
    """Exit 0 when every request of every run succeeded, 1 when some failed, 2 on bad
    options."""
    from deploy.manifest import load_manifest

    args = parser().parse_args(argv)
    try:
        streams = parse_streams(args.streams)
        shapes = [s for s in args.shapes.split(",") if s]
        unknown = [s for s in shapes if s not in SHAPES]
        if unknown or not shapes:
            raise ValueError(f"--shapes takes {', '.join(SHAPES)}; got {args.shapes!r}")
        if args.requests_per_stream < 1:
            raise ValueError("--requests-per-stream must be >= 1")
        if args.rounds < 1:
            raise ValueError("--rounds must be >= 1")
        workload = make_workload(args.workload, workload_options(args.option))
        base = load_manifest(args.manifest).model_dump(mode="json")
        manifests = {shape: shape_manifest(base, shape, args) for shape in shapes}
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tokens = tokens_of(manifests[shapes[0]], args.vocab_size)
    runs = []
    for shape in shapes:
        runs += profile_shape(shape, manifests[shape], workload, tokens, streams, args)
    ratios = stream_ratios(runs)
    if ratios:
        print(ratios_table(ratios))
    if args.out:
        path = Path(args.out) / "serving_profile.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"runs": runs, "ratios": ratios}, indent=1) + "\n")
        print(f"results: {path}")
    return 0 if all(r["summary"]["failed"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
