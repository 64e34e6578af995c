"""What `baton profile serving` reads from a running local cluster: each Baton process (the
router actor, every worker actor, and this client process) with its pid and thread names,
the threads' CPU from /proc, the workers' metrics families and their token-time records.

The processes are found through Ray: the controller's worker records (controller.worker_ids,
controller.handle) and the router's named actor; each actor reports its own pid and names
its threads at the OS level (cluster/thread_names.py) when asked, so a thread started during
a run gets its name at the next ask. Only processes on this host can be read (/proc).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from cluster.thread_names import name_os_threads
from perf.serving.proc_threads import ThreadCPU, read_process

CALL_S = 60.0  # one probe call to an actor


@dataclass
class Process:
    """One process of the run: `label` is "router", "client" or a worker id."""

    label: str
    role: str  # router | prefill | decode | client
    pid: int
    names: dict[int, str] = field(default_factory=dict)  # native thread id -> Python name
    handle: Any = None  # the Ray actor (None: this process)

    def refresh_names(self) -> None:
        """Ask the process again for its threads' names (and name new ones at the OS level)."""
        import ray

        if self.handle is None:
            self.names = name_os_threads()
        else:
            self.names = ray.get(self.handle.process_threads.remote(), timeout=CALL_S)["threads"]


class ClusterProbe:
    """The processes of the local cluster running in this Ray session."""

    def __init__(self, processes: list[Process]) -> None:
        self.processes = processes

    @classmethod
    def find(cls) -> ClusterProbe:
        """Every worker of the controller's records, the router and this process."""
        import ray

        from cluster.controller import NAMESPACE, controller_handle
        from cluster.router_actor import ROUTER_NAME

        controller = controller_handle()
        found: list[tuple[str, str, Any]] = [
            ("router", "router", ray.get_actor(ROUTER_NAME, namespace=NAMESPACE))
        ]
        for role in ("prefill", "decode"):
            for worker_id in sorted(ray.get(controller.worker_ids.remote(role), timeout=CALL_S)):
                handle = ray.get(controller.handle.remote(worker_id), timeout=CALL_S)
                found.append((worker_id, role, handle))
        processes = []
        for label, role, handle in found:
            info = ray.get(handle.process_threads.remote(), timeout=CALL_S)
            processes.append(Process(label, role, int(info["pid"]), info["threads"], handle))
        processes.append(Process("client", "client", os.getpid(), name_os_threads()))
        return cls(processes)

    @property
    def workers(self) -> list[Process]:
        return [p for p in self.processes if p.role in ("prefill", "decode")]

    def cpu(self) -> dict[str, tuple[float, list[ThreadCPU]]]:
        """{label: read_process(pid)} now."""
        return {p.label: read_process(p.pid) for p in self.processes}

    def refresh_names(self) -> None:
        for p in self.processes:
            p.refresh_names()

    def metrics(self) -> dict[str, list[dict]]:
        """{worker id: its metrics families (engine.metrics.snapshot)} now."""
        import ray

        refs = {p.label: p.handle.metrics.remote() for p in self.workers}
        return {label: ray.get(ref, timeout=CALL_S) for label, ref in refs.items()}

    def token_times(self, on: bool) -> dict[str, list[tuple[str, int, float]]]:
        """Start (on) or stop every worker's token-time record; {worker id: what it had}."""
        import ray

        refs = {p.label: p.handle.token_times.remote(on) for p in self.workers}
        return {label: ray.get(ref, timeout=CALL_S) for label, ref in refs.items()}
