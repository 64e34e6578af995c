"""The simulated `baton bench` run: perf/bench/driver.py's pacing (arrivals, burstiness,
--max-concurrency, sessions claiming their turns from the budget, --duration) in simulated
time, answers by `stand_in_answer`; every request recorded as a RequestRecord."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator

from engine.block_hash import hash_prompt_blocks
from engine.step_model import StepModel
from perf.bench.arrivals import arrival_times
from perf.bench.driver import BenchConfig, Budget
from perf.bench.timeline import RequestRecord
from perf.bench.workloads import (
    OneShot,
    Session,
    TokenSpace,
    TraceWorkload,
    Workload,
    stand_in_answer,
)
from perf.sim.cluster import ClusterConfig, SimCluster
from perf.sim.events import EventLoop
from perf.sim.request import SimRequest
from perf.sim.trace import HashedSpec, trace_sessions


class SimRun:
    """One simulated run; run() returns the records in send order."""

    def __init__(
        self,
        workload: Workload,
        tokens: TokenSpace,
        config: BenchConfig,
        cluster: ClusterConfig,
        model: StepModel,
    ) -> None:
        self.tokens, self.config = tokens, config
        self.loop = EventLoop()
        self.cluster = SimCluster(cluster, model, self.loop)
        self.budget = Budget(config)
        self.slots = config.max_concurrency or math.inf
        self.blocked: deque = deque()  # an arrival waiting for a slot (or for turns)
        self.in_flight = 0  # sessions started and not ended
        self.oracle: set[int] = set()
        self.records: list[RequestRecord] = []
        bs = cluster.worker.block_size
        self.sessions: Iterator[Session | OneShot[HashedSpec]]
        if isinstance(workload, TraceWorkload) and not workload.has_conversations():
            self.sessions = trace_sessions(workload, bs, config.seed)
        else:
            self.sessions = workload.sessions(tokens, config.seed)
        self.arrivals = arrival_times(config.request_rate, config.burstiness, config.seed)
        self.stopped = False

    def run(self) -> list[RequestRecord]:
        self._next_arrival()
        self.loop.run()
        return sorted(self.records, key=lambda r: r.send_s)

    # ---- arrivals (perf/bench/driver.py run_bench's loop) -------------------------------
    def _next_arrival(self) -> None:
        for session in self.sessions:
            first = session.next_turn(None)
            if first is None:
                continue
            at = first.arrival_s if first.arrival_s is not None else next(self.arrivals)
            if self.config.duration_s is not None and at >= self.config.duration_s:
                return
            self.loop.at(at, self._arrive, session, first)
            return

    def _arrive(self, session, first) -> None:
        if self.slots <= 0:
            self.blocked.append((session, first))
            return
        self.slots -= 1
        turns = self.budget.take(self.loop.now, getattr(session, "num_turns", 1))
        if not turns:
            self.slots += 1
            if self.in_flight:  # a session that ends early gives back its unsent turns
                self.blocked.appendleft((session, first))
                return
            self.stopped = True
            return
        self.in_flight += 1
        self._send(session, first, turns)
        self._next_arrival()

    def _release_slot(self) -> None:
        self.slots += 1
        self.in_flight -= 1
        if self.blocked and not self.stopped:
            self._arrive(*self.blocked.popleft())

    # ---- one request ---------------------------------------------------------------------
    def _send(self, session, spec, turns: int) -> None:
        if spec is None or self.loop.now >= self.budget.until:
            self.budget.left += turns
            self._release_slot()
            return
        bs = self.cluster.block_size
        if isinstance(spec, HashedSpec):
            hashes, n = list(spec.block_hashes), spec.num_prompt_tokens
        else:
            n = len(spec.prompt_token_ids)
            hashes = hash_prompt_blocks(
                spec.prompt_token_ids, bs, self.config.hash_seed, spec.cache_salt
            )
        request = SimRequest(
            spec.request_id, hashes, n, spec.max_tokens, self.loop.now, spec.kind, spec.tenant
        )
        request.oracle_cached_tokens = self._oracle(hashes, n)
        request.on_done = lambda r: self._done(r, session, spec, turns - 1)
        self.cluster.route(request)

    def _oracle(self, hashes: list[int], n: int) -> int:
        """perf/bench/oracle.py's OracleCache on the hashes."""
        limit, hits = min((n - 1) // self.cluster.block_size, len(hashes)), 0
        while hits < limit and hashes[hits] in self.oracle:
            hits += 1
        self.oracle.update(hashes)
        return hits * self.cluster.block_size

    def _done(self, r: SimRequest, session, spec, turns_left: int) -> None:
        self.records.append(
            RequestRecord(
                request_id=r.request_id,
                send_s=r.send_s,
                end_s=r.end_s,
                chunks=tuple(r.chunks),
                prompt_tokens=r.prompt_tokens,
                cached_tokens=r.cached_tokens,
                oracle_cached_tokens=r.oracle_cached_tokens,
                prefill_worker=r.prefill_worker,
                decode_worker=r.decode_worker,
                kind=r.kind,
                tenant=r.tenant,
            )
        )
        if turns_left <= 0:
            self._release_slot()
            return
        answer = (
            None
            if isinstance(spec, HashedSpec)
            else stand_in_answer(spec, self.tokens, self.config.seed)
        )
        self._send(session, session.next_turn(answer), turns_left)


def simulate(
    workload: Workload,
    tokens: TokenSpace,
    config: BenchConfig,
    cluster: ClusterConfig,
    model: StepModel,
) -> tuple[list[RequestRecord], SimRun]:
    """Run the workload through the simulated cluster: (records in send order, the run)."""
    run = SimRun(workload, tokens, config, cluster, model)
    return run.run(), run
