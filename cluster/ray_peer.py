"""RayPeer: a Ray actor handle as a worker transport (kvtransfer.worker_client.Transport).

Callers use it through the typed clients: `prefill_client(handle)` / `decode_client(handle)`.
A worker given a bare RayPeer as its peer wraps it the same way (worker_client.as_worker).
"""

from __future__ import annotations

from typing import Any

import ray

from kvtransfer.worker_api import is_contract_error
from kvtransfer.worker_client import DecodeClient, PrefillClient


class RayPeer:
    """call(method, *args) runs handle.method.remote(*args) and waits up to `timeout` seconds.

    Picklable (it carries only the handle), so it can be passed to other actors.
    """

    def __init__(self, handle: Any, timeout: float = 120.0) -> None:
        self._handle = handle
        self._timeout = timeout

    @property
    def handle(self) -> Any:
        return self._handle

    def call(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """The actor method's return value (waiting up to `timeout` seconds, default the
        peer's); contract errors are raised as themselves."""
        remote = getattr(self._handle, method)
        wait = self._timeout if timeout is None else timeout
        try:
            return ray.get(remote.remote(*args, **kwargs), timeout=wait)
        except ray.exceptions.RayTaskError as exc:
            # The contract's errors (bad input, no room, a failed transfer) come back as
            # themselves: their message is for the client, Ray's remote traceback is not.
            if is_contract_error(exc.cause):
                raise exc.cause from None
            raise

    def __reduce__(self):
        return RayPeer, (self._handle, self._timeout)


def prefill_client(handle: Any, timeout: float = 120.0) -> PrefillClient:
    """The typed client of a prefill worker actor."""
    return PrefillClient(RayPeer(handle, timeout))


def decode_client(handle: Any, timeout: float = 120.0) -> DecodeClient:
    """The typed client of a decode worker actor."""
    return DecodeClient(RayPeer(handle, timeout))
