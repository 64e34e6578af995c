"""The cluster's one scrape: the router's own families and every worker's, merged into one
Prometheus text exposition.

Workers answer `metrics()` with engine.metrics.snapshot(...) (plain values over any
transport). Every sample gains `worker` and `role` labels (the router's own: its id and
role="router"), so one family holds the router's and every worker's series and each HELP /
TYPE appears once. A worker that does not answer in time is left out of that scrape, and
baton:worker_up{worker, role} says so (0).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from engine.metrics import PREFIX, snapshot

logger = logging.getLogger(__name__)

ROUTER_ROLE = "router"
SCRAPE_TIMEOUT_S = 5.0  # a worker that answers slower is left out of this scrape

# worker id -> (role, snapshot); snapshot None: the worker did not answer
WorkerSnapshots = Mapping[str, tuple[str, list[dict] | None]]


def cluster_metrics_text(
    router_registry: CollectorRegistry | None,
    worker_snapshots: WorkerSnapshots,
    router_id: str = "router",
) -> str:
    """One valid text exposition of the router's registry and every worker's snapshot."""
    merged = _Merged()
    if router_registry is not None:
        merged.add(snapshot(router_registry), router_id, ROUTER_ROLE)
    up = GaugeMetricFamily(
        f"{PREFIX}worker_up",
        "1 if the worker answered this scrape, else 0.",
        labels=["worker", "role"],
    )
    for worker_id, (role, families) in sorted(worker_snapshots.items()):
        up.add_metric([worker_id, role], 0.0 if families is None else 1.0)
        if families is not None:
            merged.add(families, worker_id, role)
    merged.families.setdefault(up.name, up)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(merged)
    return generate_latest(registry).decode()


def gather_worker_snapshots(
    workers: Mapping[str, tuple[str, Any]], timeout: float = SCRAPE_TIMEOUT_S
) -> dict[str, tuple[str, list[dict] | None]]:
    """{worker id: (role, worker.metrics())} asked side by side; None for a worker that
    raised or did not answer within `timeout` seconds."""
    out: dict[str, tuple[str, list[dict] | None]] = {w: (r, None) for w, (r, _) in workers.items()}
    if not workers:
        return out
    pool = ThreadPoolExecutor(max_workers=min(16, len(workers)), thread_name_prefix="scrape")
    try:
        futures = {pool.submit(worker.metrics): w for w, (_, worker) in workers.items()}
        done, _ = wait(futures, timeout)
        for fut in done:
            worker_id = futures[fut]
            try:
                out[worker_id] = (out[worker_id][0], fut.result())
            except Exception as exc:  # noqa: BLE001 - the worker is reported as down
                logger.warning("metrics of %s: %s", worker_id, exc)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return out


def router_scrape(router: Any, router_id: str = "router") -> str:
    """The whole cluster's exposition for a router.Router: its registry (router.metrics)
    and every worker in its pools."""
    workers = {w: ("prefill", p) for w, p in dict(router.prefill).items()}
    workers.update({w: ("decode", d) for w, d in dict(router.decode).items()})
    return cluster_metrics_text(
        router.metrics.registry, gather_worker_snapshots(workers), router_id
    )


class _Merged:
    """A collector of families merged by name; samples relabelled with worker and role."""

    def __init__(self) -> None:
        self.families: dict[str, Metric] = {}

    def add(self, families: Iterable[dict], worker_id: str, role: str) -> None:
        for fam in families:
            name, typ = fam["name"], fam["type"]
            metric = self.families.get(name)
            if metric is None:
                metric = self.families[name] = Metric(name, fam["help"], typ)
            elif metric.type != typ:
                logger.warning(
                    "metric %s of %s is a %s, not a %s: left out", name, worker_id, typ, metric.type
                )
                continue
            for sample_name, labels, value in fam["samples"]:
                labels = {**labels, "worker": worker_id, "role": role}
                metric.add_sample(sample_name, labels, float(value))

    def collect(self) -> Iterable[Metric]:
        return list(self.families.values())
