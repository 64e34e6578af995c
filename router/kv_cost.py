"""What a prompt's KV costs a worker, in seconds, for the router's choices (pure, no RPC).

A worker comes by each block of a prompt in one of four ways:
    device hit   its KV cache holds it                  free
    tier hit     its KV tier holds it (loaded)          block_bytes / the tier's load bandwidth
    pulled       a decode worker sends it (a pull)      block_bytes / the pair's bandwidth
    computed     prefilled                              block_size x prefill seconds per token
The rates are measured where the cluster measures them: a worker's prefill speed is its
step-time profile's (WorkerStats.prefill_token_seconds, engine/step_model.py), a tier's load
bandwidth its bytes read over its load seconds (WorkerStats.tier_bytes_read /
tier_load_seconds), a pair's bandwidth what the pulls between them moved over the time they
took (PullResult.payload_bytes / seconds). Until a rate is measured a conservative default
stands in (slower than any tier or link this runs on).

The cache-aware policy (router/policy.py) counts a tier hit in prefill tokens: the tier's
seconds per token over the prefill's, kept within [MIN_TIER_COST, 1], so a tier hit is
always dearer than a device hit and cheaper than computing the block. choose_pull weighs the
three ways turn N+1 of a conversation can start when its longest cached prefix is on a decode
worker (router/worker_choice.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kvtransfer.worker_api import PullResult, WorkerStats
from router.kv_index import PrefixHits, WorkerId

DEFAULT_PREFILL_TOKEN_S = 0.004  # engine/step_model.py FALLBACK's prefill seconds per token
DEFAULT_BLOCK_BYTES = 1 << 20  # before a worker reports its block size in bytes
# Load bandwidth before a tier's first load, bytes/s (a cold local disk; pageable host copies).
DEFAULT_TIER_BYTES_PER_S = {"host": 2e9, "disk": 2e8}
DEFAULT_OTHER_TIER_BYTES_PER_S = 2e8
DEFAULT_PAIR_BYTES_PER_S = 1e8  # a pair's pull bandwidth before its first pull
PULL_OVERHEAD_S = 0.005  # one pull's ask and answer, past its payload
MIN_TIER_COST = 0.01  # a tier hit costs at least this fraction of computing its tokens
PAIR_EWMA = 0.5  # weight of the newest pull in a pair's bandwidth

PULL, LOCAL, RECOMPUTE = "pull", "local", "recompute"  # router_pull_decisions_total's labels


@dataclass(frozen=True, slots=True)
class WorkerRates:
    """One worker's measured (or default) speeds."""

    prefill_token_s: float = DEFAULT_PREFILL_TOKEN_S
    block_bytes: int = DEFAULT_BLOCK_BYTES
    tier_bytes_per_s: float | None = None  # measured; None before the tier's first load

    @classmethod
    def of(cls, stats: WorkerStats) -> WorkerRates:
        """The rates a worker's stats report; a field it leaves 0 keeps the default."""
        measured = stats.tier_bytes_read > 0 and stats.tier_load_seconds > 0
        return cls(
            prefill_token_s=stats.prefill_token_seconds or DEFAULT_PREFILL_TOKEN_S,
            block_bytes=stats.kv_block_bytes or DEFAULT_BLOCK_BYTES,
            tier_bytes_per_s=stats.tier_bytes_read / stats.tier_load_seconds if measured else None,
        )

    def tier_block_s(self, medium: str | None) -> float:
        """Seconds to load one block from the worker's tier."""
        rate = self.tier_bytes_per_s or DEFAULT_TIER_BYTES_PER_S.get(
            medium or "", DEFAULT_OTHER_TIER_BYTES_PER_S
        )
        return self.block_bytes / rate

    def tier_token_cost(self, medium: str | None, block_size: int) -> float:
        """A tier-hit token's cost in prefill tokens, within [MIN_TIER_COST, 1]."""
        ratio = self.tier_block_s(medium) / (block_size * self.prefill_token_s)
        return min(1.0, max(MIN_TIER_COST, ratio))

    def prefill_s(self, num_tokens: int, hits: PrefixHits, block_size: int) -> float:
        """Seconds to prefill a num_tokens prompt with these hits: load the tier hits,
        compute the rest."""
        computed = max(0, num_tokens - hits.blocks * block_size)
        return computed * self.prefill_token_s + hits.tier * self.tier_block_s(hits.medium)


