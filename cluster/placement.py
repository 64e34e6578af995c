"""Starting and removing workers. Each worker runs in its own detached one-bundle placement
group ({"CPU": n} or {"GPU": 1}, named after it: cluster/ray_helpers.py), as a detached named
actor placed in that bundle; neither is owned by the controller."""

from __future__ import annotations

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster import timeouts as T
from cluster.pairing import pairs_of, unpair
from cluster.ray_helpers import NAMESPACE, placement_group_name, short_error, short_node
from cluster.state import ClusterState
from cluster.templates import WorkerTemplate, worker_engine_options
from cluster.worker_actor import WORKER_ENV, Worker, worker_class


def actor_resources(resources: dict[str, float]) -> dict:
    """A bundle's resources as Ray actor options: num_cpus, num_gpus and the custom rest
    (None when there is none)."""
    return {
        "num_cpus": resources.get("CPU", 0),
        "num_gpus": resources.get("GPU", 0),
        "resources": {k: v for k, v in resources.items() if k not in ("CPU", "GPU")} or None,
    }


def next_worker_id(state: ClusterState, role: str) -> str:
    """A new worker's id, e.g. "decode-3"; ids are never reused (a restarted controller keeps
    the count)."""
    worker_id = f"{role}-{state.next_index[role]}"
    state.next_index[role] += 1
    return worker_id


def start_workers(state: ClusterState, template: WorkerTemplate, count: int) -> list[Worker]:
    """Place and start `count` workers of a template; waits until each answers. On any
    failure the ones started here are removed again and RuntimeError says why."""
    started: list[Worker] = []
    if count <= 0:
        return started
    try:
        for _ in range(count):
            worker_id = next_worker_id(state, template.role)
            state.log(f"starting {worker_id} with resources {template.resources}")
            pg = placement_group(
                [dict(template.resources)],
                strategy="PACK",
                name=placement_group_name(worker_id),
                lifetime="detached",
            )
            worker = Worker(worker_id, template, None, pg)
            started.append(worker)
            ready, _ = ray.wait([pg.ready()], timeout=T.PLACEMENT_S)
            if not ready:
                raise RuntimeError(
                    f"{worker_id}: no node could give {template.resources} within "
                    f"{T.PLACEMENT_S:.0f} s (free: {ray.available_resources()}); "
                    "add nodes or lower the replicas or resources"
                )
            worker.handle = (
                worker_class(template.role)
                .options(
                    name=worker_id,
                    namespace=NAMESPACE,
                    lifetime="detached",
                    **actor_resources(template.resources),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        pg, placement_group_bundle_index=0
                    ),
                    runtime_env={"env_vars": WORKER_ENV},
                )
                .remote(
                    worker_id,
                    worker_engine_options(template.engine, worker_id),
                    template.transfer,
                    template.threads,
                )
            )
        incarnations = ray.get([w.handle.ping.remote() for w in started], timeout=T.WORKER_START_S)
        nodes = ray.get([w.handle.node_id.remote() for w in started], timeout=T.WORKER_INFO_S)
    except Exception as exc:
        for worker in started:
            if worker.handle is not None:
                ray.kill(worker.handle)
            remove_placement_group(worker.pg)
        raise RuntimeError(
            f"starting {template.role} worker(s) failed: {short_error(exc)}"
        ) from None
    for worker, incarnation, node in zip(started, incarnations, nodes, strict=True):
        worker.incarnation, worker.node_id = incarnation, node
        state.add_worker(worker)
        state.log(f"{worker.worker_id} is up on node {short_node(node)}")
    return started


def remove_worker(state: ClusterState, worker: Worker) -> None:
    """Unpair, stop and kill a worker and free its bundle."""
    for p_id, d_id in pairs_of(worker.worker_id, list(state.pairs)):
        unpair(state, state.workers_by_id.get(p_id, worker), state.workers_by_id.get(d_id, worker))
    try:
        ray.get(worker.handle.shutdown.remote(), timeout=T.WORKER_SHUTDOWN_S)
    except Exception:  # noqa: BLE001 - killed below either way
        pass
    ray.kill(worker.handle)
    remove_placement_group(worker.pg)
    state.drop_worker(worker.worker_id)
    state.log(f"removed {worker.worker_id}")
