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
empty. Worker and router actors are owned by this actor: killing it removes them all.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.ray_peer import RayPeer
from cluster.templates import ROLES, WorkerTemplate, router_options, worker_templates

logger = logging.getLogger(__name__)

NAMESPACE = "baton"
CONTROLLER_NAME = "baton-controller"
ACTOR_CONCURRENCY = 64  # control calls (a long prefill included) run side by side
PLACEMENT_TIMEOUT_S = 120.0  # a worker's bundle must be placeable within this
DRAIN_POLL_S = 0.5
HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray gives the head node this resource
# c10d logs a warning every time a decode worker's 0.5 s wait for the next KV announcement
# passes with none (a TCPStore socket timeout): not an error, and it would flood the logs.
WORKER_ENV = {"TORCH_CPP_LOG_LEVEL": "ERROR"}


class NoCluster(RuntimeError):
    """No Baton controller runs on this Ray cluster."""


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
    return ray.remote(max_concurrency=ACTOR_CONCURRENCY, max_restarts=-1, max_task_retries=0)(Actor)


@dataclass
class Worker:
    """One worker actor as the controller tracks it."""

    worker_id: str
    template: WorkerTemplate
    handle: Any
    pg: Any
    incarnation: str = ""
    draining: bool = False  # takes no new requests; removed once its requests finished
    healthy: bool = True

    @property
    def role(self) -> str:
        return self.template.role


