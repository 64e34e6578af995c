"""Choosing one attempt's workers among the pools (router/pools.py).

The prefill worker: the named policy (router/policy.py) over the KV index, which is built
from every healthy worker's own stored/removed events (refresh_index), and the prefill tokens
queued on each worker since dispatch. The decode worker: free KV blocks, running requests and
its own cached prefix. The decode worker prefills the prompt itself (no KV moves) in
aggregated mode, and when its uncached tail is at most local_prefill_tokens (conditional
disaggregation).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass

from engine.block_hash import BlockHash
from kvtransfer.worker_api import DecodeAPI, PrefillAPI, WorkerStats
from router.policy import (
    DecodeLoad,
    NoWorkerAvailable,
    Policy,
    WorkerLoad,
    choose_decode,
    choose_prefill,
    make_policy,
)
from router.pools import PoolView, WorkerPools
from router.worker_failures import ask

CAPACITY_POLL_S = 0.2  # how often a request waiting for free decode KV blocks looks again


@dataclass(frozen=True, slots=True)
class Choice:
    """Where one attempt runs, and what the choice expects of it."""

    prefill: tuple[str, PrefillAPI] | None  # None: the decode worker prefills (local)
    decode: tuple[str, DecodeAPI]
    policy: str  # the prefill policy's name (the decision metric's label)
    uncached_tokens: int  # prompt tokens the prefill worker computes (queued from dispatch)
    fits: bool  # the decode worker had free blocks for the whole prompt
    can_fit_later: bool  # some decode worker's whole KV cache can hold the prompt

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
    ) -> None:
        self.pools = pools
        self._calls = calls  # workers are asked side by side (each call may be a round trip)
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.policy_name = policy if isinstance(policy, str) else type(policy).__name__
        # Conditional disaggregation: when the chosen decode worker's uncached tail is at
        # most this many tokens, it prefills locally and no KV moves (0 = always transfer).
        self.local_prefill_tokens = local_prefill_tokens
        # One refresh at a time, so that a worker's KV events apply in the order it emitted
        # them; taking them is a network round trip, done without the pools' lock.
        self._refresh_lock = threading.Lock()

    def configure(self, policy: str, local_prefill_tokens: int) -> None:
        """A new policy (by name; the same name keeps its state) and threshold."""
        if policy != self.policy_name:
            self.policy, self.policy_name = make_policy(policy), policy
        self.local_prefill_tokens = local_prefill_tokens

    def refresh_index(self) -> None:
        """Apply the KV events every healthy worker published since the last refresh. A
        worker that does not answer is skipped (its events come with a later refresh)."""
        with self._refresh_lock:
            workers = self.pools.refresh_targets()
            events = self._calls.map(lambda w: ask(w[0], "kv_events", w[1].kv_events), workers)
            self.pools.apply_kv_events(
                {worker_id: e for (worker_id, _), e in zip(workers, events, strict=True)}
            )

    def choose(
        self, hashes: list[BlockHash], n: int, failed: Mapping[str, int], deadline: float
    ) -> Choice:
        """The workers of one attempt of an n-token prompt. Until `deadline` (monotonic) it
        waits for a usable worker in each pool (one being replaced or restarted) and for a
        decode worker with free KV blocks for the prompt (running requests free them); then
        NoWorkerAvailable, or a choice that does not fit (the reservation says why). Workers
        in `failed` are left out until a later health report found them healthy."""
        self.refresh_index()
        while True:
            try:
                choice = self._choose(hashes, n, failed)
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

    def _choose(self, hashes: list[BlockHash], n: int, failed: Mapping[str, int]) -> Choice:
        view = self.pools.view(failed)
        index = self.pools.index
        prefill = None
        if not view.aggregated and not self._stranded(view, failed):
            loads = [
                WorkerLoad(w, self.pools.load.queued(w), healthy=w in view.usable)
                for w in view.prefill
            ]
            prefill = choose_prefill(
                self.policy, hashes, view.block_size, loads, index, num_prompt_tokens=n
            )
        decode = choose_decode(hashes, n, view.block_size, self._decode_loads(view), index)
        tail = n - decode.hit_blocks * view.block_size
        local = prefill is None or tail <= self.local_prefill_tokens
        return Choice(
            prefill=None
            if local or prefill is None
            else (prefill.worker_id, view.prefill[prefill.worker_id]),
            decode=(decode.worker_id, view.decode[decode.worker_id]),
            policy=self.policy_name,
            uncached_tokens=0 if local or prefill is None else n - prefill.cached_tokens,
            fits=decode.fits,
            can_fit_later=decode.can_fit_later,
        )

    @staticmethod
    def _stranded(view: PoolView, failed: Mapping[str, int]) -> bool:
        """A moving request whose prefill workers all failed under it is prefilled on its
        decode worker rather than failed: nothing is lost while a decode worker is left."""
        return bool(failed) and not any(w in view.usable for w in view.prefill)

    def _decode_loads(self, view: PoolView) -> list[DecodeLoad]:
        """Each decode worker's load from its stats (unusable, or silent: unhealthy)."""
        stats: Iterator[WorkerStats | None] = self._calls.map(
            lambda d: ask(d[0], "stats", d[1].stats) if d[0] in view.usable else None,
            view.decode.items(),
        )
        return [
            DecodeLoad(w, s.free_blocks, s.num_requests, total_blocks=s.num_blocks)
            if s is not None
            else DecodeLoad(w, 0, 0, healthy=False)
            for w, s in zip(view.decode, stats, strict=True)
        ]
