"""The KV tier, session retention and decode -> prefill pulls under many agent sessions: one
command runs the multi-turn agent workload (perf/bench/agent_workload.py) with a live context
several times one worker's KV memory, on fresh local clusters:

    agg-off               aggregated (decode workers prefill), no KV tier
    agg-disk              aggregated, a disk KV tier on every worker
    disagg-off            1 prefill + 1 decode worker, no KV tier
    disagg-disk           1 prefill + 1 decode worker, disk KV tiers
    disagg-disk-restart   as disagg-disk, decode-0 killed mid-run (Ray restarts it: it
                          re-indexes its disk tier and announces it; the router keeps routing)

and prints each run's table, the runs side by side (hit rate against the infinite-cache
oracle, TTFT p50/p99, ITL p99, throughput, prefill tokens computed, bytes loaded from the
tier, decode -> prefill pulls), and for the restart run the hit rate of the turns before the
kill and of the first turns after it. Results go to --out/<run>/results.json.

    python -m benchmarks.kv_tier_agents                       # SmolLM2, 5x live context
    python -m benchmarks.kv_tier_agents --live-context-x 8 --num-requests 400
    python -m benchmarks.kv_tier_agents --tiny                # a tiny random model (checks)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
from pathlib import Path

from perf.bench.agent_workload import AgentWorkload
from perf.bench.driver import BenchConfig, ProgressSink, bench
from perf.bench.report import compare_table, table
from perf.bench.specs import TokenSpace
from perf.bench.timeline import RequestRecord, write_results

RUNS = ("agg-off", "agg-disk", "disagg-off", "disagg-disk", "disagg-disk-restart")
KILLED = "decode-0"  # the restart run's worker


def manifest(args: argparse.Namespace, run: str, model: str, tier_root: Path) -> dict:
    """One run's local cluster: the run's shape and tier, KV memory cut to --kv-blocks."""
    tier = run.split("-")[1] == "disk"
    engine: dict = {
        "block_size": args.block_size,
        "num_kv_blocks": args.kv_blocks,
        "chunk_size": args.chunk_size,
        "max_num_batched_tokens": max(args.chunk_size, 2048),
    }
    if tier:
        engine.update(
            kv_tier="disk",
            kv_tier_path=str(tier_root / run),
            kv_tier_bytes=int(args.tier_gb * 2**30),
        )
    return {
        "apiVersion": "baton/v1",
        "kind": "Cluster",
        "metadata": {"name": f"kv-tier-{run}"},
        "spec": {
            "model": {"path": model, "skip_tokenizer_init": args.tiny},
            "engine": engine,
            "prefill": {"replicas": 0 if run.startswith("agg") else 1, "threads": args.threads},
            "decode": {"replicas": 1, "threads": args.threads},
            "router": {"port": 0, "http_port": 0, "wait_for_workers_seconds": 120.0},
            "transfer": {"timeout_seconds": 30.0, "lease_seconds": 30.0},
        },
    }


def workload(args: argparse.Namespace) -> AgentWorkload:
    """The agent workload sized to --live-context-x times one worker's KV tokens."""
    kv_tokens = args.kv_blocks * args.block_size
    if args.tiny:
        return AgentWorkload(
            system_len=48,
            tools_len=32,
            task_len=8,
            tool_output_len=24,
            output_len=4,
            min_turns=3,
            max_turns=5,
            think_s=0.2,
            live_context_x=args.live_context_x,
            kv_tokens=kv_tokens,
            max_context=300,
        )
    return AgentWorkload(
        think_s=args.think_s,
        live_context_x=args.live_context_x,
        kv_tokens=kv_tokens,
        max_context=args.max_context,
    )


def recovery(records: list[RequestRecord], kill_s: float) -> dict:
    """Cached tokens / oracle cached tokens of the turns done before `kill_s` and of each
    session's first, second and third turn sent after it (None where there are none). Turns
    in flight at the kill are left out: a turn that moved to another attempt reports that
    attempt's hits, which include what the failed one computed."""

    def of_oracle(rs: list[RequestRecord]) -> float | None:
        oracle = sum(r.oracle_cached_tokens for r in rs)
        return sum(r.cached_tokens for r in rs) / oracle if oracle else None

    ok = sorted((r for r in records if r.ok), key=lambda r: r.send_s)
    after: dict[str, list[RequestRecord]] = {}
    for r in ok:
        if r.send_s >= kill_s:
            after.setdefault(r.request_id.rsplit("-", 1)[0], []).append(r)
    nth = {
        f"turn_{k + 1}_after": of_oracle([turns[k] for turns in after.values() if len(turns) > k])
        for k in range(3)
    }
    return {"kill_s": kill_s, "before": of_oracle([r for r in ok if r.end_s < kill_s]), **nth}


