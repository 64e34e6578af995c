"""The cluster as `baton deploy status` shows it: each worker's role, state, health and stats,
the router's stats and addresses, wanted vs running replicas per pool (degraded when fewer
run), the nodes and the last progress lines. The assembly is pure (worker_row, router_view,
status_view); `workers` and `status` ask the actors."""

from __future__ import annotations

import ray

from cluster import timeouts as T
from cluster.ray_helpers import live_nodes
from cluster.state import ClusterState, RouterRecord
from cluster.templates import ROLES
from cluster.worker_actor import Worker

STATUS_EVENTS = 10  # the last progress lines `baton deploy status` shows


def cluster_mode(manifest: dict | None) -> str | None:
    """The applied manifest's shape: "aggregated" (0 prefill workers: every request is
    prefilled on its decode worker) or "disaggregated" (None: no manifest applied)."""
    if manifest is None:
        return None
    return "aggregated" if manifest["spec"]["prefill"]["replicas"] == 0 else "disaggregated"


def worker_row(worker: Worker, stats: dict | BaseException) -> dict:
    """One worker's status line from its stats summary, or the error asking for it raised
    (then it shows unhealthy)."""
    if isinstance(stats, BaseException):
        stats, healthy = {"error": str(stats)}, False
    else:
        # Answering is not enough: a worker Ray restarted is healthy again once the
        # health check paired it again (worker.healthy).
        healthy = worker.healthy
    return {
        **stats,
        "worker_id": worker.worker_id,
        "role": worker.role,
        "healthy": healthy,
        "state": "draining" if worker.draining else "active",
        "node_id": worker.node_id,
    }


def router_view(router: RouterRecord, stats: dict | BaseException) -> dict:
    """The router's status: its stats (or the error asking for them raised) and addresses."""
    view = {"error": str(stats)} if isinstance(stats, BaseException) else stats
    view["address"] = router.address
    view["http_address"] = router.http_address
    return view


def status_view(
    manifest: dict | None,
    generation: int,
    router: dict | None,
    workers: list[dict],
    nodes: list[dict],
    events: list[str],
) -> dict:
    """The status document from its parts (`workers`: worker_row's, `router`: router_view's
    or None when no router runs)."""
    active = [w for w in workers if w["state"] == "active"]
    counts = {role: sum(1 for w in active if w["role"] == role) for role in ROLES}
    running = {role: sum(1 for w in active if w["role"] == role and w["healthy"]) for role in ROLES}
    wanted = {role: manifest["spec"][role]["replicas"] if manifest else 0 for role in ROLES}
    return {
        "name": manifest["metadata"]["name"] if manifest else None,
        "generation": generation,
        "replicas": counts,  # active workers (healthy or not)
        "wanted": wanted,  # the manifest's replicas
        "running": running,  # active workers that answer
        "degraded": any(running[r] < wanted[r] for r in ROLES),
        "mode": cluster_mode(manifest),
        "router": router,
        "workers": workers,
        "nodes": nodes,
        "events": events,
        "manifest": manifest,
    }


def workers(state: ClusterState) -> list[dict]:
    """Every worker with its role, state, health and stats (load, KV usage, hits)."""
    workers = state.workers()
    refs = [w.handle.stats.remote() for w in workers]
    rows = []
    for w, ref in zip(workers, refs, strict=True):
        try:
            stats = ray.get(ref, timeout=T.STATS_S).summary()
        except Exception as exc:  # noqa: BLE001 - reported as unhealthy
            stats = exc
        rows.append(worker_row(w, stats))
    return rows


def status(state: ClusterState) -> dict:
    """The cluster as `baton deploy status` shows it."""
    router = None
    if state.router is not None:
        try:
            stats = ray.get(state.router.handle.stats.remote(), timeout=T.STATS_S)
        except Exception as exc:  # noqa: BLE001 - shown as such
            stats = exc
        router = router_view(state.router, stats)
    return status_view(
        state.manifest,
        state.generation,
        router,
        workers(state),
        live_nodes(),
        state.events.last(STATUS_EVENTS),
    )
