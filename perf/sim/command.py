"""`baton simulate`: a `baton bench` run against a simulated cluster (perf/sim/).

    baton simulate --manifest deploy/examples/local.yaml --workload agentic \\
        --num-requests 200 --request-rate 4 --slo ttft=500,tpot=50 --out runs/agentic-sim
    baton simulate --prefill 4 --decode 8 --policy cache_aware \\
        --workload trace -o path=trace.jsonl --profile ~/.cache/baton/profiles/X.json

Same workloads, seeds, pacing flags, report and results.json as perf/bench/command.py, so
`baton bench compare` puts a simulated and a real run side by side. The cluster's shape comes
from --manifest or from the flags (the flags override the manifest's values); step times from
--profile (a step profile JSON, perf/profiler.py), KV transfers from the profile's model
shape over --kv-bandwidth-gbps.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from engine.step_model import SHIPPED_PROFILES_DIR, StepModel
from perf.bench.flags import add_run_args, run_config, workload_options
from perf.bench.report import parse_slo, summarize, table
from perf.bench.timeline import write_results
from perf.bench.workloads import TokenSpace, make_workload
from perf.sim.cluster import ClusterConfig
from perf.sim.driver import simulate
from perf.sim.kv_bytes import block_bytes, shape_of
from perf.sim.worker import WorkerConfig

DEFAULT_PROFILE = SHIPPED_PROFILES_DIR / "smollm2-135m-instruct-float32-cpu-1t.json"
# The profile's entry for the measured control path: {"local": ms, "remote": ms}
REQUEST_OVERHEAD_KEY = "request_overhead_ms"
WORKER_FIELDS = (
    "block_size",
    "num_kv_blocks",
    "chunk_size",
    "max_num_batched_tokens",
    "max_num_seqs",
    "prefill_batch_tokens",
    "decode_steps_between_prompts",
    "itl_target_ms",
    "decode_stretch",
    "enable_prefix_caching",
)


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    """The cluster's shape and the time model (shared with perf/planner.py)."""
    p.add_argument("--manifest", help="take the cluster's shape from this manifest")
    p.add_argument("--prefill", type=int, help="prefill replicas (0: aggregated); default 1")
    p.add_argument("--decode", type=int, help="decode replicas; default 1")
    p.add_argument("--policy", help="routing policy (router/policy.py); default cache_aware")
    p.add_argument("--local-prefill-tokens", type=int, help="conditional disaggregation")
    p.add_argument("--itl-target-ms", type=float, help="dynamic chunking on every worker")
    p.add_argument(
        "--decode-stretch", type=float, help="the default step budget's factor (0: fixed chunks)"
    )
    p.add_argument("--chunk-size", type=int)
    p.add_argument("--num-kv-blocks", type=int, help="KV capacity of each worker in blocks")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument(
        "--prefill-batch-tokens",
        type=int,
        help="no other prompt joins a step carrying this many prompt tokens (default: the "
        "engine's for the profile's device: 32 on CPU, no limit on CUDA)",
    )
    p.add_argument("--profile", default=str(DEFAULT_PROFILE), help="step profile JSON")
    p.add_argument(
        "--kv-bandwidth-gbps",
        type=float,
        default=4.0,
        help="GB/s (1e9 bytes/s, as benchmarks.kvtransfer reports) of one transfer",
    )
    p.add_argument("--kv-latency-ms", type=float, default=2.0, help="fixed cost per transfer")
    add_overhead_args(p)


def add_overhead_args(p: argparse.ArgumentParser, shared_cores: float | None = None) -> None:
    """The per-request control path and the cores workers share (also read by
    benchmarks/sim_validation.py, whose runs share this machine's cores)."""
    p.add_argument(
        "--shared-cores",
        type=float,
        default=shared_cores,
        help="the workers run on one machine with this many cores: a step starting while more "
        "workers compute runs busy/cores times slower (default: "
        + ("each worker has its own" if shared_cores is None else f"{shared_cores}, this machine's")
        + "; 0: each its own)",
    )
    p.add_argument(
        "--step-time-scale",
        type=float,
        default=1.0,
        help="every step takes the profile's time times this (a machine slower or faster now "
        "than when it was profiled)",
    )
    for path, where in (("local", "on its decode worker"), ("remote", "on a prefill worker")):
        p.add_argument(
            f"--{path}-overhead-ms",
            type=float,
            help=f"control path of a request prefilled {where} (router calls, streams; "
            "default: the profile's request_overhead_ms from benchmarks.sim_calibration, else 0)",
        )