class Controller:
    """Reconciles the workers and the router of one Baton cluster to a manifest."""

    def __init__(self) -> None:
        self.manifest: dict | None = None  # the last applied manifest, as a dict
        self.generation = 0  # bumps whenever an applied manifest's spec differs
        self.restarts = 0  # workers Ray restarted as a new incarnation
        self.workers_by_id: dict[str, Worker] = {}
        self.router = None
        self.router_key: tuple | None = None  # what the router's server was started with
        self.router_address: str | None = None
        self._pairs: set[tuple[str, str]] = set()  # (prefill id, decode id) with a group
        self._next_index = dict.fromkeys(ROLES, 0)
        self._apply_lock = threading.Lock()  # one reconcile at a time
        self._state_lock = threading.Lock()  # workers_by_id changes
        self._events: list[str] = []
        self._stopping = threading.Event()  # `down`: cut a running drain short

    # ---- progress ----------------------------------------------------------------------
    def _log(self, message: str) -> None:
        logger.info(message)
        self._events.append(message)

    def events(self, since: int = 0) -> list[str]:
        """Progress lines of reconciles, from index `since` on (callers keep the count)."""
        return self._events[since:]

    def num_events(self) -> int:
        return len(self._events)

    # ---- reconcile ---------------------------------------------------------------------
    def apply(self, manifest: dict) -> dict:
        """Reconcile to the manifest; returns {"generation", "changed", "changes"}."""
        with self._apply_lock:
            return self._apply(manifest)

    def scale(self, replicas: dict[str, int]) -> dict:
        """Apply the current manifest with new replica counts, e.g. {"decode": 2}."""
        bad = set(replicas) - set(ROLES)
        if bad:
            raise ValueError(f"unknown pool {sorted(bad)}: choose prefill or decode")
        with self._apply_lock:  # read and change the manifest under the lock
            if self.manifest is None:
                raise NoCluster("no manifest applied yet; run `baton deploy apply -f MANIFEST`")
            manifest = {**self.manifest, "spec": {**self.manifest["spec"]}}
            for role, n in replicas.items():
                manifest["spec"][role] = {**manifest["spec"][role], "replicas": n}
            return self._apply(manifest)

    def _apply(self, manifest: dict) -> dict:
        from deploy.manifest import ManifestError, check_resources, parse_manifest

        m = parse_manifest(manifest)
        if self.manifest is not None and self.manifest["metadata"]["name"] != m.metadata.name:
            raise ManifestError(
                f"metadata.name: {m.metadata.name!r} is invalid: this Ray cluster runs "
                f"Baton cluster {self.manifest['metadata']['name']!r}; run `baton deploy "
                "down` first or apply under that name"
            )
        check_resources(m, ray.cluster_resources(), node_resources())
        data = m.model_dump(mode="json")
        spec_changed = self.manifest is None or data["spec"] != self.manifest["spec"]
        generation = self.generation + spec_changed
        changes = self._reconcile(m)
        if spec_changed and not changes:
            changes = ["settings updated (no worker changed)"]
        # Recorded only once the cluster matches: a failed apply can simply be retried.
        self.manifest, self.generation = data, generation
        self._log(f"generation {generation}: " + ("; ".join(changes) if changes else "no change"))
        return {"generation": generation, "changed": bool(changes), "changes": changes}

    def _reconcile(self, m) -> list[str]:
        """Bring the workers and the router to the manifest. New workers start beside the
        old ones when the free resources allow it (surge); otherwise workers are replaced one
        at a time, or all at once when the KV format changes, while requests wait at the
        router for the new ones (spec.router.wait_for_workers_seconds)."""
        templates = worker_templates(m)
        leftovers = [w for w in self.workers_by_id.values() if w.draining]
        if leftovers:  # an earlier reconcile failed while draining these
            self._retire(leftovers, m)
        changes: list[str] = []
        start: dict[str, int] = {}
        outdated: dict[str, list[Worker]] = {}
        surplus: dict[str, list[Worker]] = {}
        for role in ROLES:
            want = getattr(m.spec, role).replicas
            current = self._active(role)
            keep = [w for w in current if w.template.key == templates[role].key]
            outdated[role] = [w for w in current if w.template.key != templates[role].key]
            surplus[role] = keep[want:]  # the newest go first
            start[role] = max(0, want - len(keep))
            replaced = min(start[role], len(outdated[role]))
            removed = len(outdated[role]) + len(surplus[role]) - replaced
            for count, verb in (
                (replaced, "replace"),
                (start[role] - replaced, "add"),
                (removed, "remove"),
            ):
                if count:
                    changes.append(
                        f"{verb} {count} {role} worker(s)"
                        + (" (options changed)" if verb == "replace" else "")
                    )
        need: dict[str, float] = {}
        for role in ROLES:
            for name, amount in templates[role].resources.items():
                need[name] = need.get(name, 0.0) + amount * start[role]
        free = ray.available_resources()
        surge = all(free.get(name, 0.0) >= amount for name, amount in need.items())
        kv_change = any(
            w.template.kv_key != templates[role].kv_key for role in ROLES for w in outdated[role]
        )
        leaving = [w for role in ROLES for w in outdated[role] + surplus[role]]
        if surge or self.router is None:
            for role in ROLES:
                self._start_workers(templates[role], start[role])
            self._ensure_pairs()
            started = self._ensure_router(router_options(m))
            self._retire(leaving, m)  # publishes the new workers as the old ones leave
        elif kv_change:
            started = self._ensure_router(router_options(m))
            self._log(
                f"not enough free resources ({free}) to start the new workers beside "
                "the old ones, and the KV format changes: replacing every worker at "
                "once; requests wait at the router meanwhile"
            )
            self._retire(leaving, m)
            for role in ROLES:
                self._start_workers(templates[role], start[role])
            self._ensure_pairs()
            self._publish(m)
        else:
            started = self._ensure_router(router_options(m))
            self._log(
                f"not enough free resources ({free}) to start the new workers beside "
                "the old ones: replacing one worker at a time"
            )
            replace = {role: outdated[role][: start[role]] for role in ROLES}
            self._retire(
                [w for role in ROLES for w in outdated[role][start[role] :] + surplus[role]], m
            )
            for role in ROLES:
                for old in replace[role]:
                    self._retire([old], m)
                    self._start_workers(templates[role], 1)
                    self._ensure_pairs()
                    self._publish(m)
                self._start_workers(templates[role], start[role] - len(replace[role]))
            self._ensure_pairs()
            self._publish(m)
        if started:
            changes.append(f"{started} router")
        return changes

    def _active(self, role: str) -> list[Worker]:
        return [w for w in self.workers_by_id.values() if w.role == role and not w.draining]

    def _start_workers(self, template: WorkerTemplate, count: int) -> list[Worker]:
        """Place and start `count` workers of a template; waits until each answers. On any
        failure the ones started here are removed again and RuntimeError says why."""
        started: list[Worker] = []
        if count <= 0:
            return started
        try:
            for _ in range(count):
                worker_id = f"{template.role}-{self._next_index[template.role]}"
                self._next_index[template.role] += 1
                self._log(f"starting {worker_id} with resources {template.resources}")
                pg = placement_group(
                    [dict(template.resources)], strategy="PACK", name=f"baton-{worker_id}"
                )
                worker = Worker(worker_id, template, None, pg)
                started.append(worker)
                ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
                if not ready:
                    raise RuntimeError(
                        f"{worker_id}: no node could give {template.resources} within "
                        f"{PLACEMENT_TIMEOUT_S:.0f} s (free: {ray.available_resources()}); "
                        "add nodes or lower the replicas or resources"
                    )
                r = template.resources
                worker.handle = (
                    _worker_class(template.role)
                    .options(
                        name=worker_id,
                        namespace=NAMESPACE,
                        num_cpus=r.get("CPU", 0),
                        num_gpus=r.get("GPU", 0),
                        resources={k: v for k, v in r.items() if k not in ("CPU", "GPU")} or None,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            pg, placement_group_bundle_index=0
                        ),
                        runtime_env={"env_vars": WORKER_ENV},
                    )
                    .remote(worker_id, template.engine, template.transfer, template.threads)
                )
            incarnations = ray.get([w.handle.ping.remote() for w in started], timeout=600)
        except Exception as exc:
            for worker in started:
                if worker.handle is not None:
                    ray.kill(worker.handle)
                remove_placement_group(worker.pg)
            raise RuntimeError(
                f"starting {template.role} worker(s) failed: {short_error(exc)}"
            ) from None
        for worker, incarnation in zip(started, incarnations, strict=True):
            worker.incarnation = incarnation
            with self._state_lock:
                self.workers_by_id[worker.worker_id] = worker
            self._log(f"{worker.worker_id} is up")
        return started

    def _ensure_pairs(self) -> None:
        """Pair every active prefill worker with every active decode worker of the same KV
        key that it is not paired with yet (also mends what a failed apply left)."""
        for p in self._active("prefill"):
            for d in self._active("decode"):
                if (
                    p.template.kv_key == d.template.kv_key
                    and (p.worker_id, d.worker_id) not in self._pairs
                ):
                    self._pair(p, d)

    def _pair(self, p: Worker, d: Worker) -> None:
        address = ray.get(
            p.handle.connect_decode.remote(d.worker_id, RayPeer(d.handle)), timeout=60
        )
        ray.get(
            d.handle.connect_prefill.remote(p.worker_id, address, RayPeer(p.handle)), timeout=60
        )
        self._pairs.add((p.worker_id, d.worker_id))

    def _unpair(self, p: Worker, d: Worker) -> None:
        self._pairs.discard((p.worker_id, d.worker_id))
        for call in (
            d.handle.disconnect_prefill.remote(p.worker_id),
            p.handle.disconnect_decode.remote(d.worker_id),
        ):
            try:
                ray.get(call, timeout=30)
            except Exception as exc:  # noqa: BLE001 - a dead peer has nothing to tear down
                logger.warning("unpairing %s and %s: %s", p.worker_id, d.worker_id, exc)

    def _retire(self, workers: list[Worker], m) -> None:
        """Take workers out of the router's pools, wait for their requests, remove them."""
        for worker in workers:
            worker.draining = True
        self._publish(m)
        if not workers:
            return
        try:
            self._drain(workers, m.spec.drain_timeout_seconds)
        finally:
            for worker in workers:
                self._remove(worker)

    def _ensure_router(self, options: dict) -> str | None:
        """Start the router actor, or restart it when what its server was started with
        changed; a new policy is set in place. Returns "start", "restart" or None."""
        from cluster.router_actor import ROUTER_NAME, RouterActor

        key = tuple(options[k] for k in ("model", "skip_tokenizer", "host", "port"))
        if self.router is not None and key == self.router_key:
            try:
                ray.get(
                    self.router.configure.remote(
                        options["policy"],
                        options["local_prefill_tokens"],
                        options["wait_for_workers_s"],
                    ),
                    timeout=30,
                )
                return None
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                self._log(f"the router does not answer ({short_error(exc)}); starting a new one")
                key = None  # restart it below
        verb = "restart" if self.router is not None else "start"
        if self.router is not None:
            if key is not None:
                self._log(
                    f"restarting the router ({self.router_address} -> "
                    f"{options['host']}:{options['port']})"
                )
            self._stop_router()
        me = ray.get_runtime_context().current_actor
        # On the head node: the address clients (and a KubeRay Service) reach is stable.
        self.router = RouterActor.options(
            name=ROUTER_NAME, namespace=NAMESPACE, resources={HEAD_NODE_RESOURCE: 0.001}
        ).remote(me, options)
        port = ray.get(self.router.start.remote(), timeout=300)
        self.router_key = tuple(options[k] for k in ("model", "skip_tokenizer", "host", "port"))
        self.router_address = f"{options['host']}:{port}"
        self._log(f"router serving gRPC on {self.router_address}")
        return verb

    def _publish(self, m) -> None:
        """Tell the router which workers take new requests; returns once it holds."""
        if self.router is None:
            return
        pools = {role: {w.worker_id: w.handle for w in self._active(role)} for role in ROLES}
        pool_engine = m.spec.engine_for("prefill")
        max_model_len = None
        if pools["decode"]:
            decode = next(w for w in self._active("decode"))
            max_model_len = ray.get(decode.handle.info.remote(), timeout=60).get("max_model_len")
        ray.get(
            self.router.set_workers.remote(
                pools["prefill"],
                pools["decode"],
                pool_engine.block_size,
                pool_engine.hash_seed,
                max_model_len,
            ),
            timeout=60,
        )

    def _drain(self, leaving: list[Worker], timeout_s: float) -> None:
        """Wait until no request runs on any leaving worker (the router's view and the
        worker's own: queued, running, held for a transfer, waiting for KV)."""
        deadline = time.monotonic() + timeout_s
        last_report = 0.0
        ids = ", ".join(w.worker_id for w in leaving)
        self._log(f"draining {ids}")
        while True:
            routed = ray.get(self.router.active_counts.remote(), timeout=30)
            busy = {}
            for w in leaving:
                try:
                    s = ray.get(w.handle.stats.remote(), timeout=30)
                except Exception:  # noqa: BLE001 - a dead worker has nothing left to finish
                    continue
                n = max(
                    routed.get(w.worker_id, 0),
                    s["num_requests"] + s.get("num_held", 0) + s.get("num_waiting_for_kv", 0),
                )
                if n:
                    busy[w.worker_id] = n
            if not busy:
                self._log(f"drained {ids}")
                return
            if self._stopping.is_set():
                self._log(f"down requested: not waiting for {busy}")
                return
            now = time.monotonic()
            if now > deadline:
                self._log(
                    f"drain timed out after {timeout_s:.0f} s with requests still "
                    f"running: {busy}; removing anyway"
                )
                return
            if now - last_report > 2.0:
                last_report = now
                self._log(
                    "waiting for " + ", ".join(f"{w}: {n} request(s)" for w, n in busy.items())
                )
            time.sleep(DRAIN_POLL_S)

    def _remove(self, worker: Worker) -> None:
        """Unpair, stop and kill a worker and free its bundle."""
        for p_id, d_id in list(self._pairs):
            if worker.worker_id in (p_id, d_id):
                self._unpair(
                    self.workers_by_id.get(p_id, worker), self.workers_by_id.get(d_id, worker)
                )
        try:
            ray.get(worker.handle.shutdown.remote(), timeout=20)
        except Exception:  # noqa: BLE001 - killed below either way
            pass
        ray.kill(worker.handle)
        remove_placement_group(worker.pg)
        with self._state_lock:
            self.workers_by_id.pop(worker.worker_id, None)
        self._log(f"removed {worker.worker_id}")

    # ---- health ------------------------------------------------------------------------
    def check_health(self, timeout: float = 10.0) -> dict:
        """Ping every worker; re-pair any that Ray restarted. Returns {"restarts",
        "healthy": {id: bool}, "restarted": [ids]} for the router."""
        with self._state_lock:
            workers = list(self.workers_by_id.values())
        refs = [w.handle.ping.remote() for w in workers]
        restarted = []
        for worker, ref in zip(workers, refs, strict=True):
            try:
                incarnation = ray.get(ref, timeout=timeout)
            except Exception:  # noqa: BLE001 - dead, restarting or hung
                worker.healthy = False
                continue
            worker.healthy = True
            if incarnation != worker.incarnation:
                restarted.append(worker)
        if restarted and self._apply_lock.acquire(blocking=False):
            try:
                for worker in restarted:
                    logger.warning("worker %s was restarted; pairing it again", worker.worker_id)
                    for pair in [pr for pr in self._pairs if worker.worker_id in pr]:
                        p, d = (self.workers_by_id[i] for i in pair)
                        self._unpair(p, d)
                        self._pair(p, d)
                    worker.incarnation = ray.get(worker.handle.ping.remote(), timeout=timeout)
                self.restarts += len(restarted)
            finally:
                self._apply_lock.release()
        else:
            for worker in restarted:  # an apply runs: re-paired by a later check, no requests
                worker.healthy = False
            restarted = []
        return {
            "restarts": self.restarts,
            "healthy": {w.worker_id: w.healthy for w in workers},
            "restarted": [w.worker_id for w in restarted],
        }

    # ---- queries -----------------------------------------------------------------------
    def worker_ids(self, role: str | None = None) -> list[str]:
        return [w for w, rec in self.workers_by_id.items() if role is None or rec.role == role]

    def handle(self, worker_id: str):
        return self.workers_by_id[worker_id].handle

    def workers(self) -> list[dict]:
        """Every worker with its role, state, health and stats (load, KV usage, hits)."""
        with self._state_lock:
            workers = list(self.workers_by_id.values())
        refs = [w.handle.stats.remote() for w in workers]
        out = []
        for w, ref in zip(workers, refs, strict=True):
            try:
                stats, healthy = ray.get(ref, timeout=10), True
            except Exception as exc:  # noqa: BLE001 - reported as unhealthy
                stats, healthy = {"error": str(exc)}, False
            queries = stats.get("cache_queries", 0)
            out.append(
                {
                    **stats,
                    "worker_id": w.worker_id,
                    "role": w.role,
                    "healthy": healthy,
                    "state": "draining" if w.draining else "active",
                    "cache_hit_rate": stats.get("cache_hits", 0) / queries if queries else 0.0,
                }
            )
        return out

    def status(self) -> dict:
        """The cluster as `baton deploy status` shows it."""
        router = None
        if self.router is not None:
            try:
                router = ray.get(self.router.stats.remote(), timeout=10)
            except Exception as exc:  # noqa: BLE001 - shown as such
                router = {"error": str(exc)}
            router["address"] = self.router_address
        workers = self.workers()
        counts = {
            role: sum(1 for w in workers if w["role"] == role and w["state"] == "active")
            for role in ROLES
        }
        return {
            "name": self.manifest["metadata"]["name"] if self.manifest else None,
            "generation": self.generation,
            "replicas": counts,
            "router": router,
            "workers": workers,
            "manifest": self.manifest,
        }

    def get_manifest(self) -> dict | None:
        return self.manifest

    # ---- teardown ----------------------------------------------------------------------
    def _stop_router(self) -> None:
        try:
            ray.get(self.router.stop.remote(), timeout=30)
        except Exception as exc:  # noqa: BLE001 - killed below either way
            logger.warning("stopping the router: %s", exc)
        ray.kill(self.router)
        self.router = None
        self.router_key = self.router_address = None

    def shutdown(self) -> None:
        """Stop the router and remove every worker and its bundle (no drain)."""
        self._stopping.set()  # a running apply stops draining; then it gives up the lock
        with self._apply_lock:
            if self.router is not None:
                self._stop_router()
                self._log("router stopped")
            for worker in list(self.workers_by_id.values()):
                self._remove(worker)
            self.manifest = None


def short_error(exc: BaseException) -> str:
    """One line for an exception, out of Ray's wrappers (no remote traceback)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}".splitlines()[0]
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(exc).__name__


def node_resources() -> list[dict[str, float]]:
    """The total resources of every live node."""
    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


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
            num_cpus=0,
            max_concurrency=16,
        )
        .remote()
    )
