"""The benchmark driver: sends a workload's sessions to a cluster on an arrival schedule and
records every request (perf/bench/timeline.py). The CLI around it is perf/bench/command.py.

Arrivals follow the request rate and burstiness (perf/bench/arrivals.py); each arrival starts a
session, whose later turns are sent as soon as the previous answer is in (after the turn's
think_s, an agent's tool time). --max-concurrency caps the sessions (so the requests) in
flight (a sized agent workload sets the cap itself: live_sessions); an arrival that finds the
cap reached waits for a slot, and its latencies count from when it is sent. The run stops
starting sessions after num_requests requests (a session claims all its turns when it starts)
or duration_s seconds, and waits for those in flight.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
import uuid
from dataclasses import asdict, dataclass, replace
from typing import Protocol

from perf.bench.arrivals import arrival_times
from perf.bench.client import GrpcClient, HttpClient, counter_rise, scrape_counters
from perf.bench.oracle import OracleCache
from perf.bench.report import summarize
from perf.bench.timeline import RequestRecord
from perf.bench.workloads import Session, TokenSpace, Workload


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """How much to send and how fast; block_size and hash_seed must be the cluster's (they
    define the oracle cache)."""

    num_requests: int | None = 100
    duration_s: float | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    skip_sessions: int = 0  # the workload's first sessions left out (a warm-up sent them)
    timeout_s: float = 600.0  # per request
    block_size: int = 16
    hash_seed: str = "baton"

    def __post_init__(self) -> None:
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("give --num-requests or --duration: the workloads are endless")
        timed = self.num_requests is None
        if timed and math.isinf(self.request_rate) and not self.max_concurrency:
            raise ValueError("a --duration run at an infinite rate needs --max-concurrency")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")


class Budget:
    """Requests may still be sent while fewer than num_requests were and duration has not
    passed. A session claims its turns when it starts, so that --num-requests counts whole
    sessions rather than a crowd of first turns."""

    def __init__(self, config: BenchConfig) -> None:
        self.left = config.num_requests if config.num_requests is not None else math.inf
        self.until = config.duration_s if config.duration_s is not None else math.inf

    def open(self, now: float) -> bool:
        return self.left > 0 and now < self.until

    def take(self, now: float, n: int = 1) -> int:
        """Claim up to n requests; how many were granted."""
        if not self.open(now):
            return 0
        granted = int(min(n, self.left))
        self.left -= granted
        return granted


class ProgressSink(Protocol):
    """What the driver reports progress to (the CLI's bar; None in tests)."""

    def update(self, record: RequestRecord) -> None: ...

    def close(self) -> None: ...


async def run_bench(
    client: GrpcClient | HttpClient,
    workload: Workload,
    tokens: TokenSpace,
    config: BenchConfig,
    progress: ProgressSink | None = None,
) -> list[RequestRecord]:
    """Send the workload to the cluster; every request's record, in send order. Times count
    from client.start, which should be just before this call (t = 0: the first arrival)."""
    budget = Budget(config)
    # sessions in flight: --max-concurrency, else what a sized workload asks for
    # (perf/bench/agent_workload.py: live_sessions), else no bound
    sized = getattr(workload, "live_sessions", lambda: None)()
    slots = asyncio.Semaphore(config.max_concurrency or sized or 2**30)
    oracle = OracleCache(config.block_size, config.hash_seed)
    run_id = uuid.uuid4().hex[:8]
    records: list[RequestRecord] = []

    async def run_session(session: Session, spec, turns: int) -> None:
        """Up to `turns` turns (claimed from the budget); stops at the duration, a failure or
        the session's end, and gives back the turns it did not send."""
        try:
            for sent in range(turns):
                if spec is not None and spec.think_s > 0:  # the agent's tool runs
                    await asyncio.sleep(spec.think_s)
                if spec is None or client.now() >= budget.until:
                    budget.left += turns - sent
                    return
                hit = oracle.lookup_and_insert(spec.prompt_token_ids, spec.cache_salt)
                record, answer = await client.generate(spec, run_id, config.timeout_s)
                records.append(replace(record, oracle_cached_tokens=hit))
                if record.ok:
                    oracle.insert_answer(spec.prompt_token_ids, answer, spec.cache_salt)
                if progress is not None:
                    progress.update(record)
                spec = session.next_turn(answer) if record.ok else None
        finally:
            slots.release()

    arrivals = arrival_times(config.request_rate, config.burstiness, config.seed)
    tasks: list[asyncio.Task] = []
    sessions = workload.sessions(tokens, config.seed)
    for session in itertools.islice(sessions, config.skip_sessions, None):
        first = session.next_turn(None)
        if first is None:
            continue
        at = first.arrival_s if first.arrival_s is not None else next(arrivals)
        if config.duration_s is not None and at >= config.duration_s:
            break
        await asyncio.sleep(max(0.0, at - client.now()))
        await slots.acquire()
        turns = budget.take(client.now(), getattr(session, "num_turns", 1))
        # every turn is claimed, but a session that ends early (its context full) gives back
        # the turns it did not send: wait for one to end before calling the run done
        while not turns and (running := [t for t in tasks if not t.done()]):
            await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            turns = budget.take(client.now(), getattr(session, "num_turns", 1))
        if not turns:
            slots.release()
            break
        tasks.append(asyncio.create_task(run_session(session, first, turns)))
    await asyncio.gather(*tasks)
    return sorted(records, key=lambda r: r.send_s)


async def bench(
    address: str,
    workload: Workload,
    tokens: TokenSpace,
    config: BenchConfig,
    slo: dict | None = None,
    progress: ProgressSink | None = None,
    *,
    door: str = "grpc",
    api_key: str | None = None,
    metrics_url: str | None = None,
    model: str | None = None,
    kind: str | None = None,
) -> tuple[dict, list[RequestRecord]]:
    """One run against the router at `address`: HOST:PORT for door "grpc", a base URL
    (http://HOST:PORT) for door "http" (a Baton router's) or "openai" (any OpenAI-compatible
    server, of `kind` (perf/bench/servers.py; None: told by its /v1/models); no /metrics
    unless metrics_url is given); (summary, records). kv.kv_bytes_moved is the rise of
    baton:kv_transfer_bytes_total at metrics_url (default: the HTTP door's /metrics) over the
    run, and engine_steps each worker's steps and their seconds over it
    (baton:engine_step_duration_seconds); None and {} without a metrics page."""
    client: HttpClient | GrpcClient
    if door == "http":
        client = HttpClient(address, time.perf_counter(), api_key, model, kind="baton")
        metrics_url = metrics_url or f"{client.address}/metrics"
    elif door == "openai":  # any OpenAI-compatible server: its kind from /v1/models
        client = HttpClient(address, time.perf_counter(), api_key, model, kind=kind)
    elif door == "grpc":
        client = GrpcClient(address, time.perf_counter(), api_key)
    else:
        raise ValueError(f"unknown door {door!r}: grpc, http or openai")
    try:
        workers = await client.workers()
        workload = await sized(workload, client, config.block_size)
        before = await scrape_counters(metrics_url, api_key) if metrics_url else None
        client.start = time.perf_counter()
        start_monotonic = time.monotonic()  # the same instant on every process's clock
        records = await run_bench(client, workload, tokens, config, progress)
        after = (
            await scrape_counters(metrics_url, api_key)
            if metrics_url and before is not None
            else None
        )
    finally:
        await client.close()
    info = dict(
        asdict(config),
        workload=type(workload).__name__,
        options=asdict(workload),
        address=address,
        door=door,
        server_kind=getattr(client, "kind", "baton"),
        metrics_url=metrics_url,
        start_monotonic=start_monotonic,
    )
    summary = summarize(records, slo, workers, info)
    if before is not None and after is not None:
        rise = counter_rise(before, after)
        summary["kv"]["kv_bytes_moved"] = rise["kv_bytes_moved"]
        summary["kv"]["transfers"] = rise["kv_transfers"]
        summary["kv"]["transfer_s"] = rise["kv_transfer_s"]
        summary["engine_steps"] = rise["engine_steps"]
        for key in (
            "tier_read_bytes",
            "tier_written_bytes",
            "tier_dropped_writes",
            "tier_loads",
            "tier_load_s",
        ):
            summary["kv"][key] = rise[key]
        summary["kv"]["pulls"] = rise["pulls"]
        summary["kv"]["pull_bytes"] = rise["pull_bytes"]
        summary["kv"]["pull_decisions"] = rise["pull_decisions"]
    return summary, records


async def sized(workload: Workload, client: GrpcClient | HttpClient, block_size: int) -> Workload:
    """A workload that sizes itself from one worker's KV capacity (live_context_x > 0 and no
    kv_tokens given: perf/bench/agent_workload.py) with the largest decode worker's KV blocks
    from ClusterStatus; any other workload as it is. Over HTTP there is no ClusterStatus:
    such a workload needs its kv_tokens option."""
    if getattr(workload, "live_context_x", 0) <= 0 or getattr(workload, "kv_tokens", 1) > 0:
        return workload
    blocks = await client.kv_blocks() if isinstance(client, GrpcClient) else None
    if not blocks:
        raise ValueError(
            "live_context_x needs one worker's KV capacity: give --option kv_tokens=N "
            "(ClusterStatus, over gRPC, reported none)"
        )
    return replace(workload, kv_tokens=blocks * block_size)