def run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="baton simulate", description=__doc__.split("\n")[0])
    add_run_args(p)
    p.add_argument("--out", help="directory for results.json")
    p.add_argument("--vocab-size", type=int, default=49152)
    add_cluster_args(p)
    return p


def cluster_config(args: argparse.Namespace, seed: int = 0) -> tuple[ClusterConfig, StepModel]:
    """The simulated cluster of --manifest and the flags, and the step model of --profile."""
    worker, prefill_worker = WorkerConfig(), None
    shape: dict[str, Any] = dict(prefill=1, decode=1, policy="cache_aware", local_prefill_tokens=0)
    if args.manifest:
        from deploy.manifest import load_manifest

        spec = load_manifest(args.manifest).spec
        worker = _worker_of(spec.engine_for("decode"))
        prefill_worker = _worker_of(spec.engine_for("prefill"))
        shape = dict(
            prefill=spec.prefill.replicas,
            decode=spec.decode.replicas,
            policy=spec.router.policy,
            local_prefill_tokens=spec.router.local_prefill_tokens,
        )
    for name in shape:
        if getattr(args, name) is not None:
            shape[name] = getattr(args, name)
    flags = {f: getattr(args, f) for f in WORKER_FIELDS if getattr(args, f, None) is not None}
    worker = replace(worker, **flags)
    if prefill_worker is not None:
        prefill_worker = replace(prefill_worker, **flags)
    data = json.loads(Path(args.profile).read_text())
    model = StepModel.from_json(data)
    dtype = data.get("key", {}).get("dtype", "float32")
    overhead_ms = data.get(REQUEST_OVERHEAD_KEY, {})
    for path in ("local", "remote"):
        flag = getattr(args, f"{path}_overhead_ms", None)
        if flag is not None:
            overhead_ms = {**overhead_ms, path: flag}
    config = ClusterConfig(
        **shape,
        worker=worker,
        prefill_worker=prefill_worker,
        block_bytes=block_bytes(shape_of(data), dtype, worker.block_size),
        kv_bandwidth_gbs=args.kv_bandwidth_gbps,
        kv_latency_s=args.kv_latency_ms / 1000.0,
        shared_cores=getattr(args, "shared_cores", None) or None,
        step_time_scale=getattr(args, "step_time_scale", 1.0),
        local_overhead_s=overhead_ms.get("local", 0.0) / 1000.0,
        remote_overhead_s=overhead_ms.get("remote", 0.0) / 1000.0,
        seed=seed,
    )
    return config, model


def _worker_of(engine) -> WorkerConfig:
    values = {f: getattr(engine, f) for f in WORKER_FIELDS}
    if values["num_kv_blocks"] is None:
        values["num_kv_blocks"] = WorkerConfig().num_kv_blocks
    return WorkerConfig(**values)


def run_command(args: argparse.Namespace) -> int:
    try:
        workload = make_workload(args.workload, workload_options(args.option))
        slo = parse_slo(args.slo)
        cluster, model = cluster_config(args, args.seed)
        config = run_config(args, block_size=cluster.worker.block_size)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    records, run = simulate(workload, TokenSpace(high=args.vocab_size), config, cluster, model)
    wall = time.perf_counter() - start
    info = dict(
        asdict(config),
        workload=type(workload).__name__,
        options=asdict(workload),
        simulated=dict(
            cluster=asdict(cluster), profile=args.profile, wall_s=wall, events=run.loop.processed
        ),
    )
    summary = summarize(records, slo, run.cluster.workers(), info)
    summary["kv"]["kv_bytes_moved"] = run.cluster.bytes_moved
    summary["engine_steps"] = run.cluster.engine_steps()
    print(table(summary))
    print(
        f"{'simulated in (s)':<28}{wall:.2f} ({run.loop.processed} events, "
        f"{run.loop.processed / max(wall, 1e-9):,.0f}/s)"
    )
    if args.out:
        print(f"results: {write_results(args.out, summary, records)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(run_parser().parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
