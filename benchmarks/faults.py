"""Faults on a running Ray deployment, on a seeded schedule: the chaos test
(tests/cluster/test_chaos.py) and the soak benchmark (benchmarks/soak.py) share it.

Kinds, each on a process found by its Ray actor name (namespace `baton`):
- "kill": SIGKILL a worker's process (Ray restarts the actor; the controller re-pairs it),
- "freeze": SIGSTOP a worker's process, then SIGCONT it `freeze_s` later,
- "router": SIGKILL the router actor's process (Ray restarts it on the same ports).

A frozen process is always continued, also when the run stops early or fails: nothing this
module stops is left stopped.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

KINDS = ("kill", "freeze", "router")
ROUTER = "baton-router"  # cluster.router_actor.ROUTER_NAME (no Ray import here)
PID_TIMEOUT_S = 30.0  # an actor that is restarting answers within this, or the fault is skipped


@dataclass(frozen=True, slots=True)
class Fault:
    """One fault: `at_s` seconds after the run's start, on `target` (a worker id or ROUTER)."""

    at_s: float
    kind: str
    target: str
    freeze_s: float = 0.0  # "freeze" only: how long the process stays stopped


@dataclass(slots=True)
class Applied:
    """What a fault did: the pid it hit (None: skipped) and when, in seconds from the start."""

    fault: Fault
    pid: int | None
    start_s: float
    end_s: float = 0.0
    error: str = ""


def fault_schedule(
    seed: int,
    worker_ids: list[str],
    *,
    num_faults: int,
    first_s: float,
    gap_s: float,
    freeze_s: tuple[float, float] = (1.5, 4.0),
) -> list[Fault]:
    """`num_faults` faults, every kind at least once (when num_faults >= 3), in a seeded order,
    gap_s +- 25% apart from first_s on; targets drawn from worker_ids. gap_s must exceed the
    longest freeze, so that faults never overlap."""
    if gap_s <= freeze_s[1]:
        raise ValueError(f"gap_s ({gap_s}) must exceed the longest freeze ({freeze_s[1]})")
    rng = random.Random(seed)
    kinds = list(KINDS[:num_faults]) + [rng.choice(KINDS) for _ in range(num_faults - 3)]
    rng.shuffle(kinds)
    faults, at = [], first_s
    for kind in kinds:
        if kind == "router":
            faults.append(Fault(round(at, 2), kind, ROUTER))
        else:
            freeze = round(rng.uniform(*freeze_s), 2) if kind == "freeze" else 0.0
            faults.append(Fault(round(at, 2), kind, rng.choice(worker_ids), freeze))
        at += gap_s * rng.uniform(0.75, 1.25)
    return faults


def _getpid(_actor) -> int:
    return os.getpid()


def actor_pid(name: str, namespace: str = "baton", timeout: float = PID_TIMEOUT_S) -> int:
    """The OS pid of the named actor's process (asked from the actor itself); an actor that
    Ray is restarting is asked again until `timeout` passes (then Ray's error is raised)."""
    import ray

    deadline = time.monotonic() + timeout
    while True:
        try:
            handle = ray.get_actor(name, namespace=namespace)
            left = max(0.1, deadline - time.monotonic())
            return ray.get(handle.__ray_call__.remote(_getpid), timeout=left)
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


class FaultInjector:
    """Runs a schedule on a thread: start(), then join() or stop(). `applied` lists what
    each fault did; `log` gets one line per fault."""

    def __init__(
        self, schedule: list[Fault], namespace: str = "baton", log: Callable[[str], None] = print
    ) -> None:
        self.schedule = sorted(schedule, key=lambda f: f.at_s)
        self.namespace = namespace
        self.log = log
        self.applied: list[Applied] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="faults", daemon=True)
        self.start_time = 0.0
        self._frozen: set[int] = set()  # pids stopped and not yet continued
        self._lock = threading.Lock()

    def start(self, start: float | None = None) -> FaultInjector:
        """Begin; fault times count from `start` (a time.monotonic() value, default now)."""
        self.start_time = time.monotonic() if start is None else start
        self._thread.start()
        return self

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def done(self) -> bool:
        return not self._thread.is_alive()

    def stop(self) -> None:
        """Skip the faults not applied yet and continue any frozen process now."""
        self._stop.set()
        self._thread.join(30.0)
        self._continue_all()

    def _now(self) -> float:
        return time.monotonic() - self.start_time

    def _run(self) -> None:
        try:
            for fault in self.schedule:
                if self._stop.wait(max(0.0, fault.at_s - self._now())):
                    return
                self.applied.append(self._apply(fault))
        finally:
            self._continue_all()

    def _apply(self, fault: Fault) -> Applied:
        try:
            pid = actor_pid(fault.target, self.namespace)
        except Exception as exc:  # noqa: BLE001 - restarting or unknown: skip this fault
            applied = Applied(fault, None, self._now(), self._now(), f"{type(exc).__name__}")
            self.log(f"[{applied.start_s:6.1f}s] {fault.kind} {fault.target}: skipped ({exc})")
            return applied
        applied = Applied(fault, pid, self._now())
        if fault.kind in ("kill", "router"):
            os.kill(pid, signal.SIGKILL)
            self.log(f"[{applied.start_s:6.1f}s] SIGKILL {fault.target} (pid {pid})")
        elif fault.kind == "freeze":
            with self._lock:
                self._frozen.add(pid)
            os.kill(pid, signal.SIGSTOP)
            self.log(
                f"[{applied.start_s:6.1f}s] SIGSTOP {fault.target} (pid {pid}) "
                f"for {fault.freeze_s:.1f} s"
            )
            self._stop.wait(fault.freeze_s)
            self._continue(pid)
            self.log(f"[{self._now():6.1f}s] SIGCONT {fault.target} (pid {pid})")
        else:
            raise ValueError(f"unknown fault kind {fault.kind!r}: one of {KINDS}")
        applied.end_s = self._now()
        return applied

    def _continue(self, pid: int) -> None:
        with self._lock:
            self._frozen.discard(pid)
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    def _continue_all(self) -> None:
        with self._lock:
            frozen = list(self._frozen)
        for pid in frozen:
            self._continue(pid)


@dataclass
class FaultSummary:
    """Counts of applied faults by kind (for reports)."""

    by_kind: dict[str, int] = field(default_factory=dict)
    skipped: int = 0

    @classmethod
    def of(cls, applied: list[Applied]) -> FaultSummary:
        out = cls()
        for a in applied:
            if a.pid is None:
                out.skipped += 1
            else:
                out.by_kind[a.fault.kind] = out.by_kind.get(a.fault.kind, 0) + 1
        return out
