"""A restarted controller carries on where the dead one was.

Ray restarts the controller actor (max_restarts=-1) under the same actor id; the new
incarnation loads the saved state (cluster/state_store.py), looks the workers, their placement
groups and the router up by name and re-adopts them without restarting them. Its first health
check then re-pairs only the workers Ray restarted meanwhile, removes what the dead one started
but never recorded, and finishes the retirement of workers it was draining.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

import ray
from ray.util.placement_group import get_placement_group, remove_placement_group

from cluster import state_store
from cluster.drain import retire
from cluster.health import check_health
from cluster.ray_helpers import GROUP_PREFIX, NAMESPACE, placement_group_name, short_error
from cluster.router_actor import ROUTER_NAME
from cluster.state import ClusterState
from cluster.templates import ROLES
from deploy.manifest import parse_manifest

logger = logging.getLogger(__name__)


def orphan_actors(named_actors: Iterable[dict], known: set[str]) -> list[str]:
    """Worker actors in Baton's namespace that no record names (`named_actors`: Ray's
    list_named_actors(all_namespaces=True) rows)."""
    prefixes = tuple(f"{role}-" for role in ROLES)
    return [
        a["name"]
        for a in named_actors
        if a["namespace"] == NAMESPACE and a["name"].startswith(prefixes) and a["name"] not in known
    ]


def orphan_groups(tables: Iterable[dict], known: set[str]) -> list[str]:
    """Names of live Baton placement groups whose worker no record names (`tables`: Ray's
    placement_group_table() values)."""
    out = []
    for table in tables:
        name = table.get("name") or ""
        worker_id = name.removeprefix(GROUP_PREFIX)
        if name.startswith(GROUP_PREFIX) and worker_id not in known and table["state"] != "REMOVED":
            out.append(name)
    return out


def adopt_saved(state: ClusterState) -> None:
    """Load the state a dead incarnation saved and look its actors up by name; workers
    and the router keep running untouched. A worker or router that is gone is dropped
    (the next apply starts what the manifest misses). Then checks them in the background."""
    try:
        saved = state_store.load(NAMESPACE)
    except Exception as exc:  # noqa: BLE001 - start empty
        logger.warning("loading the controller state failed: %s", exc)
        return
    if not saved:
        return
    gone = state.restore(saved, _find_worker, _find_router)
    ids = ", ".join(state.workers_by_id) or "none"
    state.log(
        f"controller restarted: re-adopted workers {ids}"
        + (f" and the router on {state.router.address}" if state.router is not None else "")
        + (f"; gone meanwhile: {', '.join(gone)}" if gone else "")
    )
    threading.Thread(target=check_adopted, args=(state,), name="adopt", daemon=True).start()


def check_adopted(state: ClusterState) -> None:
    """Ping the re-adopted workers once: same incarnation = untouched; re-pair those Ray
    restarted while no controller ran."""
    try:
        health = check_health(state)
    except Exception as exc:  # noqa: BLE001 - the router's next poll checks again
        state.log(f"checking the re-adopted workers failed: {short_error(exc)}")
        return
    healthy = [w for w, ok in health["healthy"].items() if ok]
    repaired = health["restarted"]
    state.log(
        f"re-adopted workers answering: {', '.join(healthy) or 'none'}"
        + (f"; re-paired (restarted meanwhile): {', '.join(repaired)}" if repaired else "")
    )
    with state.apply_lock:
        remove_orphans(state)
        leftovers = state.draining()
        if leftovers and state.manifest is not None:  # the dead one was draining these
            retire(state, leftovers, parse_manifest(state.manifest))


def remove_orphans(state: ClusterState) -> None:
    """Remove workers and bundles no record names: started by an incarnation that died
    before it recorded them (they would hold their resources for ever)."""
    known = set(state.workers_by_id)
    for name in orphan_actors(ray.util.list_named_actors(all_namespaces=True), known):
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
            state.log(f"removed {name}: started by the dead controller, never recorded")
        except ValueError:
            pass
    for name in orphan_groups(ray.util.placement_group_table().values(), known):
        try:
            remove_placement_group(get_placement_group(name))
        except ValueError:
            pass


def _find_worker(worker_id: str) -> tuple[Any, Any] | None:
    """A worker's actor handle and placement group, or None if either is gone."""
    try:
        return (
            ray.get_actor(worker_id, namespace=NAMESPACE),
            get_placement_group(placement_group_name(worker_id)),
        )
    except ValueError:
        return None


def _find_router() -> Any | None:
    try:
        return ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
    except ValueError:
        return None
