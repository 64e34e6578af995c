"""Choosing one attempt's workers among the pools (router/pools.py).

The prefill worker: the named policy (router/policy.py) over the KV index, which is built
from every healthy worker's own stored/removed events (refresh_index), the prefill tokens
queued on each worker since dispatch, and the workers' measured rates (router/kv_cost.py:
a tier hit costs its load time). The decode worker: free KV blocks, running requests and its
own cached prefix. A session's workers are credited its affinity (router/sessions.py). The
decode worker prefills the prompt itself (no KV moves) in aggregated mode, and when its
uncached tail is at most local_prefill_tokens (conditional disaggregation).

When the prompt's longest cached prefix is on a decode worker (turn N+1 of a conversation
whose turn N that worker decoded), kv_cost.choose_pull picks the cheapest of: the decode
worker prefills the tail itself (local, when the tail is short enough), the prefill worker
pulls the blocks it lacks from that decode worker and computes the rest (pull), or the
prefill worker computes them (recompute).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass

from engine.block_hash import BlockHash
from kvtransfer.worker_api import DecodeAPI, PrefillAPI, WorkerStats
from router.kv_cost import LOCAL, PULL, CostBook, PullCase, choose_pull
from router.policy import (
    DecodeChoice,
    DecodeLoad,
    NoWorkerAvailable,
    Policy,
    PrefillChoice,
    WorkerLoad,
    choose_decode,
    choose_prefill,
    make_policy,
)
from router.pools import PoolView, WorkerPools
from router.sessions import AFFINITY_TOKENS, SessionBook, SessionHint
from router.worker_failures import ask

CAPACITY_POLL_S = 0.2  # how often a request waiting for free decode KV blocks looks again
RATES_PERIOD_S = 2.0  # how often the prefill workers' rates are read from their stats


@dataclass(frozen=True, slots=True)
class PullOrder:
    """Before the prefill, the prefill worker pulls from decode worker `source` the blocks it
    lacks of the prompt's first num_blocks (which `source` holds in its KV cache)."""

    source: str
    num_blocks: int  # leading prompt blocks asked for
    num_pulled: int  # of those, the ones the prefill worker lacks (expected to move)


@dataclass(frozen=True, slots=True)
class Choice:
    """Where one attempt runs, and what the choice expects of it."""

    prefill: tuple[str, PrefillAPI] | None  # None: the decode worker prefills (local)
    decode: tuple[str, DecodeAPI]
    policy: str  # the prefill policy's name (the decision metric's label)
    uncached_tokens: int  # prompt tokens the prefill worker computes (queued from dispatch)
    fits: bool  # the decode worker had free blocks for the whole prompt
    can_fit_later: bool  # some decode worker's whole KV cache can hold the prompt
    pull: PullOrder | None = None  # a pull before the prefill
    pull_decision: str | None = None  # kv_cost's PULL | LOCAL | RECOMPUTE, when one was due
    cached: tuple[int, int] = (0, 0)  # the chosen worker's expected hits: (device, tier) tokens
    tier_medium: str | None = None  # the tier those tier hits are in

    @property
    def local(self) -> bool:
        return self.prefill is None


