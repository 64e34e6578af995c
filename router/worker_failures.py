"""What counts as "a worker failed" (the request moves to another worker) rather than "the
request is invalid" (the client gets the error), and the exceptions that say which.

A worker failed when it cannot be reached or died during a call (PeerUnavailable, any
ConnectionError or EOFError), did not answer a call within its transport's timeout
(TimeoutError, Ray's GetTimeoutError), its actor died (Ray's RayActorError family), the KV
pair with it broke (PeerLost, TransferTimeout), or, for a prefill worker, its KV never reached
the decode worker (kv_never_arrived). Everything else, engine errors included
(InvalidRequestError, CapacityError, NoFreeBlocksError, ...), is the request's own outcome.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from kvtransfer.errors import PeerLost, TransferTimeout

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Ray's exceptions by class name (the router does not import ray): a dead or unreachable actor.
_RAY_WORKER_FAILURES = frozenset(
    {
        "RayActorError",
        "ActorDiedError",
        "ActorUnavailableError",
        "WorkerCrashedError",
        "NodeDiedError",
        "GetTimeoutError",
    }
)


class WorkerFailed(Exception):
    """A worker failed under a request (died, hung, or its KV never arrived): it may move."""

    def __init__(self, worker_id: str, reason: str) -> None:
        super().__init__(f"worker {worker_id} failed: {reason}")
        self.worker_id = worker_id
        self.reason = reason


class PairNotReady(Exception):
    """The prefill worker has no pair group with the chosen decode worker (UnknownPeer): one of
    them was restarted and the controller has not paired them again yet. Nothing was prefilled
    or streamed, so this is no migration: the request waits until the controller's next health
    report (sent after it re-paired restarted workers) marks both healthy, then goes again."""

    def __init__(self, prefill_id: str, decode_id: str, reason: str) -> None:
        super().__init__(f"workers {prefill_id} and {decode_id} are not paired: {reason}")
        self.prefill_id = prefill_id
        self.decode_id = decode_id


class MigrationLimitExceeded(RuntimeError):
    """A request's workers failed more often than migration_limit allows (UNAVAILABLE / 503)."""


def is_worker_failure(exc: BaseException) -> bool:
    """True if `exc` from a worker call means the worker failed, not the request."""
    if isinstance(exc, ConnectionError | EOFError | TimeoutError | PeerLost | TransferTimeout):
        return True
    return any(cls.__name__ in _RAY_WORKER_FAILURES for cls in type(exc).__mro__)


def kv_never_arrived(out: dict, prefill_id: str) -> bool:
    """Whether the decode worker failed the request before its first token because the KV
    from prefill_id broke or did not come within the lease (its error names that worker)."""
    return (
        out["finish_reason"] == "error"
        and not out["token_ids"]
        and f"prefill worker {prefill_id}" in (out["error"] or "")
    )


def ask(worker_id: str, what: str, call: Callable[[], T]) -> T | None:
    """call(), or None when the worker does not answer (restarting or dead: it is skipped
    for this request and asked again by the next); `what` names the call in the log."""
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - logged; the caller treats None as no answer
        logger.warning("%s of %s: %s", what, worker_id, exc)
        return None
