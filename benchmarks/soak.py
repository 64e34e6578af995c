"""The soak benchmark: many requests at high concurrency against a local Ray deployment, with or
without the chaos test's faults, watching for what only shows over minutes: latency drifting
up, memory growing, KV blocks leaking.

    python -m benchmarks.soak                      # SmolLM2, 1 prefill + 2 decode, faults on
    python -m benchmarks.soak --tiny --num-requests 2000 --concurrency 32 --faults off
    python -m benchmarks.soak --model DIR --seed 7 --out runs/soak

It starts the cluster (cluster/local.py: Ray in this process), warms it up, then sends
--num-requests greedy requests of the `prefix-repetition` workload (benchmarks/workloads.py)
through the gRPC door with the bench client and driver (benchmarks/client.py, driver.py) at
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
import math
import os
import sys
import tempfile
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path

import grpc

from benchmarks.client import GrpcClient
from benchmarks.driver import BenchConfig, ProgressSink, run_bench
from benchmarks.faults import FaultInjector, FaultSummary, actor_pid, fault_schedule
from benchmarks.report import summarize
from benchmarks.timeline import RequestRecord, write_results
from benchmarks.workloads import PrefixRepetitionWorkload, TokenSpace
from router.proto import inference_pb2_grpc as pb_grpc

NAMESPACE = "baton"
CONTROLLER = "baton-controller"
ROUTER = "baton-router"
MIGRATIONS = "baton:request_migrations_total"
REFUSED_BACKOFF_S = 0.5


# ---- the cluster ----------------------------------------------------------------------------
def soak_manifest(model: str, tiny: bool, prefill: int, decode: int, threads: int) -> dict:
    """The deployment under test: tiny (random checkpoint, token ids only) or a real model."""
    engine = (
        {"block_size": 4, "num_kv_blocks": 1024, "chunk_size": 64}
        if tiny
        else {"block_size": 16, "kv_cache_memory_gb": 0.5, "chunk_size": 512}
    )
    return {
        "apiVersion": "baton/v1",
        "kind": "Cluster",
        "metadata": {"name": "soak"},
        "spec": {
            "model": {"path": model, "skip_tokenizer_init": tiny},
            "engine": engine,
            "prefill": {"replicas": prefill, "threads": threads},
            "decode": {"replicas": decode, "threads": threads},
            "router": {"port": 0, "http_port": 0, "wait_for_workers_seconds": 60.0},
            "transfer": {"timeout_seconds": 10.0, "lease_seconds": 10.0},
        },
    }


def tiny_checkpoint() -> str:
    """A tiny random Llama checkpoint (the tests' one) in a temporary directory."""
    from tests.checkpoints import make_checkpoint

    return str(make_checkpoint(Path(tempfile.mkdtemp(prefix="baton-soak-")), "llama"))


def rss_mb(pid: int) -> float | None:
    """A process's resident memory in MiB (None: gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def process_pids(worker_ids: list[str]) -> dict[str, int]:
    """Name -> pid of the controller, the router, every worker and this client."""
    pids = {name: actor_pid(name, NAMESPACE) for name in (CONTROLLER, ROUTER, *worker_ids)}
    pids["client"] = os.getpid()
    return pids


def memory(pids: dict[str, int]) -> dict[str, dict]:
    return {name: {"pid": pid, "rss_mb": rss_mb(pid)} for name, pid in pids.items()}


def leaked_blocks(controller, worker_ids: list[str], settle_s: float) -> dict[str, dict]:
    """Per worker once idle (waits up to settle_s for leases of abandoned requests):
    check_integrity's verdict, blocks not free and requests still in flight."""
    import ray

    from cluster.ray_peer import decode_client, prefill_client

    clients = {}
    for w in worker_ids:
        handle = ray.get(controller.handle.remote(w), timeout=60)
        clients[w] = (prefill_client if w.startswith("prefill") else decode_client)(handle, 60.0)
    deadline = time.monotonic() + settle_s
    while True:  # a worker Ray is restarting does not answer yet: ask again
        stats, errors = {}, {}
        for w, c in clients.items():
            try:
                stats[w] = c.stats()
            except Exception as exc:  # noqa: BLE001 - restarting; reported if it stays so
                errors[w] = f"{type(exc).__name__}: {str(exc)[:200]}"
        idle = not errors and all(
            s.num_in_flight == 0 and s.free_blocks == s.num_blocks for s in stats.values()
        )
        if idle or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    out = {}
    for w, c in clients.items():
        if w in errors:
            out[w] = {"integrity": f"no answer: {errors[w]}", "leaked_blocks": 0, "in_flight": 0}
            continue
        try:
            c.check_integrity()
            integrity = "ok"
        except Exception as exc:  # noqa: BLE001 - reported
            integrity = f"{type(exc).__name__}: {exc}"
        s = stats[w]
        out[w] = {
            "integrity": integrity,
            "leaked_blocks": s.num_blocks - s.free_blocks,
            "in_flight": s.num_in_flight,
            "num_blocks": s.num_blocks,
        }
    return out


# ---- migrations over router restarts --------------------------------------------------------
class MigrationCounter:
    """Polls the router's /metrics; sums the migration counter's rises, treating a drop as a
    router restart (its counter starts again at 0)."""

    def __init__(self, url: str, period_s: float = 2.0) -> None:
        self.url, self.period_s = url, period_s
        self.total, self._last = 0.0, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="migrations")

    def start(self) -> MigrationCounter:
        self._last = self._read() or 0.0
        self._thread.start()
        return self

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(30)
        self._poll()
        return int(self.total)

    def _read(self) -> float | None:
        import httpx

        try:
            text = httpx.get(self.url, timeout=10.0, trust_env=False).text
        except httpx.HTTPError:
            return None  # the router is restarting
        for line in text.splitlines():
            if line.startswith(MIGRATIONS):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def _poll(self) -> None:
        value = self._read()
        if value is None:
            return
        self.total += value - self._last if value >= self._last else value
        self._last = value

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._poll()


