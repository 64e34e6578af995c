"""Router: picks the prefill and decode worker of each request and streams its tokens.

Transport-agnostic: workers are kvtransfer.worker_api.PrefillAPI / DecodeAPI (in-process
workers, or kvtransfer.worker_client clients over RPC or Ray). The prefill choice uses a KV
index built from the workers' own stored/removed events, the queued prefill tokens counted
from dispatch, and the named policy; the decode choice uses free blocks, running requests and
the decode worker's own cached prefix. The front doors (router/server.py for gRPC, the HTTP
server) translate the dicts of `generate`.

Aggregated mode (a cluster configured with 0 prefill workers): every request is prefilled on
its decode worker (chunked prefill, no KV moves), the decode worker chosen cache-aware from its
own KV events. It differs from a disaggregated cluster whose prefill pool is momentarily empty
(workers being replaced or restarted), where requests wait for a prefill worker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from engine.block_hash import hash_prompt_blocks
from engine.errors import InvalidRequestError, NoFreeBlocksError
from kvtransfer.worker_api import DecodeAPI, PrefillAPI, Role, WorkerStats
from router.handoff import generate_disaggregated, generate_local
from router.kv_index import KVIndex
from router.metrics import RouterMetrics
from router.migration import PairNotReady, Progress, WorkerFailed, watch
from router.policy import (
    DecodeLoad,
    LoadTracker,
    NoWorkerAvailable,
    Policy,
    WorkerLoad,
    choose_decode,
    choose_prefill,
    make_policy,
)

logger = logging.getLogger(__name__)

CAPACITY_POLL_S = 0.2  # how often a request waiting for free decode KV blocks looks again
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """One worker as Router.status() reports it: stats is None when it did not answer."""

    worker_id: str
    role: Role
    healthy: bool
    stats: WorkerStats | None
    error: str | None = None


class Router:
    """Routes requests over a fixed set of prefill and decode workers."""

    def __init__(
        self,
        prefill: dict[str, PrefillAPI],
        decode: dict[str, DecodeAPI],
        *,
        block_size: int,
        hash_seed: str,
        policy: str | Policy = "cache_aware",
        timeout: float = 600.0,
        local_prefill_tokens: int = 0,
        max_model_len: int | None = None,
        wait_for_workers_s: float = 0.0,
        aggregated: bool = False,
        migration_limit: int = 3,
    ) -> None:
        self.prefill = dict(prefill)
        self.decode = dict(decode)
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.policy_name = policy if isinstance(policy, str) else type(policy).__name__
        self.timeout = timeout
        # Conditional disaggregation: when the chosen decode worker's uncached tail is at
        # most this many tokens, it prefills locally and no KV moves (0 = always transfer).
        self.local_prefill_tokens = local_prefill_tokens
        self.max_model_len = max_model_len  # longer prompts are refused (None: no limit)
        # With no healthy worker in a pool, a request waits this long for one (a worker
        # being replaced or restarted) before it fails with NoWorkerAvailable.
        self.wait_for_workers_s = wait_for_workers_s
        # Aggregated mode as configured, and as in effect (on _lock; see _set_mode): every
        # request is prefilled on its decode worker and the prefill pool takes none.
        self._configured_aggregated = self.aggregated = aggregated
        # A request whose worker fails moves to another one at most this many times
        # (router/migration.py); past it the client gets MigrationLimitExceeded.
        self.migration_limit = migration_limit
        self.index = KVIndex()
        self.load = LoadTracker()
        for worker_id in [*self.prefill, *self.decode]:
            self.index.add_worker(worker_id)
        # Guards the pools (prefill, decode, block_size, hash_seed), the index's membership,
        # _healthy, _active, _refreshing and the token counters: a worker set_workers removed
        # is never picked once it returns, and _active names only workers of some pool.
        self._lock = threading.Lock()
        # On _lock; notified when the pools or health change (a request waiting for a worker
        # looks again) and when an index refresh ends (_refreshing went False).
        self._changed = threading.Condition(self._lock)
        # One refresh at a time, so that a worker's KV events apply in the order it emitted
        # them; taking them is a network round trip, done without holding _lock.
        self._refreshing = False
        # Workers are asked side by side (each call may be a network round trip).
        self._calls = ThreadPoolExecutor(max_workers=16, thread_name_prefix="router-call")
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.num_migrations = 0  # requests moved after a worker failed (a metric's counter)
        # request id -> ((prefill id, worker) or None when prefilled locally, (decode id, worker))
        self._active: dict[str, tuple[tuple[str, PrefillAPI] | None, tuple[str, DecodeAPI]]] = {}
        self._healthy: dict[str, bool] = {}  # from the controller; unknown = healthy
        # The controller's health reports so far, and per worker the last one that found it
        # healthy: a worker that failed a request is tried again by that request only once a
        # later report found it healthy (restarted and re-paired, or answering again).
        self._num_reports = 0
        self._healthy_at: dict[str, int] = {}
        self.metrics = RouterMetrics()  # router/metrics.py; the scrape: metrics_exposition
        self.metrics.read_counter(
            "request_migrations",
            "Requests moved to other workers after a worker failed.",
            lambda: self.num_migrations,
        )

    def set_workers(
        self,
        prefill: dict[str, PrefillAPI],
        decode: dict[str, DecodeAPI],
        *,
        block_size: int | None = None,
        hash_seed: str | None = None,
        max_model_len: int | None = None,
    ) -> None:
        """Replace the pools new requests are routed to. A worker left out takes no new
        request once this returns; requests already on it finish (see active_counts)."""
        with self._changed:
            old = {*self.prefill, *self.decode}
            new = {*prefill, *decode}
            for worker_id in old - new:
                self.index.remove_worker(worker_id)
                self.load.forget(worker_id)
                self._healthy.pop(worker_id, None)
            seed = self.hash_seed if hash_seed is None else hash_seed  # None: unchanged
            if block_size is not None and (block_size, seed) != (self.block_size, self.hash_seed):
                for worker_id in old & new:  # its hashes were computed the old way
                    self.index.remove_worker(worker_id)
                    self.index.add_worker(worker_id)
                self.block_size, self.hash_seed = block_size, seed
            for worker_id in new - old:
                self.index.add_worker(worker_id)
            self.prefill, self.decode = dict(prefill), dict(decode)
            if max_model_len is not None:
                self.max_model_len = max_model_len
            self._set_mode()
            self._changed.notify_all()

    def configure(
        self,
        policy: str,
        local_prefill_tokens: int,
        wait_for_workers_s: float,
        aggregated: bool = False,
        migration_limit: int | None = None,
    ) -> None:
        """Change the prefill policy, the conditional-disaggregation threshold, the wait for
        workers, aggregated mode and the migration limit (None: unchanged) in place."""
        if migration_limit is not None:
            self.migration_limit = migration_limit
        if policy != self.policy_name:
            self.policy, self.policy_name = make_policy(policy), policy
        self.local_prefill_tokens = local_prefill_tokens
        self.wait_for_workers_s = wait_for_workers_s
        with self._changed:
            self._configured_aggregated = aggregated
            self._set_mode()
            self._changed.notify_all()  # a request waiting for a prefill worker goes local

    def _set_mode(self) -> None:
        """On _lock. Aggregated takes effect at once (requests already on prefill workers
        finish there); leaving it waits until prefill workers are published, so that no
        request waits for a pool that is still starting."""
        self.aggregated = self._configured_aggregated or (self.aggregated and not self.prefill)

    def active_counts(self) -> dict[str, int]:
        """Running requests per worker id (prefill and decode side both count)."""
        counts: dict[str, int] = {}
        with self._lock:
            for prefill, (decode_id, _) in self._active.values():
                for worker_id in ([prefill[0]] if prefill else []) + [decode_id]:
                    counts[worker_id] = counts.get(worker_id, 0) + 1
        return counts

    def update_membership(self, health: dict) -> None:
        """Apply the controller's check_health(): restarted workers start with an empty cache,
        unhealthy ones get no new requests."""
        with self._changed:
            known = {*self.prefill, *self.decode}
            for worker_id in health.get("restarted", []):
                if worker_id in known:
                    self.index.remove_worker(worker_id)
                    self.index.add_worker(worker_id)
                    self.load.forget(worker_id)
            self._num_reports += 1
            for worker_id, ok in health.get("healthy", {}).items():
                if worker_id in known:
                    self._healthy[worker_id] = ok
                    if ok:
                        self._healthy_at[worker_id] = self._num_reports
            self._changed.notify_all()

    def abort(self, request_id: str) -> bool:
        """Abort a running request on its decode worker (which tells the prefill worker)."""
        with self._lock:
            workers = self._active.get(request_id)
        if workers is None:
            return False
        prefill, (_, decode) = workers
        decode.abort(request_id)
        if prefill is not None:
            prefill[1].abort(request_id)
        return True

    def status(self) -> list[WorkerStatus]:
        """Every worker's stats with its role and health (healthy: it answered)."""
        with self._lock:
            pools = ((Role.PREFILL, dict(self.prefill)), (Role.DECODE, dict(self.decode)))
        out = []
        for role, pool in pools:
            for worker_id, worker in pool.items():
                try:
                    out.append(WorkerStatus(worker_id, role, True, worker.stats()))
                except Exception as exc:  # noqa: BLE001 - reported as unhealthy
                    out.append(WorkerStatus(worker_id, role, False, None, str(exc)))
        return out

    def hit_rate(self) -> float:
        """Prompt tokens served from prefill workers' prefix caches / all prompt tokens."""
        return self.num_cached_tokens / max(1, self.num_prompt_tokens)

    def refresh_index(self) -> None:
        """Apply the KV events every healthy worker published since the last refresh. A
        worker that does not answer is skipped (its events come with a later refresh)."""
        with self._changed:
            while self._refreshing:
                self._changed.wait()
            self._refreshing = True
            workers = [
                (w, p)
                for w, p in [*self.prefill.items(), *self.decode.items()]
                if self._healthy.get(w, True)
            ]
        try:
            events = list(
                self._calls.map(lambda w: _ask(w[0], "kv_events", w[1].kv_events), workers)
            )
            with self._lock:
                current = {*self.prefill, *self.decode}
                for (worker_id, _), worker_events in zip(workers, events, strict=True):
                    if worker_events and worker_id in current:
                        self.index.apply(worker_id, worker_events)
        finally:
            with self._changed:
                self._refreshing = False
                self._changed.notify_all()

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: dict,
        cache_salt: str | None = None,
    ) -> Generator[dict, None, None]:
        """Output dicts of one request; the last carries prefill_worker and decode_worker.

        Up to wait_for_workers_s, a request waits for a healthy worker in each pool and for a
        decode worker with enough free KV blocks for its prompt (running requests free them
        as they finish), instead of failing. When a worker fails under it (router/migration.py)
        it moves: prompt + the tokens streamed so far go to other workers, the client's stream
        goes on; after migration_limit moves it fails with MigrationLimitExceeded."""
        progress = Progress(prompt_token_ids, params, self.migration_limit)
        # Workers this request failed on -> the health reports seen then: it goes back to one
        # only after a later report found it healthy again.
        failed: dict[str, int] = {}
        timer = self.metrics.start()  # TTFT, ITL, E2E and finish reason as clients see them
        deadline = time.monotonic() + self.wait_for_workers_s
        while True:
            prompt, attempt_params = progress.attempt()
            hashes = hash_prompt_blocks(prompt, self.block_size, self.hash_seed, cache_salt)
            try:
                again = yield from timer.track(
                    progress.track(
                        self._attempt(
                            request_id, prompt, attempt_params, cache_salt, hashes, deadline, failed
                        )
                    )
                )
            except NoWorkerAvailable as exc:
                if progress.failures:  # the workers it could move to are gone too
                    raise progress.no_worker_left(exc) from exc
                raise
            except WorkerFailed as exc:
                logger.warning("request %s: %s; moving it", request_id, exc)
                with self._lock:
                    failed[exc.worker_id] = self._num_reports
                progress.failed(exc)  # raises past migration_limit
                with self._lock:
                    self.num_migrations += 1
                deadline = time.monotonic() + self.wait_for_workers_s
                continue
            if not again:
                return

    def _attempt(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: dict,
        cache_salt: str | None,
        hashes: list,
        deadline: float,
        failed: dict[str, int] | None = None,
    ) -> Generator[dict, None, bool]:
        """Choose workers and stream the request; returns True (having streamed nothing) when
        it must be tried again: the pools changed while choosing, or the decode worker's
        blocks went to other requests between its stats and the reservation. Raises
        WorkerFailed when a worker fails (workers in `failed` are not chosen until a later
        health report found them healthy)."""
        n = len(prompt_token_ids)
        self.refresh_index()
        while True:
            try:
                choice, decode_choice, prefill_pool, decode_pool = self._choose(hashes, n, failed)
            except NoWorkerAvailable:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                with self._changed:  # a worker is being replaced or restarted: wait for it
                    self._changed.wait(min(left, 1.0))
                continue
            left = deadline - time.monotonic()
            if decode_choice.fits or not decode_choice.can_fit_later or left <= 0:
                break  # the reservation reports the shortage to the client
            time.sleep(min(CAPACITY_POLL_S, left))
        decode = (decode_choice.worker_id, decode_pool[decode_choice.worker_id])
        local = (
            choice is None  # aggregated
            or n - decode_choice.hit_blocks * self.block_size <= self.local_prefill_tokens
        )
        prefill = None if local else (choice.worker_id, prefill_pool[choice.worker_id])
        with self._lock:
            if request_id in self._active:
                raise InvalidRequestError(f"request id {request_id!r} is already running")
            stale = decode[0] not in self.decode or (
                prefill is not None and prefill[0] not in self.prefill
            )
            if not stale:
                self._active[request_id] = (prefill, decode)
        if stale:  # choose again among the new pools
            return True
        self.metrics.decided(self.policy_name, local)
        if local:
            try:
                yield from self._generate_local(
                    request_id, prompt_token_ids, params, cache_salt, decode
                )
            except WorkerFailed as exc:
                self._worker_failed(request_id, exc, [decode])
                raise
            return False
        if prefill is None or choice is None:  # not local: a prefill worker was chosen
            raise RuntimeError(f"request {request_id!r}: disaggregated without a prefill worker")
        uncached = n - choice.cached_tokens
        self.load.dispatched(choice.worker_id, uncached)  # load counts from dispatch
        prefilled = False
        try:
            for out in watch(
                generate_disaggregated(
                    prefill[1],
                    decode[1],
                    request_id,
                    prompt_token_ids,
                    params,
                    prefill_id=prefill[0],
                    decode_id=decode[0],
                    cache_salt=cache_salt,
                    timeout=self.timeout,
                ),
                decode[0],
            ):
                if not prefilled:
                    prefilled = True
                    self.load.prefilled(choice.worker_id, uncached)
                    self._count(n, out["num_cached_tokens"])
                if out["finished"]:
                    out.update(prefill_worker=prefill[0], decode_worker=decode[0], prompt_tokens=n)
                yield out
        except WorkerFailed as exc:
            self._worker_failed(request_id, exc, [prefill, decode])
            raise
        except PairNotReady as exc:
            logger.warning(
                "request %s: %s; waiting for the controller to pair them", request_id, exc
            )
            self._mark_unhealthy(exc.prefill_id, exc.decode_id)
            return True
        except Exception as exc:
            if not (
                not prefilled
                and isinstance(exc, NoFreeBlocksError)
                and decode_choice.can_fit_later
                and time.monotonic() + CAPACITY_POLL_S < deadline
            ):
                raise
        else:
            return False
        finally:
            self._finish(request_id)
            if not prefilled:
                self.load.prefilled(choice.worker_id, uncached)
        time.sleep(CAPACITY_POLL_S)  # the reservation was refused for now
        return True

    def _choose(self, hashes: list, n: int, failed: dict[str, int] | None = None):
        """(prefill choice, or None when aggregated; decode choice, prefill pool, decode pool)
        among healthy workers, leaving out those in `failed` that no health report found
        healthy since they failed."""
        failed = failed or {}
        with self._lock:  # a worker set_workers removed is never picked after it returns
            prefill_pool, decode_pool = dict(self.prefill), dict(self.decode)
            health = dict(self._healthy)
            back = {w for w, at in failed.items() if self._healthy_at.get(w, -1) > at}
            aggregated = self.aggregated
        healthy = lambda w: health.get(w, True) and (w not in failed or w in back)  # noqa: E731
        choice = None
        # A moving request whose prefill workers all failed under it is prefilled on its
        # decode worker rather than failed: nothing is lost while a decode worker is left.
        stranded = bool(failed) and not any(healthy(w) for w in prefill_pool)
        if not aggregated and not stranded:
            loads = [WorkerLoad(w, self.load.queued(w), healthy=healthy(w)) for w in prefill_pool]
            choice = choose_prefill(
                self.policy, hashes, self.block_size, loads, self.index, num_prompt_tokens=n
            )
        stats: Iterator[WorkerStats | None] = self._calls.map(
            lambda d: _ask(d[0], "stats", d[1].stats) if healthy(d[0]) else None,
            decode_pool.items(),
        )
        decode_loads = [
            DecodeLoad(w, s.free_blocks, s.num_requests, total_blocks=s.num_blocks)
            if s is not None
            else DecodeLoad(w, 0, 0, healthy=False)
            for w, s in zip(decode_pool, stats, strict=True)
        ]
        decode_choice = choose_decode(hashes, n, self.block_size, decode_loads, self.index)
        return choice, decode_choice, prefill_pool, decode_pool

    def _generate_local(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: dict,
        cache_salt: str | None,
        decode: tuple[str, DecodeAPI],
    ) -> Iterator[dict]:
        counted = False
        try:
            for out in watch(
                generate_local(
                    decode[1],
                    request_id,
                    prompt_token_ids,
                    params,
                    cache_salt=cache_salt,
                    timeout=self.timeout,
                ),
                decode[0],
            ):
                if not counted:
                    counted = True
                    self._count(len(prompt_token_ids), out["num_cached_tokens"])
                if out["finished"]:
                    out.update(
                        prefill_worker=decode[0],
                        decode_worker=decode[0],
                        prompt_tokens=len(prompt_token_ids),
                    )
                yield out
        finally:
            self._finish(request_id)

    def _worker_failed(
        self, request_id: str, exc: WorkerFailed, workers: list[tuple[str, object] | None]
    ) -> None:
        """Mark the failed worker unhealthy (until the controller's next health report) and
        abort the request on this attempt's workers, quietly: on the failed one in the
        background (it may hang), on the others now (the next attempt may reuse one)."""
        self._mark_unhealthy(exc.worker_id)
        for worker_id, worker in filter(None, workers):
            abort = lambda w=worker: w.abort(request_id, propagate=False)  # noqa: E731
            if worker_id == exc.worker_id:
                self._calls.submit(_ask, worker_id, "abort", abort)
            else:
                _ask(worker_id, "abort", abort)

    def _mark_unhealthy(self, *worker_ids: str) -> None:
        """No new requests go to these workers until the controller's next health report."""
        with self._changed:
            for worker_id in worker_ids:
                if worker_id in {*self.prefill, *self.decode}:
                    self._healthy[worker_id] = False

    def _finish(self, request_id: str) -> None:
        with self._lock:
            self._active.pop(request_id, None)

    def _count(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.metrics.prefix_cache(prompt_tokens, cached_tokens)
        with self._lock:
            self.num_prompt_tokens += prompt_tokens
            self.num_cached_tokens += cached_tokens


def _ask(worker_id: str, what: str, call: Callable[[], T]) -> T | None:
    """call(), or None when the worker does not answer (restarting or dead: it is skipped
    for this request and asked again by the next); `what` names the call in the log."""
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - logged; the caller treats None as no answer
        logger.warning("%s of %s: %s", what, worker_id, exc)
        return None
