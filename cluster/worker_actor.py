"""A worker's Ray actor class, and the controller's record of one running worker."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Any

import ray

from cluster.templates import WorkerTemplate
from kvtransfer.worker_api import Role

ACTOR_CONCURRENCY = 64  # control calls (a long prefill included) run side by side
# c10d logs a warning every time a decode worker's 0.5 s wait for the next KV announcement
# passes with none (a TCPStore socket timeout): not an error, and it would flood the logs.
WORKER_ENV = {"TORCH_CPP_LOG_LEVEL": "ERROR"}


def with_node_address(transfer: dict) -> dict:
    """`transfer` with `advertise_host: auto` replaced by this node's IP as Ray knows it, so
    that a peer on another node reaches this worker's pair stores (loopback would not)."""
    if transfer.get("advertise_host", "auto") != "auto":
        return transfer
    return {**transfer, "advertise_host": ray.util.get_node_ip_address()}


def worker_class(role: str):
    """The Ray actor class of a role (a threaded actor: control calls run concurrently)."""
    # Deferred: the worker packages load only in a process that starts a worker; `baton
    # deploy` imports the controller module (and so this one) for its names alone.
    base: Any  # PrefillWorker or DecodeWorker: a base class chosen at run time
    if role == Role.PREFILL:
        from prefill_worker.worker import PrefillWorker

        base = PrefillWorker
    else:
        from decode_worker.worker import DecodeWorker

        base = DecodeWorker

    class Actor(base):
        def __init__(self, worker_id: str, engine: dict, transfer: dict, threads: int) -> None:
            import torch  # deferred: runs in the worker's process

            from engine.gc_freeze import freeze_startup_objects

            torch.set_num_threads(threads)
            super().__init__(worker_id, engine, with_node_address(transfer))
            self.incarnation = uuid.uuid4().hex  # changes when Ray restarts the actor
            freeze_startup_objects()  # the loaded worker: no longer scanned by gc

        def ping(self) -> str:
            return self.incarnation

        def node_id(self) -> str:
            """The Ray node this incarnation runs on (hex)."""
            return ray.get_runtime_context().get_node_id()

        # ---- probes of `baton profile serving` (perf/serving) ----------------------------
        def process_threads(self) -> dict:
            """{"pid": this process, "threads": {native id: name}}, each Python thread's
            OS name set from it first (cluster/thread_names.py)."""
            from cluster.thread_names import name_os_threads

            return {"pid": os.getpid(), "threads": name_os_threads()}

        def token_times(self, on: bool) -> list[tuple[str, int, float]]:
            """Start (on) or stop recording when each sampled token's step ended
            (engine/step_phases.TokenTimes); returns what was recorded until now."""
            from engine.step_phases import TokenTimes

            def swap():
                engine = self.engine
                taken = engine.token_times.take() if engine.token_times is not None else []
                engine.token_times = TokenTimes() if on else None
                return taken

            return self.loop.run(swap)

    Actor.__name__ = Actor.__qualname__ = f"{base.__name__}Actor"
    # A dead worker is restarted by Ray (its __init__ runs again); calls in flight fail. The
    # controller starts it detached: it outlives a controller that dies (and is re-adopted).
    return ray.remote(  # type: ignore[call-overload]  # ray's remote() stubs omit actor options
        max_concurrency=ACTOR_CONCURRENCY, max_restarts=-1, max_task_retries=0
    )(Actor)


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
    node_id: str = ""  # the Ray node its current incarnation runs on (hex)

    @property
    def role(self) -> str:
        return self.template.role
