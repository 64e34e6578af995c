"""How a `baton deploy` command reaches the controller: connect this process to the Ray
cluster, find (or create) the controller actor, call it.

`deploy` sits below `cluster` and imports none of it: what a command needs of the cluster layer
(the controller actor, Baton's Ray namespace, removing leftovers) is a ControllerSide, handed
in by `baton deploy` (cluster/deploy_command.py) as a function that loads it. A DeployClient
calls that function only once a command has found a live Ray cluster: the controller's imports
take about 1.5 s (they pull in torch), and a command must report a cluster it cannot reach
before paying that (see deploy/ray_address.py). ray is imported inside the methods for the
same reason.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from deploy import ray_address

WHAT_TO_DO = "start one with `ray start --head`, or pass --address"
EVENTS_POLL_S = 0.5  # between two looks at a running apply's progress lines
CALL_S = 60.0  # a quick controller call (its progress-line count)
CONNECT_TIMEOUT_S = 10.0  # ray.init to a live cluster, once its GCS port accepts connections


class Unreachable(ConnectionError):
    """No Ray cluster can be reached; str() is the one line to show (what was tried, from
    where, and what to do)."""


class NoController(LookupError):
    """The Ray cluster runs no Baton controller."""


class ControllerSide(Protocol):
    """What a deploy command needs of the cluster layer; every method runs in a process
    connected to Ray."""

    namespace: str  # Baton's Ray namespace: the controller's and every named actor's

    def controller_handle(self, create: bool) -> Any:
        """The controller actor (created, detached, when `create`); NoController if there is
        none and `create` is False."""
        ...

    def node_resources(self) -> list[dict[str, float]]:
        """The total resources of every live node."""
        ...

    def remove_everything(self) -> list[str]:
        """Kill every named actor in the namespace, remove Baton's placement groups and the
        controller's saved state; what was removed."""
        ...

    def short_error(self, exc: BaseException) -> str:
        """One line for an exception, out of Ray's wrappers (no remote traceback)."""
        ...


class DeployClient:
    """A deploy command's way to the controller: connect() first, then the other calls.
    `load_side` is called once, after connect() found a live Ray cluster."""

    def __init__(self, load_side: Callable[[], ControllerSide]) -> None:
        self._load_side = load_side
        self._side: ControllerSide | None = None

    @property
    def side(self) -> ControllerSide:
        """The cluster layer's part, loaded on first use."""
        if self._side is None:
            self._side = self._load_side()
        return self._side

    def connect(self, address: str | None) -> None:
        """Connect this process to the Ray cluster that `address` names (else $RAY_ADDRESS,
        else the ray_current_cluster file); raises Unreachable within seconds when nothing
        answers there. A process already connected (an in-process caller) stays as it is."""
        loaded = sys.modules.get("ray")
        if loaded is not None and loaded.is_initialized():
            return
        try:
            target = ray_address.resolve(address)
        except ray_address.NoAddress as exc:
            raise Unreachable(f"{exc}; {WHAT_TO_DO}") from None
        from_file = target.source not in ("--address", "$RAY_ADDRESS")
        origin = f"the ray_current_cluster file {target.source}" if from_file else target.source
        where = f"cannot connect to a Ray cluster at {target.address!r} (from {origin})"
        why = ray_address.probe(target.address)
        if why is not None:
            stale = " (the file is stale: that cluster is gone)" if from_file else ""
            raise Unreachable(f"{where}: {why}{stale}; {WHAT_TO_DO}")
        why = _ray_init(target.address, self.side, CONNECT_TIMEOUT_S)
        if why is not None:
            raise Unreachable(f"{where}: {why}; {WHAT_TO_DO}")

    def resources(self) -> tuple[dict[str, float], list[dict[str, float]]]:
        """The connected cluster's total resources, and each live node's."""
        import ray

        return ray.cluster_resources(), self.side.node_resources()

    def controller(self, create: bool = False) -> ControllerClient:
        """The cluster's controller (created, detached, when `create`); NoController if there
        is none and `create` is False."""
        return ControllerClient(self.side.controller_handle(create))

    def remove_leftovers(self) -> list[str]:
        """Kill every named actor in Baton's namespace, remove every Baton placement group and
        the controller's saved state; returns what was removed (empty after a clean
        shutdown)."""
        return self.side.remove_everything()

    def baton_actors(self) -> list[str]:
        """Names of the live named actors in Baton's namespace."""
        return baton_actors(self.side.namespace)

    def short_error(self, exc: BaseException) -> str:
        """One line for an exception, out of Ray's wrappers (no remote traceback)."""
        return self.side.short_error(exc)