class WorkerChooser:
    """Chooses workers for attempts; configure() changes the policy and the local-prefill
    threshold in place."""

    def __init__(
        self,
        pools: WorkerPools,
        calls: Executor,
        policy: str | Policy = "cache_aware",
        local_prefill_tokens: int = 0,
        sessions: SessionBook | None = None,
        affinity_tokens: int = AFFINITY_TOKENS,
    ) -> None:
        self.pools = pools
        self._calls = calls  # workers are asked side by side (each call may be a round trip)
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.policy_name = policy if isinstance(policy, str) else type(policy).__name__
        # Conditional disaggregation: when the chosen decode worker's uncached tail is at
        # most this many tokens, it prefills locally and no KV moves (0 = always transfer).
        self.local_prefill_tokens = local_prefill_tokens
        self.costs = CostBook()  # measured rates: decode workers' at every choice
        self.sessions = sessions if sessions is not None else SessionBook()
        self.affinity_tokens = affinity_tokens
        # One refresh at a time, so that a worker's KV events apply in the order it emitted
        # them; taking them is a network round trip, done without the pools' lock.
        self._refresh_lock = threading.Lock()
        self._rates_due = 0.0  # monotonic time of the next read of the prefill workers' rates

    def configure(self, policy: str, local_prefill_tokens: int) -> None:
        """A new policy (by name; the same name keeps its state) and threshold."""
        if policy != self.policy_name:
            self.policy, self.policy_name = make_policy(policy), policy
        self.local_prefill_tokens = local_prefill_tokens

    def refresh_index(self) -> None:
        """Apply the KV events every healthy worker published since the last refresh, and
        every RATES_PERIOD_S read the prefill workers' rates. A worker that does not answer is
        skipped (its events come with a later refresh)."""
        with self._refresh_lock:
            workers = self.pools.refresh_targets()
            events = self._calls.map(lambda w: ask(w[0], "kv_events", w[1].kv_events), workers)
            self.pools.apply_kv_events(
                {worker_id: e for (worker_id, _), e in zip(workers, events, strict=True)}
            )
            now = time.monotonic()
            if now >= self._rates_due:
                self._rates_due = now + RATES_PERIOD_S
                prefill = [w for w in workers if w[0] in self.pools.prefill]
                stats = self._calls.map(lambda w: ask(w[0], "stats", lambda: w[1].stats()), prefill)
                for (worker_id, _), s in zip(prefill, stats, strict=True):
                    if s is not None:
                        self.costs.observe(worker_id, s)

    def choose(
        self,
        hashes: list[BlockHash],
        n: int,
        failed: Mapping[str, int],
        deadline: float,
        session: SessionHint | None = None,
    ) -> Choice:
        """The workers of one attempt of an n-token prompt. Until `deadline` (monotonic) it
        waits for a usable worker in each pool (one being replaced or restarted) and for a
        decode worker with free KV blocks for the prompt (running requests free them); then
        NoWorkerAvailable, or a choice that does not fit (the reservation says why). Workers
        in `failed` are left out until a later health report found them healthy."""
        self.refresh_index()
        while True:
            try:
                choice = self._choose(hashes, n, failed, session)
            except NoWorkerAvailable:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                self.pools.wait_for_change(min(left, 1.0))
                continue
            left = deadline - time.monotonic()
            if choice.fits or not choice.can_fit_later or left <= 0:
                return choice
            time.sleep(min(CAPACITY_POLL_S, left))

    def _choose(
        self,
        hashes: list[BlockHash],
        n: int,
        failed: Mapping[str, int],
        session: SessionHint | None,
    ) -> Choice:
        view = self.pools.view(failed)
        index, bs = self.pools.index, view.block_size
        affinity = self.sessions.affinity(session, self.affinity_tokens)
        decode_loads = self._decode_loads(view)
        prefill = None
        if not view.aggregated and not self._stranded(view, failed):
            loads = [
                WorkerLoad(w, self.pools.load.queued(w), healthy=w in view.usable)
                for w in view.prefill
            ]
            prefill = choose_prefill(
                self.policy,
                hashes,
                bs,
                loads,
                index,
                num_prompt_tokens=n,
                costs=self.costs,
                affinity=affinity,
            )
        decode = choose_decode(
            hashes, n, bs, decode_loads, index, costs=self.costs, affinity=affinity
        )
        tail = n - decode.hit_blocks * bs
        local = prefill is None or tail <= self.local_prefill_tokens
        pull, decision = None, None
        if prefill is not None:
            pull, decision = self._pull_or_local(hashes, n, prefill, decode, local, decode_loads)
            local = local if decision is None else decision == LOCAL
        worker = decode.worker_id if local or prefill is None else prefill.worker_id
        hits = index.hits(worker, hashes[: min(len(hashes), (n - 1) // bs)])
        if pull is not None:
            uncached = n - max(pull.num_blocks, hits.blocks) * bs
        else:
            uncached = n - hits.blocks * bs
        return Choice(
            prefill=None
            if local or prefill is None
            else (prefill.worker_id, view.prefill[prefill.worker_id]),
            decode=(decode.worker_id, view.decode[decode.worker_id]),
            policy=self.policy_name,
            uncached_tokens=0 if local or prefill is None else uncached,
            fits=decode.fits,
            can_fit_later=decode.can_fit_later,
            pull=pull,
            pull_decision=decision,
            cached=(hits.device * bs, hits.tier * bs),
            tier_medium=hits.medium,
        )

    def _pull_or_local(
        self,
        hashes: list[BlockHash],
        n: int,
        prefill: PrefillChoice,
        decode: DecodeChoice,
        local_ok: bool,
        decode_loads: list[DecodeLoad],
    ) -> tuple[PullOrder | None, str | None]:
        """(a pull to make, the decision) when a usable decode worker's KV cache holds more of
        the prompt than the chosen prefill worker has (KV cache and tier); (None, None) when
        none does: the choice stands as made."""
        index, bs = self.pools.index, self.pools.block_size
        hashes = hashes[: min(len(hashes), (n - 1) // bs)]
        p_hits = index.hits(prefill.worker_id, hashes)
        sources = {w.worker_id: index.prefix_hits(w.worker_id, hashes) for w in decode_loads}
        source = min(
            (w.worker_id for w in decode_loads if w.healthy), key=lambda w: (-sources[w], w)
        )
        if sources[source] <= p_hits.blocks:
            return None, None
        plan = choose_pull(
            PullCase(
                num_tokens=n,
                block_size=bs,
                prefill_hits=p_hits,
                prefill_queued=self.pools.load.queued(prefill.worker_id),
                prefill=self.costs.rates(prefill.worker_id),
                source_blocks=sources[source],
                pair_bytes_per_s=self.costs.pair_bytes_per_s(prefill.worker_id, source),
                decode=self.costs.rates(decode.worker_id),
                local_tail=n - decode.hit_blocks * bs if local_ok else None,
            )
        )
        if plan.decision != PULL:
            return None, plan.decision
        return PullOrder(source, sources[source], plan.pull_blocks), plan.decision

    @staticmethod
    def _stranded(view: PoolView, failed: Mapping[str, int]) -> bool:
        """A moving request whose prefill workers all failed under it is prefilled on its
        decode worker rather than failed: nothing is lost while a decode worker is left."""
        return bool(failed) and not any(w in view.usable for w in view.prefill)

    def _decode_loads(self, view: PoolView) -> list[DecodeLoad]:
        """Each decode worker's load from its stats (unusable, or silent: unhealthy); their
        rates go into the cost book."""
        stats: Iterator[WorkerStats | None] = self._calls.map(
            lambda d: ask(d[0], "stats", d[1].stats) if d[0] in view.usable else None,
            view.decode.items(),
        )
        loads = []
        for w, s in zip(view.decode, stats, strict=True):
            if s is None:
                loads.append(DecodeLoad(w, 0, 0, healthy=False))
                continue
            self.costs.observe(w, s)
            loads.append(DecodeLoad(w, s.free_blocks, s.num_requests, total_blocks=s.num_blocks))
        return loads
