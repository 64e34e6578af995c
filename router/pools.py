"""The router's worker pools: who takes new requests, who is healthy, which requests run where.

Membership comes from the controller (set_workers: both pools with their block size, hash
seed and max_model_len), health from its reports (update_membership) and from requests whose
worker failed (mark_unhealthy). The KV index and the load tracker are keyed by these workers:
a worker that leaves or restarts is forgotten there under the pools' lock, so a worker
set_workers removed is never picked once it returns.

Aggregated mode (a cluster configured with 0 prefill workers): every request is prefilled on
its decode worker. It takes effect at once (requests already on prefill workers finish
there); leaving it waits until prefill workers are published, so that no request waits for a
pool that is still starting. It differs from a disaggregated cluster whose prefill pool is
momentarily empty (workers being replaced or restarted), where requests wait for one.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass

from engine.errors import InvalidRequestError
from kvtransfer.worker_api import DecodeAPI, PrefillAPI, Role, WorkerStats
from router.kv_index import KVIndex
from router.policy import LoadTracker
from router.readiness import PoolHealth, Readiness, readiness

# Where one request runs: (prefill id, worker) or None when its decode worker prefills it,
# and (decode id, worker).
Placement = tuple[tuple[str, PrefillAPI] | None, tuple[str, DecodeAPI]]


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """One worker as Router.status() reports it: stats is None when it did not answer."""

    worker_id: str
    role: Role
    healthy: bool
    stats: WorkerStats | None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class PoolView:
    """The pools as one choice of workers sees them, taken at once under the pools' lock."""

    prefill: Mapping[str, PrefillAPI]
    decode: Mapping[str, DecodeAPI]
    usable: frozenset[str]  # healthy, and not failed under this request since the last report
    aggregated: bool  # in effect: the decode worker prefills every request
    block_size: int