def baton_actors(namespace: str) -> list[str]:
    """Names of the live named actors in `namespace`."""
    import ray

    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == namespace
    )


def _ray_init(address: str, side: ControllerSide, timeout: float) -> str | None:
    """`ray.init(address)` with none of Ray's output on the terminal: None once connected,
    else one line saying why not. Ray retries an address that accepts connections but is no
    live GCS for minutes; after `timeout` the attempt is left to its daemon thread (the
    command exits at once after that)."""
    import ray

    outcome: list[Exception | None] = []

    def init() -> None:
        try:
            ray.init(
                address=address,
                namespace=side.namespace,
                log_to_driver=False,
                configure_logging=False,
                logging_level=logging.ERROR,
            )
            outcome.append(None)
        except Exception as exc:  # noqa: BLE001 - reported as one line
            outcome.append(exc)

    # Ray's Python loggers, and its C++ core worker, which writes to file descriptor 2.
    logging.getLogger("ray").setLevel(logging.ERROR)
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    thread = threading.Thread(target=init, name="ray-init", daemon=True)
    thread.start()
    try:
        thread.join(timeout)
    except BaseException:  # Ctrl-C: the terminal gets its stderr back
        os.dup2(saved, 2)
        raise
    finally:
        os.close(devnull)
    if not outcome:
        # Ray's thread goes on writing to descriptor 2 until the command exits: leave that
        # muted and give Python's own stderr the terminal back.
        sys.stderr = os.fdopen(saved, "w", buffering=1)
        return f"no Ray cluster answered there within {timeout:g} s"
    os.dup2(saved, 2)
    os.close(saved)
    return None if outcome[0] is None else side.short_error(outcome[0])


class ControllerClient:
    """Calls on the controller actor from a connected process. A method the actor raises in
    comes back as Ray's wrapper of it (its `cause` is the actor's exception)."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    def call(self, method: str, *args: Any, timeout: float) -> Any:
        """Run a controller method and return its result."""
        import ray

        return ray.get(getattr(self._handle, method).remote(*args), timeout=timeout)

    def follow(
        self, method: str, *args: Any, on_event: Callable[[str], None], limit_s: float
    ) -> Any:
        """Run a long method (apply, scale) and return its result, passing each progress line
        the controller logs meanwhile to on_event. TimeoutError after limit_s (the controller
        goes on)."""
        import ray

        shown = self.call("num_events", timeout=CALL_S)
        ref = getattr(self._handle, method).remote(*args)
        start = time.monotonic()
        while True:
            ready, _ = ray.wait([ref], timeout=EVENTS_POLL_S)
            for line in ray.get(self._handle.events.remote(shown)):
                shown += 1
                on_event(line)
            if ready:
                return ray.get(ref)
            if time.monotonic() - start > limit_s:
                raise TimeoutError(
                    f"still reconciling after {limit_s:.0f} s; `baton deploy status` shows "
                    "where it is"
                )

    def kill(self) -> None:
        """Kill the controller for good (no restart). It owns nothing: the workers, their
        placement groups and the router stay until removed (remove_leftovers)."""
        import ray

        ray.kill(self._handle, no_restart=True)