class CostBook:
    """Every worker's WorkerRates and every pair's pull bandwidth as last measured;
    thread-safe. An unknown worker or pair has the defaults."""

    def __init__(self) -> None:
        self._rates: dict[WorkerId, WorkerRates] = {}
        self._pairs: dict[tuple[WorkerId, WorkerId], float] = {}  # (prefill, decode) -> B/s
        self._lock = threading.Lock()

    def observe(self, worker_id: WorkerId, stats: WorkerStats) -> None:
        """The worker's rates from its latest stats (a tier not loaded from yet keeps the
        bandwidth measured before, if any)."""
        rates = WorkerRates.of(stats)
        with self._lock:
            old = self._rates.get(worker_id)
            if rates.tier_bytes_per_s is None and old is not None:
                rates = WorkerRates(rates.prefill_token_s, rates.block_bytes, old.tier_bytes_per_s)
            self._rates[worker_id] = rates

    def observe_pull(self, prefill_id: WorkerId, decode_id: WorkerId, result: PullResult) -> None:
        """A pull that moved bytes updates the pair's bandwidth (EWMA)."""
        if result.payload_bytes <= 0 or result.seconds <= 0:
            return
        rate = result.payload_bytes / result.seconds
        with self._lock:
            old = self._pairs.get((prefill_id, decode_id))
            self._pairs[(prefill_id, decode_id)] = (
                rate if old is None else PAIR_EWMA * rate + (1 - PAIR_EWMA) * old
            )

    def rates(self, worker_id: WorkerId) -> WorkerRates:
        with self._lock:
            return self._rates.get(worker_id) or WorkerRates()

    def pair_bytes_per_s(self, prefill_id: WorkerId, decode_id: WorkerId) -> float:
        with self._lock:
            return self._pairs.get((prefill_id, decode_id), DEFAULT_PAIR_BYTES_PER_S)

    def forget(self, worker_id: WorkerId) -> None:
        """A worker left or restarted: its rates and pairs are measured afresh."""
        with self._lock:
            self._rates.pop(worker_id, None)
            for pair in [p for p in self._pairs if worker_id in p]:
                del self._pairs[pair]


@dataclass(frozen=True, slots=True)
class PullCase:
    """What choose_pull weighs for one prompt of num_tokens tokens (blocks of block_size)."""

    num_tokens: int
    block_size: int
    prefill_hits: PrefixHits  # the chosen prefill worker's
    prefill_queued: int  # prefill tokens queued on it
    prefill: WorkerRates
    source_blocks: int  # the decode worker's leading blocks in its KV cache (a pull's source)
    pair_bytes_per_s: float  # the prefill worker <- that decode worker
    decode: WorkerRates  # that decode worker's
    local_tail: int | None  # tokens it would compute itself (None: local prefill not allowed)


@dataclass(frozen=True, slots=True)
class PullPlan:
    """choose_pull's answer: the decision and each option's predicted seconds."""

    decision: str  # PULL | LOCAL | RECOMPUTE
    seconds: dict[str, float]
    pull_blocks: int  # blocks a pull would move (decision PULL: it moves them)


def choose_pull(case: PullCase) -> PullPlan:
    """The cheapest of: the decode worker prefills the tail itself (LOCAL, no KV moves: only
    when allowed); the prefill worker pulls the blocks it lacks from the decode worker and
    computes the rest (PULL); the prefill worker computes all it lacks (RECOMPUTE). Both
    remote options queue behind the prefill worker's queued tokens and then send the decode
    worker the same tail, whose transfer is left out (counting it would only favour LOCAL
    more). Ties go to LOCAL, then PULL."""
    bs = case.block_size
    p = case.prefill
    queued_s = case.prefill_queued * p.prefill_token_s
    pull_blocks = max(0, case.source_blocks - case.prefill_hits.device)
    after_pull = PrefixHits(max(case.source_blocks, case.prefill_hits.device))
    seconds: dict[str, float] = {}
    if case.local_tail is not None:
        seconds[LOCAL] = case.local_tail * case.decode.prefill_token_s
    if pull_blocks > 0:
        seconds[PULL] = (
            queued_s
            + PULL_OVERHEAD_S
            + pull_blocks * p.block_bytes / case.pair_bytes_per_s
            + p.prefill_s(case.num_tokens, after_pull, bs)
        )
    seconds[RECOMPUTE] = queued_s + p.prefill_s(case.num_tokens, case.prefill_hits, bs)
    decision = min(seconds, key=seconds.__getitem__)  # first of the cheapest, in that order
    return PullPlan(decision, seconds, pull_blocks if decision == PULL else 0)
