"""What the controller knows of the cluster it runs, shared by its parts.

ClusterState holds the applied manifest, the workers, the prefill/decode pairs, the router and
the progress lines, and the locks that order changes to them. Every change a part makes is
saved (`log` and `save`: cluster/state_store.py), so that a restarted controller carries on:
`snapshot` writes the document, `restore` reads it back given the actors Ray still runs (the
Ray look-ups are cluster/recovery.py's; both are plain functions of the state here).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from cluster import state_store
from cluster.ray_helpers import NAMESPACE
from cluster.templates import ROLES, WorkerTemplate
from cluster.worker_actor import Worker

logger = logging.getLogger(__name__)

EVENTS_KEPT = 200  # progress lines saved with the state (a restarted controller shows them)


class NoCluster(RuntimeError):
    """No Baton controller runs on this Ray cluster (or it has no manifest applied yet)."""


@dataclass(frozen=True, slots=True)
class RouterRecord:
    """The router actor as the controller tracks it. A router whose start failed has only its
    handle (so the next apply stops it before starting another under the same name)."""

    handle: Any
    key: tuple | None = None  # what its servers were started with (RouterSettings.server_key)
    address: str | None = None  # gRPC, host:port
    http_address: str | None = None  # the OpenAI front door (scheme://host:port), if served
    ports: dict | None = None  # {"grpc", "http"} bound at its start; a restarted router reuses them


class EventLog:
    """Progress lines of reconciles, numbered from the first line the cluster ever logged; a
    restarted controller keeps the last EVENTS_KEPT and counts on from there."""

    def __init__(self, lines: list[str] | None = None, total: int | None = None) -> None:
        self._lines = list(lines or [])
        self._base = (len(self._lines) if total is None else total) - len(self._lines)

    def append(self, line: str) -> None:
        self._lines.append(line)

    def since(self, index: int) -> list[str]:
        """The lines from number `index` on (those before the kept ones are gone)."""
        return self._lines[max(0, index - self._base) :]

    def last(self, n: int) -> list[str]:
        return self._lines[-n:]

    def count(self) -> int:
        """How many lines were ever logged (the next line's number)."""
        return self._base + len(self._lines)


class ClusterState:
    """The controller's record of one Baton cluster. Invariants: `pairs` names only workers in
    `workers_by_id`; a worker in `workers_by_id` answered its first ping (its incarnation and
    node are known); `apply_lock` is held by whatever changes the workers or the router."""

    def __init__(self) -> None:
        self.manifest: dict | None = None  # the last applied manifest, as a dict
        self.generation = 0  # bumps whenever an applied manifest's spec differs
        self.restarts = 0  # workers Ray restarted as a new incarnation
        self.workers_by_id: dict[str, Worker] = {}  # in start order
        self.pairs: set[tuple[str, str]] = set()  # (prefill id, decode id) with a group
        self.unreported: set[str] = set()  # re-paired workers the router was not told of
        self.next_index: dict[str, int] = dict.fromkeys(
            ROLES, 0
        )  # the next worker id's number, per role
        self.router: RouterRecord | None = None
        self.events = EventLog()
        self.apply_lock = threading.Lock()  # one reconcile at a time
        self.state_lock = threading.Lock()  # workers_by_id, pairs and unreported change
        self.save_lock = threading.Lock()  # one snapshot written at a time, in order
        self.stopping = threading.Event()  # `down`: cut a running drain short

    # ---- reads ---------------------------------------------------------------------------
    def workers(self) -> list[Worker]:
        """Every worker (active and draining), in start order."""
        with self.state_lock:
            return list(self.workers_by_id.values())

    def require_router(self) -> RouterRecord:
        """The router actor's record, on the paths that run once the controller started it."""
        if self.router is None:
            raise RuntimeError("the cluster has no router actor yet")
        return self.router

    def active(self, role: str) -> list[Worker]:
        """The role's workers that take new requests, in start order."""
        return [w for w in self.workers_by_id.values() if w.role == role and not w.draining]

    def draining(self) -> list[Worker]:
        return [w for w in self.workers_by_id.values() if w.draining]

    # ---- changes -------------------------------------------------------------------------
    def add_worker(self, worker: Worker) -> None:
        with self.state_lock:
            self.workers_by_id[worker.worker_id] = worker

    def drop_worker(self, worker_id: str) -> None:
        with self.state_lock:
            self.workers_by_id.pop(worker_id, None)

    def log(self, message: str) -> None:
        """A progress line: logged, kept for `events` and `status`, and saved."""
        logger.info(message)
        self.events.append(message)
        self.save()

    def save(self) -> None:
        """Write the state; a failure is logged (the next change writes it again)."""
        with self.save_lock:
            try:
                state_store.save(self.snapshot(), NAMESPACE)
            except Exception as exc:  # noqa: BLE001 - serving goes on without it
                logger.warning("saving the controller state failed: %s", exc)

    # ---- the saved document (cluster/state_store.py) ----------------------------------------
    def snapshot(self) -> dict:
        """The state as cluster/state_store.py stores it (no handles: looked up by name)."""
        with self.state_lock:
            workers = list(self.workers_by_id.values())
            pairs = sorted(self.pairs)
        router = None
        if self.router is not None:
            r = self.router
            router = {
                "key": None if r.key is None else list(r.key),
                "address": r.address,
                "http_address": r.http_address,
                "ports": r.ports,
            }
        return {
            "manifest": self.manifest,
            "generation": self.generation,
            "restarts": self.restarts,
            "next_index": dict(self.next_index),
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
            "events": self.events.last(EVENTS_KEPT),
            "num_events": self.events.count(),
        }

    def restore(
        self,
        saved: dict,
        find_worker: Callable[[str], tuple[Any, Any] | None],
        find_router: Callable[[], Any | None],
    ) -> list[str]:
        """Take over a snapshot: `find_worker(worker_id)` gives the running worker's (actor
        handle, placement group), `find_router()` the router's handle, None where Ray no
        longer has it. What is gone is dropped (with its pairs); returns its names."""
        self.manifest = saved["manifest"]
        self.generation = saved["generation"]
        self.restarts = saved["restarts"]
        self.next_index.update(saved["next_index"])
        self.events = EventLog(saved["events"], saved["num_events"])
        gone = []
        for record in saved["workers"]:
            worker_id = record["worker_id"]
            found = find_worker(worker_id)
            if found is None:
                gone.append(worker_id)
                continue
            handle, pg = found
            self.workers_by_id[worker_id] = Worker(
                worker_id,
                WorkerTemplate(**record["template"]),
                handle,
                pg,
                incarnation=record["incarnation"],
                draining=record["draining"],
                node_id=record["node_id"],
            )
        self.pairs = {
            (p, d) for p, d in saved["pairs"] if p in self.workers_by_id and d in self.workers_by_id
        }
        router = saved["router"]
        if router is not None:
            handle = find_router()
            if handle is None:
                gone.append("the router")
            else:
                self.router = RouterRecord(
                    handle,
                    None if router["key"] is None else tuple(router["key"]),
                    router["address"],
                    router["http_address"],
                    router["ports"],
                )
        return gone
