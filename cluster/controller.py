"""The Baton controller: a named, detached Ray actor that reconciles the cluster to a manifest.

apply(manifest) creates the workers and the router that are missing, replaces workers whose
template (engine options, transfer options, resources, threads) changed, and scales each pool
to its replicas; applying the same manifest again changes nothing. Each worker runs in its own
one-bundle placement group ({"CPU": n} or {"GPU": 1}); every prefill worker is paired with
every decode worker of the same KV key (a 2-rank group each), so KV moves over those groups,
never through Ray's object store.

A leaving worker is drained: the router stops giving it new requests (set_workers returns only
after that holds), its running requests finish, then it is unpaired and removed. New workers
are paired and announced before old ones leave, so a changed manifest never leaves a pool
empty.

Nothing is owned by this actor: the workers, their placement groups and the router are named
and detached, and this actor's state is saved in Ray's internal KV store whenever it changes
(cluster/state_store.py). The actor itself has max_restarts=-1: when its process dies, Ray
starts it again under the same actor id (handles held by the router and by clients keep
working), and the new incarnation loads the state, looks the actors and placement groups up
by name and re-adopts them without restarting them; its first health check re-pairs only the
workers Ray restarted meanwhile. `shutdown` (`baton deploy down`) removes everything
explicitly. A worker whose node is lost is restarted by Ray wherever its placement group can
be placed again; until then the pool is reported degraded (status: wanted vs running).

This class only composes the parts, each a module of plain functions over one ClusterState
(cluster/state.py): reconcile.py executes cluster/plan.py's steps (pure: what a reconcile
does) with placement.py (start and remove workers), pairing.py (prefill/decode groups),
router_lifecycle.py (the router actor) and drain.py (retiring workers); health.py pings and
re-pairs; recovery.py re-adopts a running cluster after a restart; status.py assembles
`status`; ray_helpers.py holds the names and look-ups they share. Every wait is named in
cluster/timeouts.py.
"""

from __future__ import annotations

import os

import ray

from cluster import health, reconcile, recovery, state_store
from cluster import status as cluster_status
from cluster import timeouts as T
from cluster.placement import remove_worker
from cluster.ray_helpers import (
    CONTROLLER_NAME,
    HEAD_NODE_RESOURCE,
    NAMESPACE,
    live_nodes,
    node_resources,
    placement_group_name,
    remove_everything,
    short_error,
    short_node,
)
from cluster.router_lifecycle import republish, stop_router
from cluster.state import ClusterState, NoCluster
from cluster.status import cluster_mode

# The names `baton deploy` (deploy/client.py), cluster/local.py and the tests take from here.
__all__ = [
    "CONTROLLER_NAME",
    "HEAD_NODE_RESOURCE",
    "NAMESPACE",
    "Controller",
    "NoCluster",
    "cluster_mode",
    "controller_handle",
    "live_nodes",
    "node_resources",
    "placement_group_name",
    "remove_everything",
    "short_error",
    "short_node",
]


class Controller:
    """Reconciles the workers and the router of one Baton cluster to a manifest."""

    def __init__(self) -> None:
        self.state = ClusterState()
        recovery.adopt_saved(self.state)  # a restarted controller carries on where one died

    # ---- reconcile -------------------------------------------------------------------------
    def apply(self, manifest: dict) -> dict:
        """Reconcile to the manifest; returns {"generation", "changed", "changes"}."""
        with self.state.apply_lock:
            return reconcile.apply(self.state, manifest)

    def scale(self, replicas: dict[str, int]) -> dict:
        """Apply the current manifest with new replica counts, e.g. {"decode": 2}."""
        reconcile.check_pools(replicas)
        with self.state.apply_lock:  # read and change the manifest under the lock
            manifest = reconcile.with_replicas(self.state.manifest, replicas)
            return reconcile.apply(self.state, manifest)

    # ---- progress --------------------------------------------------------------------------
    def events(self, since: int = 0) -> list[str]:
        """Progress lines of reconciles, from index `since` on (callers keep the count; a
        restarted controller kept the last EVENTS_KEPT lines and counts on from there)."""
        return self.state.events.since(since)

    def num_events(self) -> int:
        return self.state.events.count()

    # ---- health (polled by the router) ---------------------------------------------------
    def check_health(self, timeout: float = T.HEALTH_PING_S) -> dict:
        """Ping every worker and re-pair any that Ray restarted (cluster/health.py)."""
        return health.check_health(self.state, timeout)

    def router_health(self) -> dict:
        """check_health, with every worker re-paired since the router last asked."""
        return health.router_health(self.state)

    # ---- a router that Ray restarted (cluster/router_actor.py: recover) -------------------
    def bound_router_ports(self) -> dict | None:
        """The ports the router bound at its start: its restarted incarnation binds them again."""
        router = self.state.router
        return None if router is None else router.ports

    def router_restarted(self) -> None:
        """The router came back empty: set its policy and publish the workers again (after a
        running apply, which may change both)."""
        with self.state.apply_lock:
            if self.state.router is None or self.state.manifest is None:
                return  # stopped meanwhile, or the first apply failed before its publish
            republish(self.state)

    # ---- queries ---------------------------------------------------------------------------
    def worker_ids(self, role: str | None = None) -> list[str]:
        workers = self.state.workers_by_id
        return [w for w, rec in workers.items() if role is None or rec.role == role]

    def handle(self, worker_id: str):
        return self.state.workers_by_id[worker_id].handle

    def workers(self) -> list[dict]:
        """Every worker with its role, state, health and stats (load, KV usage, hits)."""
        return cluster_status.workers(self.state)

    def status(self) -> dict:
        """The cluster as `baton deploy status` shows it."""
        return cluster_status.status(self.state)

    def pid(self) -> int:
        """This incarnation's process id (tests kill it to show a restart re-adopts)."""
        return os.getpid()

    # ---- teardown --------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the router and remove every worker and its bundle (no drain)."""
        state = self.state
        state.stopping.set()  # a running apply stops draining; then it gives up the lock
        with state.apply_lock:
            if state.router is not None:
                stop_router(state)
                state.log("router stopped")
            for worker in list(state.workers_by_id.values()):
                remove_worker(state, worker)
            state.manifest = None
            with state.save_lock:  # nothing left to adopt: the next controller starts empty
                state_store.delete(NAMESPACE)


def controller_handle(create: bool = False):
    """The cluster's controller actor (detached: it outlives the `baton deploy` command that
    made it). Raises NoCluster when there is none and create is False."""
    try:
        return ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
    except ValueError:
        if not create:
            raise NoCluster(
                "no Baton cluster runs here (no controller actor "
                f"{CONTROLLER_NAME!r} in namespace {NAMESPACE!r})"
            ) from None
    return (
        ray.remote(Controller)
        .options(
            name=CONTROLLER_NAME,
            namespace=NAMESPACE,
            get_if_exists=True,
            lifetime="detached",
            max_restarts=-1,  # a new incarnation re-adopts the running cluster (recovery.py)
            num_cpus=0,
            resources={HEAD_NODE_RESOURCE: 0.001},  # beside the router; worker nodes may go
            max_concurrency=16,
        )
        .remote()
    )