class SoakClient(GrpcClient):
    """The bench's gRPC client as a patient client uses it: it reconnects within a second
    after a router restart (gRPC's default backoff grows to minutes), and a request refused
    at once because no router listens (it never reached one) is sent again after
    REFUSED_BACKOFF_S, within its timeout; `refused` counts those retries. A stream cut
    mid-way is not retried: it counts as failed, as its client saw it."""

    def __init__(self, address: str, start: float) -> None:
        super().__init__(address, start)
        self.channel = grpc.aio.insecure_channel(
            address,
            options=[
                ("grpc.max_reconnect_backoff_ms", 1000),
                ("grpc.initial_reconnect_backoff_ms", 200),
            ],
        )
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.refused = 0

    async def generate(self, spec, run_id: str, timeout: float):
        first_send = self.now()
        deadline = first_send + timeout
        while True:
            record, answer = await super().generate(spec, run_id, timeout)
            record = replace(record, send_s=first_send)  # latency includes the resends
            never_reached = (
                record.status == "UNAVAILABLE"
                and not record.chunks
                and ("failed to connect" in record.error or "Connection refused" in record.error)
            )
            if not never_reached or self.now() + REFUSED_BACKOFF_S > deadline:
                return record, answer
            self.refused += 1
            await asyncio.sleep(REFUSED_BACKOFF_S)
            timeout = deadline - self.now()


