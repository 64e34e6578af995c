"""The soak benchmark: many requests at high concurrency against a local Ray deployment, with or
without the chaos test's faults, watching for what only shows over minutes: latency drifting
up, memory growing, KV blocks leaking.

    python -m benchmarks.soak                      # SmolLM2, 1 prefill + 2 decode, faults on
    python -m benchmarks.soak --tiny --num-requests 2000 --concurrency 32 --faults off
    python -m benchmarks.soak --model DIR --seed 7 --out runs/soak

It starts the cluster (cluster/local.py: Ray in this process), warms it up, then sends
--num-requests greedy requests of the `prefix-repetition` workload (perf/bench/workloads.py)
through the gRPC door with the bench client and driver (perf/bench/client.py, driver.py) at
--concurrency streams, while benchmarks/faults.py applies the chaos test's seeded schedule
(--faults on). It reports:
- completed / failed (by status) / migrated requests (migrations: the router's
  baton:request_migrations_total, summed over router restarts),
- TTFT and end-to-end p50 / p99 per --window-s window of send time (table, results.json,
  soak_p99.png),
- the resident memory (VmRSS) of the router, the controller, every worker and this client at
  start (after the warm-up) and end; a process whose growth passes --rss-bound-mb fails the
  run (a restarted worker is a new process: reported, not bounded),
- leaked KV blocks once the cluster is idle: per worker, blocks not free (cached blocks count
  as free) and requests still in flight, after check_integrity; must be 0.
Exit code 0 when nothing leaked and every bound held, else 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks.faults import FaultInjector, FaultSummary, fault_schedule
from benchmarks.soak_client import MigrationCounter, SoakClient
from benchmarks.soak_cluster import (
    NAMESPACE,
    current_pids,
    leaked_blocks,
    memory,
    process_pids,
    soak_manifest,
    tiny_checkpoint,
)
from benchmarks.soak_report import (
    PrintProgress,
    memory_table,
    p99_figure,
    window_table,
    windows,
)
from perf.bench.driver import BenchConfig, ProgressSink, run_bench
from perf.bench.report import summarize
from perf.bench.timeline import RequestRecord, write_results
from perf.bench.workloads import PrefixRepetitionWorkload, TokenSpace


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.soak", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", default="smollm2-135m-instruct", help="alias or HF directory")
    p.add_argument("--tiny", action="store_true", help="a tiny random checkpoint (fast)")
    p.add_argument("--num-requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=32, help="streams in flight")
    p.add_argument("--faults", choices=("on", "off"), default="on")
    p.add_argument("--num-faults", type=int, default=6, help="every kind at least once")
    p.add_argument("--fault-gap-s", type=float, default=30.0, help="between faults (+-25%%)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--prefix-len", type=int, default=64, help="shared prefix tokens")
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--window-s", type=float, default=30.0, help="p99 window")
    p.add_argument("--rss-bound-mb", type=float, default=100.0, help="most growth per process")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    p.add_argument("--out", default="runs/soak", help="results.json and figures")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from cluster.controller import controller_handle
    from cluster.local import LocalCluster
    from deploy.manifest import parse_manifest

    model = tiny_checkpoint() if args.tiny else args.model
    manifest = soak_manifest(model, args.tiny, args.prefill, args.decode, args.threads)
    cluster = LocalCluster(parse_manifest(manifest)).start(log=lambda m: print(m, file=sys.stderr))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        controller = controller_handle()
        worker_ids = sorted(ray.get(controller.worker_ids.remote(), timeout=60))
        block_size = manifest["spec"]["engine"]["block_size"]
        tokens = TokenSpace(high=512) if args.tiny else TokenSpace()
        workload = PrefixRepetitionWorkload(
            num_prefixes=8,
            prefix_len=args.prefix_len,
            suffix_len=args.suffix_len,
            output_len=args.output_len,
        )

        refused: list[int] = []  # per bench() call: requests sent again after a refusal

        def bench(n: int, seed: int, progress: ProgressSink | None) -> list[RequestRecord]:
            config = BenchConfig(
                num_requests=n,
                max_concurrency=args.concurrency,
                seed=seed,
                timeout_s=args.timeout_s,
                block_size=block_size,
            )

            async def go() -> list[RequestRecord]:
                client = SoakClient(cluster.address, time.perf_counter())
                try:
                    return await run_bench(client, workload, tokens, config, progress)
                finally:
                    refused.append(client.refused)
                    await client.close()

            return asyncio.run(go())

        print(f"warm-up: {args.concurrency} requests", file=sys.stderr)
        bench(args.concurrency, args.seed + 1, None)
        pids = process_pids(worker_ids)
        rss_start = memory(pids)
        migrations = MigrationCounter(f"{cluster.http_address}/metrics").start()
        injector = None
        if args.faults == "on":
            schedule = fault_schedule(
                args.seed,
                worker_ids,
                num_faults=args.num_faults,
                first_s=args.fault_gap_s / 2,
                gap_s=args.fault_gap_s,
            )
            injector = FaultInjector(schedule, NAMESPACE, log=lambda m: print(m, file=sys.stderr))
            injector.start()
        started = time.monotonic()
        try:
            records = bench(args.num_requests, args.seed, PrintProgress(args.num_requests))
        finally:
            if injector is not None:
                injector.stop()
        run_s = time.monotonic() - started
        migrated = migrations.stop()
        blocks = leaked_blocks(controller, worker_ids, settle_s=60.0)
        rss_end = memory({**pids, **current_pids(pids)})
    finally:
        cluster.close()

    summary = summarize(records, None, {}, {"soak": vars(args), "manifest": manifest})
    rows = windows(records, args.window_s)
    mem_table, over = memory_table(rss_start, rss_end, args.rss_bound_mb)
    leaked = sum(b["leaked_blocks"] + b["in_flight"] for b in blocks.values())
    broken = [w for w, b in blocks.items() if b["integrity"] != "ok"]
    faults = FaultSummary.of(injector.applied) if injector is not None else FaultSummary()
    soak = {
        "run_s": run_s,
        "completed": summary["completed"],
        "failed": summary["failed"],
        "failures": summary["failures"],
        "migrated": migrated,
        "refused_and_resent": refused[-1],
        "faults": asdict(faults),
        "fault_log": [
            {**asdict(a.fault), "pid": a.pid, "start_s": a.start_s, "error": a.error}
            for a in (injector.applied if injector else [])
        ],
        "windows": rows,
        "rss_start": rss_start,
        "rss_end": rss_end,
        "rss_bound_mb": args.rss_bound_mb,
        "rss_over_bound": over,
        "blocks": blocks,
        "leaked_blocks": leaked,
        "integrity_failed": broken,
    }
    write_results(out_dir, {**summary, "soak": soak}, records)
    (out_dir / "soak.json").write_text(json.dumps(soak, indent=1) + "\n")
    try:
        p99_figure(rows, out_dir / "soak_p99.png")
    except ImportError:
        pass

    lat = summary["latency_ms"]
    print(
        f"\n{len(records)} requests in {run_s:.0f} s at {args.concurrency} streams "
        f"(faults {args.faults}: {faults.by_kind or '-'}, skipped {faults.skipped}): "
        f"{summary['completed']} completed, {summary['failed']} failed {summary['failures']}, "
        f"{migrated} migrated; {refused[-1]} sends refused (no router listening) and resent"
    )
    fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
    print(
        f"TTFT p50 / p99 {fmt(lat['ttft']['median'])} / {fmt(lat['ttft']['p99'])} ms, "
        f"E2E p50 / p99 {fmt(lat['e2e']['median'])} / {fmt(lat['e2e']['p99'])} ms\n"
    )
    print(window_table(rows) + "\n")
    print(mem_table + f"\n(bound: +{args.rss_bound_mb:.0f} MiB per process)\n")
    for w, b in blocks.items():
        print(
            f"{w}: integrity {b['integrity']}, {b['leaked_blocks']} blocks held, "
            f"{b['in_flight']} in flight"
        )
    print(f"\nleaked blocks: {leaked}; results in {out_dir}/")
    ok = leaked == 0 and not broken and not over
    if not ok:
        print(f"FAILED: leaked {leaked}, integrity {broken}, RSS over bound {over}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
