"""RayPeer: a Ray actor handle with synchronous method calls, as the workers' control peers."""

from __future__ import annotations

from typing import Any

import ray

from engine.errors import EngineError


class RayPeer:
    """peer.method(*args) runs handle.method.remote(*args) and waits up to `timeout` seconds.

    Picklable (it carries only the handle), so it can be passed to other actors.
    """

    def __init__(self, handle: Any, timeout: float = 120.0) -> None:
        self._handle = handle
        self._timeout = timeout

    @property
    def handle(self) -> Any:
        return self._handle

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)
        remote = getattr(self._handle, method)

        def call(*args, **kwargs):
            try:
                return ray.get(remote.remote(*args, **kwargs), timeout=self._timeout)
            except ray.exceptions.RayTaskError as exc:
                # The engine's own errors (bad input, no room) come back as themselves: their
                # message is for the client, Ray's remote traceback is not.
                if isinstance(exc.cause, EngineError):
                    raise exc.cause from None
                raise

        return call

    def __reduce__(self):
        return RayPeer, (self._handle, self._timeout)