# ---- progress and report ------------------------------------------------------------------
class PrintProgress(ProgressSink):
    """One line every `every` requests: done, failed, recent p99 of end-to-end latency."""

    def __init__(self, total: int, every: int = 100) -> None:
        self.total, self.every = total, every
        self.records: list[RequestRecord] = []
        self.start = time.monotonic()

    def update(self, record: RequestRecord) -> None:
        self.records.append(record)
        n = len(self.records)
        if n % self.every and n != self.total:
            return
        recent = [r.e2e for r in self.records[-self.every :] if r.ok]
        p99 = percentile(recent, 99)
        failed = sum(not r.ok for r in self.records)
        print(
            f"[{time.monotonic() - self.start:7.1f}s] {n}/{self.total} requests, "
            f"{failed} failed, last {self.every}: e2e p99 {_ms(p99)} ms",
            file=sys.stderr,
            flush=True,
        )


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q / 100 * len(values)) - 1))]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def windows(records: list[RequestRecord], window_s: float) -> list[dict]:
    """Per window of send time: requests, failures, TTFT and E2E p50 / p99 (ms, completed)."""
    if not records:
        return []
    end = max(r.send_s for r in records)
    out = []
    for k in range(int(end // window_s) + 1):
        rs = [r for r in records if k * window_s <= r.send_s < (k + 1) * window_s]
        ok = [r for r in rs if r.ok]
        ttft = [r.ttft for r in ok if r.ttft is not None]
        e2e = [r.e2e for r in ok]
        row = {"start_s": k * window_s, "requests": len(rs), "failed": len(rs) - len(ok)}
        for name, values in (("ttft", ttft), ("e2e", e2e)):
            for q in (50, 99):
                v = percentile(values, q)
                row[f"{name}_p{q}_ms"] = None if v is None else round(v * 1000, 1)
        out.append(row)
    return out


def window_table(rows: list[dict]) -> str:
    head = "| window (s) | requests | failed | TTFT p50 / p99 (ms) | E2E p50 / p99 (ms) |"
    lines = [head, "|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['start_s']:.0f} | {r['requests']} | {r['failed']} | "
            f"{r['ttft_p50_ms']} / {r['ttft_p99_ms']} | {r['e2e_p50_ms']} / {r['e2e_p99_ms']} |"
        )
    return "\n".join(lines)


def memory_table(start: dict, end: dict, bound_mb: float) -> tuple[str, list[str]]:
    """The RSS table and the processes past the bound (same pid at start and end only)."""
    lines = ["| process | RSS start (MiB) | RSS end (MiB) | growth (MiB) |", "|---|---|---|---|"]
    over = []
    for name, s in start.items():
        e = end.get(name, {})
        if e.get("pid") != s["pid"]:
            lines.append(f"| {name} | {s['rss_mb']:.0f} | {e.get('rss_mb') or 0:.0f} | restarted |")
            continue
        if s["rss_mb"] is None or e.get("rss_mb") is None:
            lines.append(f"| {name} | {s['rss_mb']} | {e.get('rss_mb')} | gone |")
            continue
        growth = e["rss_mb"] - s["rss_mb"]
        lines.append(f"| {name} | {s['rss_mb']:.0f} | {e['rss_mb']:.0f} | {growth:+.0f} |")
        if growth > bound_mb:
            over.append(f"{name}: +{growth:.0f} MiB")
    return "\n".join(lines), over


def p99_figure(rows: list[dict], path: Path) -> None:
    from benchmarks.plots import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    x = [r["start_s"] for r in rows]
    for key, label in (("e2e_p99_ms", "E2E p99"), ("ttft_p99_ms", "TTFT p99")):
        ax.plot(x, [r[key] if r[key] is not None else float("nan") for r in rows], label=label)
    ax.set(xlabel="send time (s)", ylabel="latency (ms)", title="p99 latency per window")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- the run --------------------------------------------------------------------------------
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
        rss_end = memory({**pids, **_current_pids(pids)})
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


def _current_pids(pids: dict[str, int]) -> dict[str, int]:
    """Pids now (restarted actors have new ones); unchanged where an actor does not answer."""
    out = {}
    for name in pids:
        if name == "client":
            continue
        try:
            out[name] = actor_pid(name, NAMESPACE, timeout=10.0)
        except Exception:  # noqa: BLE001 - keep the old pid (reported as gone)
            pass
    return out


if __name__ == "__main__":
    sys.exit(main())