class KillMidRun(ProgressSink):
    """Kills `worker` (SIGKILL; Ray restarts it) once `after` requests finished, on a thread of
    its own; kill_s is that request's end on the bench's clock (None until then)."""

    def __init__(self, worker: str, after: int, log) -> None:
        self.worker, self.after, self.log = worker, after, log
        self.done = 0
        self.kill_s: float | None = None
        self.injector = None

    def update(self, record: RequestRecord) -> None:
        from benchmarks.faults import Fault, FaultInjector
        from cluster.controller import NAMESPACE

        self.done += 1
        if self.done == self.after:
            self.kill_s = record.end_s
            fault = Fault(0.0, "kill", self.worker)
            self.injector = FaultInjector([fault], NAMESPACE, self.log).start()

    def close(self) -> None:
        if self.injector is not None:
            self.injector.join(60)
            self.injector.stop()


def run_one(args: argparse.Namespace, run: str, model: str, tier_root: Path) -> dict:
    """Start the run's cluster, drive the workload (killing decode-0 halfway through the
    restart run), tear it down; its summary."""
    from cluster.local import LocalCluster
    from deploy.manifest import parse_manifest

    m = parse_manifest(manifest(args, run, model, tier_root))
    w = workload(args)
    tokens = TokenSpace(low=3, high=512) if args.tiny else TokenSpace()
    config = BenchConfig(
        num_requests=args.num_requests,
        seed=args.seed,
        timeout_s=args.timeout,
        block_size=args.block_size,
        hash_seed=str(m.spec.engine.hash_seed),
    )
    log = lambda message: print(message, file=sys.stderr)  # noqa: E731
    log(f"== {run}: {w.live_sessions()} sessions at once, {args.num_requests} requests")
    enough = math.ceil((w.live_sessions() or 1) * w.mean_turns())
    if args.num_requests < enough:
        # a session claims all its turns when it starts (perf/bench/driver.py)
        log(
            f"note: {args.num_requests} requests are the turns of about "
            f"{args.num_requests / w.mean_turns():.0f} sessions: the live context stays below "
            f"{args.live_context_x:g}x one worker's KV (--num-requests {enough} reaches it)"
        )
    kill = None
    if run.endswith("restart"):
        kill = KillMidRun(KILLED, max(1, int(args.num_requests * args.kill_after)), log)
    cluster = LocalCluster(m).start(log=log)
    try:
        summary, records = asyncio.run(
            bench(
                cluster.address,
                w,
                tokens,
                config,
                None,
                kill,
                metrics_url=f"{cluster.http_address}/metrics",
            )
        )
    finally:
        if kill is not None:
            kill.close()
        cluster.close()
    summary["config"].update(run=run, live_sessions=w.live_sessions(), kv_blocks=args.kv_blocks)
    if kill is not None and kill.kill_s is not None:
        summary["recovery"] = recovery(records, kill.kill_s)
    write_results(Path(args.out) / run, summary, records)
    return summary


def recovery_lines(summary: dict) -> list[str]:
    rec = summary.get("recovery")
    if rec is None:
        return []

    def pct(value: float | None) -> str:
        return "-" if value is None else f"{value:.1%}"

    return [
        f"restart of {KILLED} at {rec['kill_s']:.1f} s: cached / oracle before {pct(rec['before'])}"
        f", 1st turn after {pct(rec['turn_1_after'])}, 2nd {pct(rec['turn_2_after'])}, "
        f"3rd {pct(rec['turn_3_after'])}"
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tiny", action="store_true", help="a tiny random checkpoint (checks)")
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {RUNS}")
    p.add_argument("--live-context-x", type=float, default=5.0, help="live context / KV memory")
    p.add_argument("--kv-blocks", type=int, default=None, help="each worker's KV blocks")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--chunk-size", type=int, default=None)
    p.add_argument("--tier-gb", type=float, default=8.0, help="each worker's disk tier")
    p.add_argument("--think-s", type=float, default=2.0, help="mean tool time between turns")
    p.add_argument("--max-context", type=int, default=8192, help="a session's positions")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument(
        "--kill-after", type=float, default=0.5, help="restart run: kill after this fraction"
    )
    p.add_argument("--threads", type=int, default=4, help="torch threads per worker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="per request, seconds")
    p.add_argument("--out", default="runs/kv-tier-agents")
    args = p.parse_args(argv)
    tiny = dict(kv_blocks=128, block_size=4, chunk_size=64, num_requests=60)
    full = dict(kv_blocks=1024, block_size=16, chunk_size=512, num_requests=300)
    for key, value in (tiny if args.tiny else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    unknown = set(args.runs.split(",")) - set(RUNS)
    if unknown:
        p.error(f"unknown runs {sorted(unknown)}; choose from {RUNS}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = args.model
    if args.tiny:
        from benchmarks.soak_cluster import tiny_checkpoint

        model = tiny_checkpoint()
    summaries = {}
    with tempfile.TemporaryDirectory(prefix="baton-kv-tier-") as tier_root:
        for run in args.runs.split(","):
            summaries[run] = run_one(args, run, model, Path(tier_root))
            print(f"\n== {run}\n{table(summaries[run])}")
            print("\n".join(recovery_lines(summaries[run])))
    print("\n== side by side\n" + compare_table(summaries))
    for summary in summaries.values():
        for line in recovery_lines(summary):
            print(line)
    out = Path(args.out) / "comparison.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "runs": summaries}, indent=2, default=str))
    print(f"\nresults: {Path(args.out).resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
