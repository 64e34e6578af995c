"""The Baton controller: a named Ray actor that places, starts and pairs the worker actors.

Each worker runs in its own placement-group bundle ({"CPU": n} on CPU, {"GPU": 1} on GPU
clusters). Every prefill worker is paired with every decode worker (a 2-rank group each);
KV moves over those groups, never through Ray's object store. Control calls are Ray calls.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.ray_peer import RayPeer

logger = logging.getLogger(__name__)

NAMESPACE = "baton"
CONTROLLER_NAME = "baton-controller"
ACTOR_CONCURRENCY = 64  # control calls (a long prefill included) run side by side


@dataclass(frozen=True)
class ClusterSpec:
    """What to run: engine options shared by all workers, pool sizes, per-worker resources."""

    engine: dict = field(default_factory=dict)
    num_prefill: int = 1
    num_decode: int = 1
    resources: dict = field(default_factory=lambda: {"CPU": 1})
    transfer: dict = field(default_factory=dict)
    torch_threads: int = 1

    def __post_init__(self) -> None:
        for name in ("num_prefill", "num_decode"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def _worker_class(role: str):
    """The Ray actor class of a role (a threaded actor: control calls run concurrently)."""
    if role == "prefill":
        from prefill_worker.worker import PrefillWorker as cls
    else:
        from decode_worker.worker import DecodeWorker as cls

    class Actor(cls):
        def __init__(self, worker_id: str, engine: dict, transfer: dict, threads: int) -> None:
            import uuid

            import torch

            torch.set_num_threads(threads)
            super().__init__(worker_id, engine, transfer)
            self.incarnation = uuid.uuid4().hex  # changes when Ray restarts the actor

        def ping(self) -> str:
            return self.incarnation

    Actor.__name__ = Actor.__qualname__ = f"{cls.__name__}Actor"
    # A dead worker is restarted by Ray (its __init__ runs again); calls in flight fail.
    return ray.remote(max_concurrency=ACTOR_CONCURRENCY, max_restarts=-1,
                      max_task_retries=0)(Actor)


class Controller:
    """Creates, pairs and tracks the workers of one cluster spec."""

    def __init__(self, spec: dict) -> None:
        self.spec = ClusterSpec(**spec)
        self.pg = None
        self.handles: dict[str, object] = {}
        self.roles: dict[str, str] = {}
        self.incarnations: dict[str, str] = {}
        self.healthy: dict[str, bool] = {}
        self.generation = 0  # bumps whenever a worker comes back as a new incarnation

    def start(self) -> list[dict]:
        """Start every worker in its bundle, wait until they are up, pair them."""
        spec = self.spec
        ids = ([("prefill", f"prefill-{i}") for i in range(spec.num_prefill)]
               + [("decode", f"decode-{i}") for i in range(spec.num_decode)])
        self.pg = placement_group([dict(spec.resources) for _ in ids], strategy="PACK")
        ray.get(self.pg.ready(), timeout=120)
        resources = {k: v for k, v in spec.resources.items() if k not in ("CPU", "GPU")}
        for bundle, (role, worker_id) in enumerate(ids):
            actor = _worker_class(role).options(
                name=worker_id, namespace=NAMESPACE, num_cpus=spec.resources.get("CPU", 0),
                num_gpus=spec.resources.get("GPU", 0), resources=resources or None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=bundle),
            ).remote(worker_id, spec.engine, spec.transfer, spec.torch_threads)
            self.handles[worker_id] = actor
            self.roles[worker_id] = role
        for worker_id, inc in zip(self.handles, ray.get(
                [h.ping.remote() for h in self.handles.values()], timeout=300), strict=True):
            self.incarnations[worker_id] = inc
            self.healthy[worker_id] = True
        for p in self.worker_ids("prefill"):
            for d in self.worker_ids("decode"):
                self._pair(p, d)
        return self.workers()

    def check_health(self, timeout: float = 10.0) -> dict:
        """Ping every worker; re-pair any that Ray restarted. Returns
        {"generation", "healthy": {id: bool}, "restarted": [ids]} for the router."""
        restarted = []
        for worker_id, handle in self.handles.items():
            try:
                inc = ray.get(handle.ping.remote(), timeout=timeout)
            except Exception:  # noqa: BLE001 - dead, restarting or hung
                self.healthy[worker_id] = False
                continue
            self.healthy[worker_id] = True
            if inc != self.incarnations[worker_id]:
                self.incarnations[worker_id] = inc
                restarted.append(worker_id)
        for worker_id in restarted:
            logger.warning("worker %s was restarted; pairing it again", worker_id)
            self._repair(worker_id)
        if restarted:
            self.generation += 1
        return {"generation": self.generation, "healthy": dict(self.healthy),
                "restarted": restarted}

    def _repair(self, worker_id: str) -> None:
        """Rebuild every pair group of a restarted worker (its peers drop the old one)."""
        if self.roles[worker_id] == "prefill":
            for d in self.worker_ids("decode"):
                ray.get(self.handles[d].disconnect_prefill.remote(worker_id), timeout=30)
                self._pair(worker_id, d)
        else:
            for p in self.worker_ids("prefill"):
                ray.get(self.handles[p].disconnect_decode.remote(worker_id), timeout=30)
                self._pair(p, worker_id)

    def _pair(self, prefill_id: str, decode_id: str) -> None:
        p, d = self.handles[prefill_id], self.handles[decode_id]
        address = ray.get(p.connect_decode.remote(decode_id, RayPeer(d)), timeout=60)
        ray.get(d.connect_prefill.remote(prefill_id, address, RayPeer(p)), timeout=60)

    def worker_ids(self, role: str | None = None) -> list[str]:
        return [w for w, r in self.roles.items() if role is None or r == role]

    def handle(self, worker_id: str):
        return self.handles[worker_id]

    def workers(self) -> list[dict]:
        """Every worker with its role, health and load."""
        out = []
        for worker_id, handle in self.handles.items():
            try:
                stats = ray.get(handle.stats.remote(), timeout=10)
                healthy = True
            except Exception as exc:  # noqa: BLE001 - reported as unhealthy
                stats, healthy = {"error": str(exc)}, False
            out.append({**stats, "worker_id": worker_id, "role": self.roles[worker_id],
                        "healthy": healthy})
        return out

    def spec_dict(self) -> dict:
        return asdict(self.spec)

    def shutdown(self) -> None:
        for handle in self.handles.values():
            try:
                ray.get(handle.shutdown.remote(), timeout=20)
            except Exception:  # noqa: BLE001 - killed below either way
                pass
            ray.kill(handle)
        self.handles.clear()
        self.roles.clear()
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None


def start_controller(spec: ClusterSpec):
    """Create (or fetch) the named controller actor and start the cluster; returns its handle."""
    actor = ray.remote(Controller).options(
        name=CONTROLLER_NAME, namespace=NAMESPACE, get_if_exists=True, num_cpus=0,
        max_concurrency=8).remote(asdict(spec))
    ray.get(actor.start.remote(), timeout=600)
    return actor