class WorkerPools:
    """The prefill and decode pools with their health, mode and running requests; every
    method is thread-safe."""

    def __init__(
        self,
        prefill: Mapping[str, PrefillAPI],
        decode: Mapping[str, DecodeAPI],
        *,
        block_size: int,
        hash_seed: str,
        max_model_len: int | None = None,
        aggregated: bool = False,
    ) -> None:
        self.prefill = dict(prefill)
        self.decode = dict(decode)
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.max_model_len = max_model_len  # longer prompts are refused (None: no limit)
        # Aggregated mode as configured, and as in effect (see the module docstring).
        self._configured_aggregated = self.aggregated = aggregated
        self.index = KVIndex()  # built from the members' KV events (router/worker_choice.py)
        self.load = LoadTracker()  # queued prefill tokens per member
        for worker_id in [*self.prefill, *self.decode]:
            self.index.add_worker(worker_id)
        # Guards the pools, block_size, hash_seed, the index's membership, _healthy,
        # _healthy_at, _num_reports and _active: _active names only workers of some pool.
        self._lock = threading.Lock()
        # On _lock; notified when the pools, their health or the mode change (a request
        # waiting for a worker looks again).
        self._changed = threading.Condition(self._lock)
        self._healthy: dict[str, bool] = {}  # from the controller; unknown = healthy
        # The controller's health reports so far, and per worker the last one that found it
        # healthy: a worker that failed a request is tried again by that request only once a
        # later report found it healthy (restarted and re-paired, or answering again).
        self._num_reports = 0
        self._healthy_at: dict[str, int] = {}
        self._active: dict[str, Placement] = {}  # request id -> where it runs

    # ---- membership and mode -----------------------------------------------------------
    def set_workers(
        self,
        prefill: Mapping[str, PrefillAPI],
        decode: Mapping[str, DecodeAPI],
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

    def set_aggregated(self, aggregated: bool) -> None:
        """Configure aggregated mode (a request waiting for a prefill worker goes local)."""
        with self._changed:
            self._configured_aggregated = aggregated
            self._set_mode()
            self._changed.notify_all()

    def _set_mode(self) -> None:
        """On _lock: aggregated at once, disaggregated once prefill workers are published."""
        self.aggregated = self._configured_aggregated or (self.aggregated and not self.prefill)

    # ---- health ------------------------------------------------------------------------
    def update_membership(self, health: dict) -> None:
        """Apply the controller's check_health(): restarted workers start with an empty KV
        cache (their disk tier's blocks stay indexed), unhealthy ones get no new requests."""
        with self._changed:
            known = {*self.prefill, *self.decode}
            for worker_id in health.get("restarted", []):
                if worker_id in known:  # its KV cache is empty; a disk tier's blocks stay
                    self.index.restart_worker(worker_id)
                    self.load.forget(worker_id)
            self._num_reports += 1
            for worker_id, ok in health.get("healthy", {}).items():
                if worker_id in known:
                    self._healthy[worker_id] = ok
                    if ok:
                        self._healthy_at[worker_id] = self._num_reports
            self._changed.notify_all()

    def mark_unhealthy(self, *worker_ids: str) -> None:
        """No new requests go to these workers until the controller's next health report."""
        with self._changed:
            for worker_id in worker_ids:
                if worker_id in {*self.prefill, *self.decode}:
                    self._healthy[worker_id] = False

    def num_reports(self) -> int:
        """How many health reports the controller sent so far."""
        with self._lock:
            return self._num_reports

    def health(self) -> dict[str, bool]:
        """The health each worker was last marked with (a worker never marked is healthy)."""
        with self._lock:
            return dict(self._healthy)

    def readiness(self) -> Readiness:
        """Whether a new request can be served now (router/readiness.py)."""
        with self._lock:
            prefill, decode = (
                PoolHealth(sum(self._healthy.get(w, True) for w in pool), len(pool))
                for pool in (self.prefill, self.decode)
            )
            aggregated = self.aggregated
        return readiness(aggregated, prefill, decode)

    def view(self, failed: Mapping[str, int]) -> PoolView:
        """The pools for one choice; `failed` maps the workers a request failed on to the
        number of health reports seen then: they are usable again once a later report
        found them healthy."""
        with self._lock:
            members = [*self.prefill, *self.decode]
            usable = frozenset(
                w
                for w in members
                if self._healthy.get(w, True)
                and (w not in failed or self._healthy_at.get(w, -1) > failed[w])
            )
            return PoolView(
                dict(self.prefill), dict(self.decode), usable, self.aggregated, self.block_size
            )

    def wait_for_change(self, timeout: float) -> None:
        """Block until the pools, their health or the mode change, at most `timeout` s."""
        with self._changed:
            self._changed.wait(timeout)

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

    # ---- the KV index ------------------------------------------------------------------
    def refresh_targets(self) -> list[tuple[str, PrefillAPI | DecodeAPI]]:
        """The members whose KV events the index takes (healthy ones: others may hang)."""
        with self._lock:
            members: list[tuple[str, PrefillAPI | DecodeAPI]] = [
                *self.prefill.items(),
                *self.decode.items(),
            ]
            return [(w, worker) for w, worker in members if self._healthy.get(w, True)]

    def apply_kv_events(self, events: Mapping[str, list | None]) -> None:
        """Apply each worker's KV events (None: it did not answer) to the index, skipping
        workers that left meanwhile."""
        with self._lock:
            current = {*self.prefill, *self.decode}
            for worker_id, worker_events in events.items():
                if worker_events and worker_id in current:
                    self.index.apply(worker_id, worker_events)

    # ---- running requests --------------------------------------------------------------
    def register(self, request_id: str, placement: Placement) -> bool:
        """Record where a request runs; False (nothing recorded) when one of its workers left
        the pools since they were chosen. Raises InvalidRequestError for a running id."""
        (prefill, decode) = placement
        with self._lock:
            if request_id in self._active:
                raise InvalidRequestError(f"request id {request_id!r} is already running")
            if decode[0] not in self.decode or (
                prefill is not None and prefill[0] not in self.prefill
            ):
                return False
            self._active[request_id] = placement
            return True

    def finish(self, request_id: str) -> None:
        """The request no longer runs (on any worker)."""
        with self._lock:
            self._active.pop(request_id, None)

    def placement(self, request_id: str) -> Placement | None:
        """Where a running request runs now, None if it does not run."""
        with self._lock:
            return self._active.get(request_id)

    def active_counts(self) -> dict[str, int]:
        """Running requests per worker id (prefill and decode side both count)."""
        counts: dict[str, int] = {}
        with self._lock:
            for prefill, (decode_id, _) in self._active.values():
                for worker_id in ([prefill[0]] if prefill else []) + [decode_id]:
                    counts[worker_id] = counts.get(worker_id, 0) + 1
        return counts
