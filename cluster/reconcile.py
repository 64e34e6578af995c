"""Reconcile: bring the workers and the router to a manifest by executing cluster/plan.py's
steps in order, one `match`. Applying the same manifest again changes nothing; a failed apply
records nothing and can simply be retried (it first mends what the failed one left)."""

from __future__ import annotations

import ray

from cluster.drain import retire
from cluster.pairing import ensure_pairs
from cluster.placement import start_workers
from cluster.plan import (
    Current,
    EnsureRouter,
    Note,
    Pair,
    Pool,
    Publish,
    Retire,
    Running,
    Start,
    plan,
)
from cluster.ray_helpers import node_resources
from cluster.router_lifecycle import ensure_router, publish
from cluster.state import ClusterState, NoCluster
from cluster.templates import ROLES, WorkerTemplate, router_settings, worker_templates
from deploy.manifest import Manifest, ManifestError, check_resources, parse_manifest


def check_pools(replicas: dict[str, int]) -> None:
    """`scale` names pools that exist (ValueError naming the others)."""
    bad = set(replicas) - set(ROLES)
    if bad:
        raise ValueError(f"unknown pool {sorted(bad)}: choose prefill or decode")


def with_replicas(manifest: dict | None, replicas: dict[str, int]) -> dict:
    """The applied manifest with new replica counts, e.g. {"decode": 2} (a copy: the applied
    one is recorded only once the cluster matches). NoCluster when none was applied."""
    if manifest is None:
        raise NoCluster("no manifest applied yet; run `baton deploy apply -f MANIFEST`")
    out = {**manifest, "spec": {**manifest["spec"]}}
    for role, n in replicas.items():
        out["spec"][role] = {**out["spec"][role], "replicas": n}
    return out


def check_same_cluster(applied: dict | None, m: Manifest) -> None:
    """One Ray cluster runs one Baton cluster: ManifestError when `m` names another."""
    if applied is not None and applied["metadata"]["name"] != m.metadata.name:
        raise ManifestError(
            f"metadata.name: {m.metadata.name!r} is invalid: this Ray cluster runs "
            f"Baton cluster {applied['metadata']['name']!r}; run `baton deploy "
            "down` first or apply under that name"
        )


def apply(state: ClusterState, manifest: dict) -> dict:
    """Reconcile to the manifest (the caller holds state.apply_lock); returns
    {"generation", "changed", "changes"}."""
    m = parse_manifest(manifest)
    check_same_cluster(state.manifest, m)
    check_resources(m, ray.cluster_resources(), node_resources())
    data = m.model_dump(mode="json")
    spec_changed = state.manifest is None or data["spec"] != state.manifest["spec"]
    generation = state.generation + spec_changed
    changes = reconcile(state, m)
    if spec_changed and not changes:
        changes = ["settings updated (no worker changed)"]
    # Recorded only once the cluster matches: a failed apply can simply be retried.
    state.manifest, state.generation = data, generation
    state.log(f"generation {generation}: " + ("; ".join(changes) if changes else "no change"))
    return {"generation": generation, "changed": bool(changes), "changes": changes}


def current(state: ClusterState) -> Current:
    """The cluster as plan() sees it: the active workers, pool by pool, oldest first."""
    return Current(
        tuple(Running(w.worker_id, w.template) for role in ROLES for w in state.active(role)),
        has_router=state.router is not None,
    )


def desired(templates: dict[str, WorkerTemplate], m: Manifest) -> dict[str, Pool]:
    """What the manifest wants of each pool."""
    return {role: Pool(templates[role], getattr(m.spec, role).replicas) for role in ROLES}


def reconcile(state: ClusterState, m: Manifest) -> list[str]:
    """Bring the workers and the router to the manifest: mend what a failed reconcile
    left (workers still draining), then execute plan()'s steps (cluster/plan.py says
    how the new workers are placed). Returns the changes made."""
    templates = worker_templates(m)
    leftovers = state.draining()
    if leftovers:  # an earlier reconcile failed while draining these
        retire(state, leftovers, m)
    planned = plan(current(state), desired(templates, m), ray.available_resources())
    router_change = None
    for step in planned.steps:
        match step:
            case Start(role=role, count=count):
                start_workers(state, templates[role], count)
            case Pair():
                ensure_pairs(state)
            case EnsureRouter():
                router_change = ensure_router(state, router_settings(m))
            case Retire(worker_ids=ids):
                retire(state, [state.workers_by_id[i] for i in ids], m)
            case Publish():
                publish(state, m)
            case Note(text=text):
                state.log(text)
    changes = list(planned.changes)
    if router_change:
        changes.append(f"{router_change} router")
    return changes
