"""Ray names and look-ups the controller's parts share: Baton's namespace and actor names, the
live nodes, a worker's placement-group name, one-line forms of errors and node ids, and the
removal of everything Baton left on a Ray cluster."""

from __future__ import annotations

import ray
from ray.util.placement_group import get_placement_group, remove_placement_group

from cluster import state_store

NAMESPACE = "baton"
CONTROLLER_NAME = "baton-controller"
HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray gives the head node this resource
GROUP_PREFIX = "baton-"  # every Baton placement group's name starts with it


def placement_group_name(worker_id: str) -> str:
    """A worker's placement group is named after it (a restarted controller finds it)."""
    return f"{GROUP_PREFIX}{worker_id}"


def short_error(exc: BaseException) -> str:
    """One line for an exception, out of Ray's wrappers (no remote traceback)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}".splitlines()[0]
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(exc).__name__


def short_node(node_id: str) -> str:
    """A node id as status and progress lines show it (its first 8 hex digits)."""
    return node_id[:8] if node_id else "?"


def live_nodes() -> list[dict]:
    """Every live node: {"node_id", "address", "resources"} (`status` shows where workers run)."""
    return [
        {
            "node_id": n["NodeID"],
            "address": n.get("NodeManagerAddress"),
            "resources": dict(n["Resources"]),
        }
        for n in ray.nodes()
        if n.get("Alive")
    ]


def live_node_ids() -> set[str]:
    """The ids (hex) of the live nodes."""
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def node_resources() -> list[dict[str, float]]:
    """The total resources of every live node."""
    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


def remove_everything() -> list[str]:
    """Kill every named actor in Baton's namespace (the controller included), remove every
    Baton placement group and the saved state; returns what was removed. `down` runs it after
    the controller's own shutdown: what a failed shutdown left (nothing is owned by the
    controller, so nothing goes with it)."""
    removed = []
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] != NAMESPACE:
            continue
        try:
            ray.kill(ray.get_actor(actor["name"], namespace=NAMESPACE), no_restart=True)
            removed.append(actor["name"])
        except ValueError:  # gone meanwhile
            pass
    for table in ray.util.placement_group_table().values():
        name = table.get("name") or ""
        if name.startswith(GROUP_PREFIX) and table.get("state") != "REMOVED":
            try:
                remove_placement_group(get_placement_group(name))
                removed.append(f"placement group {name}")
            except ValueError:
                pass
    state_store.delete(NAMESPACE)
    return removed
