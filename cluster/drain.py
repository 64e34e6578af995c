"""Retiring workers: the router stops giving them new requests (publish returns only once that
holds), their running requests finish (or the manifest's drain timeout passes, or `down` cuts
the wait short), then they are unpaired and removed."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

import ray

from cluster import timeouts as T
from cluster.placement import remove_worker
from cluster.router_lifecycle import publish
from cluster.state import ClusterState
from cluster.worker_actor import Worker
from deploy.manifest import Manifest


def busy_workers(
    leaving: Iterable[str], routed: Mapping[str, int], in_flight: Mapping[str, int]
) -> dict[str, int]:
    """The leaving workers still running requests -> how many: the larger of the router's
    count (`routed`) and the worker's own (`in_flight`: queued, running, held for a transfer,
    waiting for KV). A worker missing from `in_flight` did not answer: dead, it has nothing
    left to finish."""
    busy = {}
    for worker_id in leaving:
        if worker_id not in in_flight:
            continue
        n = max(routed.get(worker_id, 0), in_flight[worker_id])
        if n:
            busy[worker_id] = n
    return busy


def retire(state: ClusterState, workers: list[Worker], m: Manifest) -> None:
    """Take workers out of the router's pools, wait for their requests, remove them."""
    for worker in workers:
        worker.draining = True
    publish(state, m)
    if not workers:
        return
    try:
        drain(state, workers, m.spec.drain_timeout_seconds)
    finally:
        for worker in workers:
            remove_worker(state, worker)


def drain(state: ClusterState, leaving: list[Worker], timeout_s: float) -> None:
    """Wait until no request runs on any leaving worker (the router's view and the
    worker's own: queued, running, held for a transfer, waiting for KV)."""
    deadline = time.monotonic() + timeout_s
    last_report = 0.0
    ids = ", ".join(w.worker_id for w in leaving)
    state.log(f"draining {ids}")
    while True:
        routed: dict[str, int] = ray.get(
            state.require_router().handle.active_counts.remote(), timeout=T.DRAIN_QUERY_S
        )
        in_flight = {}
        for w in leaving:
            try:
                s = ray.get(w.handle.stats.remote(), timeout=T.DRAIN_QUERY_S)
            except Exception:  # noqa: BLE001 - a dead worker has nothing left to finish
                continue
            in_flight[w.worker_id] = s.num_in_flight
        busy = busy_workers((w.worker_id for w in leaving), routed, in_flight)
        if not busy:
            state.log(f"drained {ids}")
            return
        if state.stopping.is_set():
            state.log(f"down requested: not waiting for {busy}")
            return
        now = time.monotonic()
        if now > deadline:
            state.log(
                f"drain timed out after {timeout_s:.0f} s with requests still "
                f"running: {busy}; removing anyway"
            )
            return
        if now - last_report > T.DRAIN_REPORT_S:
            last_report = now
            state.log("waiting for " + ", ".join(f"{w}: {n} request(s)" for w, n in busy.items()))
        time.sleep(T.DRAIN_POLL_S)
