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

What a reconcile does is decided by cluster/plan.py (pure); this module executes the plan. Its
waits are named in cluster/timeouts.py.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict

import ray
from ray.util.placement_group import (
    get_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster import state_store
from cluster import timeouts as T
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
from cluster.ray_peer import RayPeer
from cluster.router_actor import ROUTER_NAME, RouterActor
from cluster.templates import ROLES, WorkerTemplate, router_options, worker_templates
from cluster.worker_actor import WORKER_ENV, Worker, worker_class
from deploy.manifest import Manifest, ManifestError, check_resources, parse_manifest

logger = logging.getLogger(__name__)

NAMESPACE = "baton"
CONTROLLER_NAME = "baton-controller"
HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray gives the head node this resource
EVENTS_KEPT = 200  # progress lines saved with the state (a restarted controller shows them)
STATUS_EVENTS = 10  # the last progress lines `baton deploy status` shows


class NoCluster(RuntimeError):
    """No Baton controller runs on this Ray cluster."""


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
        self.router_http_address: str | None = None  # the OpenAI front door, if served
        self.router_ports: dict | None = None  # bound at its start; a restarted router reuses them
        self._pairs: set[tuple[str, str]] = set()  # (prefill id, decode id) with a group
        self._unreported: set[str] = set()  # re-paired workers the router was not told of
        self._next_index = dict.fromkeys(ROLES, 0)
        self._apply_lock = threading.Lock()  # one reconcile at a time
        self._state_lock = threading.Lock()  # workers_by_id changes
        self._events: list[str] = []
        self._events_base = 0  # lines before self._events[0] (dropped by a restart)
        self._stopping = threading.Event()  # `down`: cut a running drain short
        self._save_lock = threading.Lock()  # one snapshot written at a time, in order
        self._adopt_saved()  # a restarted controller carries on where the dead one was

    # ---- state that outlives this process (cluster/state_store.py) ------------------------
    def _snapshot(self) -> dict:
        with self._state_lock:
            workers = list(self.workers_by_id.values())
            pairs = sorted(self._pairs)
        router = None
        if self.router is not None:
            router = {
                "key": None if self.router_key is None else list(self.router_key),
                "address": self.router_address,
                "http_address": self.router_http_address,
                "ports": self.router_ports,
            }
        return {
            "manifest": self.manifest,
            "generation": self.generation,
            "restarts": self.restarts,
            "next_index": dict(self._next_index),
            "workers": [
                {
                    "worker_id": w.worker_id,
                    "template": asdict(w.template),
                    "incarnation": w.incarnation,
                    "draining": w.draining,
                    "node_id": w.node_id,
                }
                for w in workers
            ],
            "pairs": [list(p) for p in pairs],
            "router": router,
            "events": self._events[-EVENTS_KEPT:],
            "num_events": self.num_events(),
        }

    def _save(self) -> None:
        """Write the state; a failure is logged (the next change writes it again)."""
        with self._save_lock:
            try:
                state_store.save(self._snapshot(), NAMESPACE)
            except Exception as exc:  # noqa: BLE001 - serving goes on without it
                logger.warning("saving the controller state failed: %s", exc)

    def _adopt_saved(self) -> None:
        """Load the state a dead incarnation saved and look its actors up by name; workers
        and the router keep running untouched. A worker or router that is gone is dropped
        (the next apply starts what the manifest misses)."""
        try:
            saved = state_store.load(NAMESPACE)
        except Exception as exc:  # noqa: BLE001 - start empty
            logger.warning("loading the controller state failed: %s", exc)
            return
        if not saved:
            return
        self.manifest = saved["manifest"]
        self.generation = saved["generation"]
        self.restarts = saved["restarts"]
        self._next_index.update(saved["next_index"])
        self._events = list(saved["events"])
        self._events_base = saved["num_events"] - len(self._events)
        gone = []
        for record in saved["workers"]:
            worker_id = record["worker_id"]
            try:
                handle = ray.get_actor(worker_id, namespace=NAMESPACE)
                pg = get_placement_group(placement_group_name(worker_id))
            except ValueError:
                gone.append(worker_id)
                continue
            self.workers_by_id[worker_id] = Worker(
                worker_id,
                WorkerTemplate(**record["template"]),
                handle,
                pg,
                incarnation=record["incarnation"],
                draining=record["draining"],
                node_id=record["node_id"],
            )
        self._pairs = {
            (p, d) for p, d in saved["pairs"] if p in self.workers_by_id and d in self.workers_by_id
        }
        router = saved["router"]
        if router is not None:
            try:
                self.router = ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
            except ValueError:
                gone.append("the router")
            else:
                self.router_key = None if router["key"] is None else tuple(router["key"])
                self.router_address = router["address"]
                self.router_http_address = router["http_address"]
                self.router_ports = router["ports"]
        ids = ", ".join(self.workers_by_id) or "none"
        self._log(
            f"controller restarted: re-adopted workers {ids}"
            + (f" and the router on {self.router_address}" if self.router is not None else "")
            + (f"; gone meanwhile: {', '.join(gone)}" if gone else "")
        )
        threading.Thread(target=self._check_adopted, name="adopt", daemon=True).start()

    def _check_adopted(self) -> None:
        """Ping the re-adopted workers once: same incarnation = untouched; re-pair those Ray
        restarted while no controller ran."""
        try:
            health = self.check_health()
        except Exception as exc:  # noqa: BLE001 - the router's next poll checks again
            self._log(f"checking the re-adopted workers failed: {short_error(exc)}")
            return
        healthy = [w for w, ok in health["healthy"].items() if ok]
        repaired = health["restarted"]
        self._log(
            f"re-adopted workers answering: {', '.join(healthy) or 'none'}"
            + (f"; re-paired (restarted meanwhile): {', '.join(repaired)}" if repaired else "")
        )
        with self._apply_lock:
            self._remove_orphans()
            leftovers = [w for w in self.workers_by_id.values() if w.draining]
            if leftovers and self.manifest is not None:  # the dead one was draining these
                self._retire(leftovers, parse_manifest(self.manifest))

    def _remove_orphans(self) -> None:
        """Remove workers and bundles no record names: started by an incarnation that died
        before it recorded them (they would hold their resources for ever)."""
        known = set(self.workers_by_id)
        prefixes = tuple(f"{role}-" for role in ROLES)
        for actor in ray.util.list_named_actors(all_namespaces=True):
            name = actor["name"]
            if actor["namespace"] == NAMESPACE and name.startswith(prefixes) and name not in known:
                try:
                    ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
                    self._log(f"removed {name}: started by the dead controller, never recorded")
                except ValueError:
                    pass
        for table in ray.util.placement_group_table().values():
            name = table.get("name") or ""
            worker_id = name.removeprefix("baton-")
            if name.startswith("baton-") and worker_id not in known and table["state"] != "REMOVED":
                try:
                    remove_placement_group(get_placement_group(name))
                except ValueError:
                    pass

    # ---- progress ----------------------------------------------------------------------
    def _log(self, message: str) -> None:
        logger.info(message)
        self._events.append(message)
        self._save()

    def events(self, since: int = 0) -> list[str]:
        """Progress lines of reconciles, from index `since` on (callers keep the count; a
        restarted controller kept the last EVENTS_KEPT lines and counts on from there)."""
        return self._events[max(0, since - self._events_base) :]

    def num_events(self) -> int:
        return self._events_base + len(self._events)

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

    def _reconcile(self, m: Manifest) -> list[str]:
        """Bring the workers and the router to the manifest: mend what a failed reconcile
        left (workers still draining), then execute plan()'s steps (cluster/plan.py says
        how the new workers are placed)."""
        templates = worker_templates(m)
        leftovers = [w for w in self.workers_by_id.values() if w.draining]
        if leftovers:  # an earlier reconcile failed while draining these
            self._retire(leftovers, m)
        current = Current(
            tuple(Running(w.worker_id, w.template) for role in ROLES for w in self._active(role)),
            has_router=self.router is not None,
        )
        desired = {role: Pool(templates[role], getattr(m.spec, role).replicas) for role in ROLES}
        planned = plan(current, desired, ray.available_resources())
        router_change = None
        for step in planned.steps:
            match step:
                case Start(role=role, count=count):
                    self._start_workers(templates[role], count)
                case Pair():
                    self._ensure_pairs()
                case EnsureRouter():
                    router_change = self._ensure_router(router_options(m))
                case Retire(worker_ids=ids):
                    self._retire([self.workers_by_id[i] for i in ids], m)
                case Publish():
                    self._publish(m)
                case Note(text=text):
                    self._log(text)
        changes = list(planned.changes)
        if router_change:
            changes.append(f"{router_change} router")
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
                r = template.resources
                worker.handle = (
                    worker_class(template.role)
                    .options(
                        name=worker_id,
                        namespace=NAMESPACE,
                        lifetime="detached",
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
            incarnations = ray.get(
                [w.handle.ping.remote() for w in started], timeout=T.WORKER_START_S
            )
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
            with self._state_lock:
                self.workers_by_id[worker.worker_id] = worker
            self._log(f"{worker.worker_id} is up on node {short_node(node)}")
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
            p.handle.connect_decode.remote(d.worker_id, RayPeer(d.handle)), timeout=T.PAIR_S
        )
        ray.get(
            d.handle.connect_prefill.remote(p.worker_id, address, RayPeer(p.handle)),
            timeout=T.PAIR_S,
        )
        with self._state_lock:
            self._pairs.add((p.worker_id, d.worker_id))
        self._save()

    def _unpair(self, p: Worker, d: Worker) -> None:
        with self._state_lock:
            self._pairs.discard((p.worker_id, d.worker_id))
        self._save()
        for call in (
            d.handle.disconnect_prefill.remote(p.worker_id),
            p.handle.disconnect_decode.remote(d.worker_id),
        ):
            try:
                ray.get(call, timeout=T.UNPAIR_S)
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

    def _configure_router(self, options: dict) -> None:
        """Set what the router changes in place: policy, conditional disaggregation, the
        wait for workers, aggregated mode and the migration limit."""
        ray.get(
            self.router.configure.remote(
                options["policy"],
                options["local_prefill_tokens"],
                options["wait_for_workers_s"],
                options["aggregated"],
                options.get("migration_limit"),
            ),
            timeout=T.ROUTER_CONFIGURE_S,
        )

    def _ensure_router(self, options: dict) -> str | None:
        """Start the router actor, or restart it when what its server was started with
        changed; a new policy is set in place. Returns "start", "restart" or None."""
        key = _router_key(options)
        if self.router is not None and key == self.router_key:
            try:
                self._configure_router(options)
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
            name=ROUTER_NAME,
            namespace=NAMESPACE,
            lifetime="detached",
            resources={HEAD_NODE_RESOURCE: 0.001},
        ).remote(me, options)
        ports = ray.get(self.router.start.remote(), timeout=T.ROUTER_START_S)
        self.router_key = _router_key(options)
        self.router_ports = ports
        self.router_address = f"{options['host']}:{ports['grpc']}"
        scheme = "https" if options.get("tls") else "http"
        self.router_http_address = (
            f"{scheme}://{options['host']}:{ports['http']}" if ports["http"] is not None else None
        )
        self._log(
            f"router serving gRPC on {self.router_address}"
            + (f", OpenAI HTTP on {self.router_http_address}" if self.router_http_address else "")
        )
        return verb

    def _publish(self, m) -> None:
        """Tell the router which workers take new requests; returns once it holds."""
        if self.router is None:
            return
        pools = {role: {w.worker_id: w.handle for w in self._active(role)} for role in ROLES}
        pool_engine = m.spec.engine_for("prefill")
        max_model_len = None
        for decode in self._active("decode"):  # any that answers: one may be restarting
            try:
                info = ray.get(decode.handle.info.remote(), timeout=T.WORKER_INFO_S)
            except Exception as exc:  # noqa: BLE001 - dead or restarting: ask the next one
                logger.warning("info of %s: %s", decode.worker_id, short_error(exc))
                continue
            max_model_len = info.max_model_len
            break
        ray.get(
            self.router.set_workers.remote(
                pools["prefill"],
                pools["decode"],
                pool_engine.block_size,
                pool_engine.hash_seed,
                max_model_len,
            ),
            timeout=T.PUBLISH_S,
        )

    def _drain(self, leaving: list[Worker], timeout_s: float) -> None:
        """Wait until no request runs on any leaving worker (the router's view and the
        worker's own: queued, running, held for a transfer, waiting for KV)."""
        deadline = time.monotonic() + timeout_s
        last_report = 0.0
        ids = ", ".join(w.worker_id for w in leaving)
        self._log(f"draining {ids}")
        while True:
            routed = ray.get(self.router.active_counts.remote(), timeout=T.DRAIN_QUERY_S)
            busy = {}
            for w in leaving:
                try:
                    s = ray.get(w.handle.stats.remote(), timeout=T.DRAIN_QUERY_S)
                except Exception:  # noqa: BLE001 - a dead worker has nothing left to finish
                    continue
                n = max(routed.get(w.worker_id, 0), s.num_in_flight)
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
            if now - last_report > T.DRAIN_REPORT_S:
                last_report = now
                self._log(
                    "waiting for " + ", ".join(f"{w}: {n} request(s)" for w, n in busy.items())
                )
            time.sleep(T.DRAIN_POLL_S)

    def _remove(self, worker: Worker) -> None:
        """Unpair, stop and kill a worker and free its bundle."""
        for p_id, d_id in list(self._pairs):
            if worker.worker_id in (p_id, d_id):
                self._unpair(
                    self.workers_by_id.get(p_id, worker), self.workers_by_id.get(d_id, worker)
                )
        try:
            ray.get(worker.handle.shutdown.remote(), timeout=T.WORKER_SHUTDOWN_S)
        except Exception:  # noqa: BLE001 - killed below either way
            pass
        ray.kill(worker.handle)
        remove_placement_group(worker.pg)
        with self._state_lock:
            self.workers_by_id.pop(worker.worker_id, None)
        self._log(f"removed {worker.worker_id}")

    # ---- a router that Ray restarted (cluster/router_actor.py: recover) -------------------
    def bound_router_ports(self) -> dict | None:
        """The ports the router bound at its start: its restarted incarnation binds them again."""
        return self.router_ports

    def router_restarted(self) -> None:
        """The router came back empty: set its policy and publish the workers again (after a
        running apply, which may change both)."""
        with self._apply_lock:
            if self.router is None or self.manifest is None:
                return  # stopped meanwhile, or the first apply failed before its publish
            self._log(f"the router was restarted; serving again on {self.router_address}")
            m = parse_manifest(self.manifest)
            options = router_options(m)
            self._configure_router(options)
            self._publish(m)

    # ---- health ------------------------------------------------------------------------
    def check_health(self, timeout: float = T.HEALTH_PING_S) -> dict:
        """Ping every worker; re-pair any that Ray restarted (on its node or, after a node
        loss, wherever its placement group went). Returns {"restarts", "healthy": {id: bool},
        "restarted": [ids]} for the router. A worker that stops answering, and one that
        comes back, gets a progress line naming its node."""
        with self._state_lock:
            workers = list(self.workers_by_id.values())
        refs = [w.handle.ping.remote() for w in workers]
        restarted = []
        for worker, ref in zip(workers, refs, strict=True):
            try:
                incarnation = ray.get(ref, timeout=timeout)
            except Exception as exc:  # noqa: BLE001 - dead, restarting or hung
                if worker.healthy and worker.worker_id in self.workers_by_id:  # not removed
                    self._log(self._lost_line(worker, exc))
                worker.healthy = False
                continue
            if incarnation != worker.incarnation:
                restarted.append(worker)
            else:
                if not worker.healthy:
                    self._log(f"{worker.worker_id} answers again")
                worker.healthy = True
        repaired = []
        if restarted and self._apply_lock.acquire(blocking=False):
            try:
                for worker in restarted:
                    if self._repair(worker, timeout):
                        repaired.append(worker)
                self.restarts += len(repaired)
            finally:
                self._apply_lock.release()
            self._save()
        else:
            for worker in restarted:  # an apply runs: re-paired by a later check, no requests
                worker.healthy = False
        return {
            "restarts": self.restarts,
            "healthy": {w.worker_id: w.healthy for w in workers},
            "restarted": [w.worker_id for w in repaired],
        }

    def router_health(self) -> dict:
        """check_health for the router: "restarted" lists every worker re-paired since the
        router last asked, whichever check re-paired it (the router must forget the cache
        and load of each)."""
        health = self.check_health()
        with self._state_lock:
            restarted = sorted(self._unreported)
            self._unreported.clear()
        return {**health, "restarted": restarted}

    def _repair(self, worker: Worker, timeout: float) -> bool:
        """Pair a worker Ray restarted again with its peers; False (left unhealthy, tried
        again at the next check) if that fails."""
        logger.warning("worker %s was restarted; pairing it again", worker.worker_id)
        try:
            for pair in [pr for pr in self._pairs if worker.worker_id in pr]:
                p, d = (self.workers_by_id[i] for i in pair)
                self._unpair(p, d)
                self._pair(p, d)
            incarnation, node = ray.get(
                [worker.handle.ping.remote(), worker.handle.node_id.remote()], timeout=timeout
            )
        except Exception as exc:  # noqa: BLE001 - a peer may be down too
            worker.healthy = False
            self._log(
                f"{worker.worker_id} was restarted, but pairing it again failed "
                f"({short_error(exc)}); trying again at the next health check"
            )
            return False
        moved = "" if node == worker.node_id else f" (was on node {short_node(worker.node_id)})"
        worker.incarnation, worker.node_id, worker.healthy = incarnation, node, True
        with self._state_lock:
            self._unreported.add(worker.worker_id)
        self._log(
            f"{worker.worker_id} was restarted by Ray on node {short_node(node)}{moved}; "
            "paired again and serving"
        )
        return True

    def _lost_line(self, worker: Worker, exc: BaseException) -> str:
        """The progress line of a worker that stopped answering: where it ran and whether
        that node is still alive."""
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        node = short_node(worker.node_id)
        where = (
            f"its node {node} is alive (its process died; Ray restarts it there)"
            if worker.node_id in alive
            else f"its node {node} is gone (Ray restarts it where its bundle fits again)"
        )
        return f"{worker.worker_id} lost: no answer ({short_error(exc)}); {where}"

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
                # Answering is not enough: a worker Ray restarted is healthy again once the
                # health check paired it again (w.healthy).
                stats, healthy = ray.get(ref, timeout=T.STATS_S).summary(), w.healthy
            except Exception as exc:  # noqa: BLE001 - reported as unhealthy
                stats, healthy = {"error": str(exc)}, False
            out.append(
                {
                    **stats,
                    "worker_id": w.worker_id,
                    "role": w.role,
                    "healthy": healthy,
                    "state": "draining" if w.draining else "active",
                    "node_id": w.node_id,
                }
            )
        return out

    def status(self) -> dict:
        """The cluster as `baton deploy status` shows it."""
        router = None
        if self.router is not None:
            try:
                router = ray.get(self.router.stats.remote(), timeout=T.STATS_S)
            except Exception as exc:  # noqa: BLE001 - shown as such
                router = {"error": str(exc)}
            router["address"] = self.router_address
            router["http_address"] = self.router_http_address
        workers = self.workers()
        active = [w for w in workers if w["state"] == "active"]
        counts = {role: sum(1 for w in active if w["role"] == role) for role in ROLES}
        running = {
            role: sum(1 for w in active if w["role"] == role and w["healthy"]) for role in ROLES
        }
        wanted = {
            role: self.manifest["spec"][role]["replicas"] if self.manifest else 0 for role in ROLES
        }
        return {
            "name": self.manifest["metadata"]["name"] if self.manifest else None,
            "generation": self.generation,
            "replicas": counts,  # active workers (healthy or not)
            "wanted": wanted,  # the manifest's replicas
            "running": running,  # active workers that answer
            "degraded": any(running[r] < wanted[r] for r in ROLES),
            "mode": cluster_mode(self.manifest),
            "router": router,
            "workers": workers,
            "nodes": live_nodes(),
            "events": self._events[-STATUS_EVENTS:],
            "manifest": self.manifest,
        }

    def get_manifest(self) -> dict | None:
        return self.manifest

    def pid(self) -> int:
        """This incarnation's process id (tests kill it to show a restart re-adopts)."""
        import os

        return os.getpid()

    # ---- teardown ----------------------------------------------------------------------
    def _stop_router(self) -> None:
        try:
            ray.get(self.router.stop.remote(), timeout=T.ROUTER_STOP_S)
        except Exception as exc:  # noqa: BLE001 - killed below either way
            logger.warning("stopping the router: %s", exc)
        ray.kill(self.router)
        self.router = None
        self.router_key = self.router_address = self.router_http_address = None
        self.router_ports = None

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
            with self._save_lock:  # nothing left to adopt: the next controller starts empty
                state_store.delete(NAMESPACE)


def short_error(exc: BaseException) -> str:
    """One line for an exception, out of Ray's wrappers (no remote traceback)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}".splitlines()[0]
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(exc).__name__


def cluster_mode(manifest: dict | None) -> str | None:
    """The applied manifest's shape: "aggregated" (0 prefill workers: every request is
    prefilled on its decode worker) or "disaggregated" (None: no manifest applied)."""
    if manifest is None:
        return None
    return "aggregated" if manifest["spec"]["prefill"]["replicas"] == 0 else "disaggregated"


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
        if name.startswith("baton-") and table.get("state") != "REMOVED":
            try:
                remove_placement_group(get_placement_group(name))
                removed.append(f"placement group {name}")
            except ValueError:
                pass
    state_store.delete(NAMESPACE)
    return removed


def placement_group_name(worker_id: str) -> str:
    """A worker's placement group is named after it (a restarted controller finds it)."""
    return f"baton-{worker_id}"


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
            max_restarts=-1,  # a new incarnation re-adopts the running cluster (_adopt_saved)
            num_cpus=0,
            resources={HEAD_NODE_RESOURCE: 0.001},  # beside the router; worker nodes may go
            max_concurrency=16,
        )
        .remote()
    )


# What the router's servers were started with: a change restarts the router actor (policy,
# conditional disaggregation, waits and migration limit change in place).
ROUTER_SERVER_OPTIONS = (
    "model",
    "skip_tokenizer",
    "host",
    "port",
    "http_port",
    "served_model_names",
    "api_key_env",
    "api_key_file",
    "tls",
    "max_pending_requests",
    "chat_template",
)


def _router_key(options: dict) -> tuple:
    return tuple(options.get(k) for k in ROUTER_SERVER_OPTIONS)
