"""One mapping from the exceptions a request can raise to what each front door reports.

Both doors (gRPC in router/server.py, OpenAI-compatible HTTP in router/openai_http.py) ask
`classify(exc)` and use the field they need: a gRPC status code, or an HTTP status with
OpenAI's error `type` and `code`, and count the refusal by its `error_reason`. Exceptions
from a worker over RPC arrive as kvtransfer.control.RemoteError whose `kind` is the original
class name; they map like the original class.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from engine.errors import CapacityError, InvalidRequestError, NoFreeBlocksError, PromptTooLongError
from router.policy import NoWorkerAvailable
from router.worker_failures import MigrationLimitExceeded


class Unauthenticated(Exception):
    """The request carries no API key, or one the server does not know."""


class AdmissionRefused(Exception):
    """Too many requests are already waiting at the router (max_pending_requests)."""


class UnknownModel(InvalidRequestError):
    """The request names a model this server does not serve."""


class RequestFailed(RuntimeError):
    """A worker reported the request as failed (finish_reason "error")."""


@dataclass(frozen=True, slots=True)
class ErrorKind:
    """How one kind of failure is reported: gRPC status, HTTP status, OpenAI type and code."""

    grpc_code: grpc.StatusCode
    http_status: int
    openai_type: str
    openai_code: str | None = None


INVALID = ErrorKind(grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error")
TOO_LONG = ErrorKind(
    grpc.StatusCode.OUT_OF_RANGE, 400, "invalid_request_error", "context_length_exceeded"
)
NEVER_FITS = ErrorKind(
    grpc.StatusCode.RESOURCE_EXHAUSTED, 400, "invalid_request_error", "kv_capacity_exceeded"
)
BUSY = ErrorKind(grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error", "server_busy")
UNAUTHENTICATED = ErrorKind(
    grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error", "invalid_api_key"
)
NOT_FOUND = ErrorKind(grpc.StatusCode.NOT_FOUND, 404, "invalid_request_error", "model_not_found")
UNAVAILABLE = ErrorKind(grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable_error")
INTERNAL = ErrorKind(grpc.StatusCode.INTERNAL, 500, "server_error")

# Most specific first: a subclass must come before its base class. The reason is the
# `reason` label of baton:request_errors_total (router/metrics.py): short and stable, since
# dashboards and alerts select on it.
_KINDS: tuple[tuple[type[BaseException], ErrorKind, str], ...] = (
    (Unauthenticated, UNAUTHENTICATED, "unauthenticated"),
    (AdmissionRefused, BUSY, "overloaded"),
    (UnknownModel, NOT_FOUND, "model_not_found"),
    (PromptTooLongError, TOO_LONG, "prompt_too_long"),
    (InvalidRequestError, INVALID, "invalid_request"),
    (NoFreeBlocksError, BUSY, "no_free_kv_blocks"),  # fits, but not now, after the wait
    # no decode worker's KV cache can ever hold the prompt
    (CapacityError, NEVER_FITS, "kv_capacity_exceeded"),
    (NoWorkerAvailable, UNAVAILABLE, "no_worker"),
    (MigrationLimitExceeded, UNAVAILABLE, "worker_failed"),  # the message names the workers
    (RequestFailed, INTERNAL, "request_failed"),  # a worker reported finish_reason "error"
)
INTERNAL_REASON = "internal"  # anything not listed: a bug, logged with its traceback


def _match(exc: BaseException) -> tuple[ErrorKind, str]:
    for cls, kind, reason in _KINDS:
        if isinstance(exc, cls):
            return kind, reason
    remote = getattr(exc, "kind", None)  # RemoteError: the original exception's class name
    if isinstance(remote, str):
        for cls, kind, reason in _KINDS:
            if cls.__name__ == remote:
                return kind, reason
    return INTERNAL, INTERNAL_REASON


def classify(exc: BaseException) -> ErrorKind:
    """The ErrorKind of `exc` (INTERNAL for anything not listed)."""
    return _match(exc)[0]


def error_reason(exc: BaseException) -> str:
    """The short stable reason of `exc` (the request_errors metric's `reason` label)."""
    return _match(exc)[1]


def grpc_labels(exc: BaseException) -> tuple[str, str]:
    """(gRPC code name, reason) of `exc`: the request_errors labels of the gRPC door."""
    kind, reason = _match(exc)
    return kind.grpc_code.name, reason


def is_known(exc: BaseException) -> bool:
    """Whether `exc` is a failure a user can act on (its message goes to the client)."""
    return classify(exc) is not INTERNAL or isinstance(exc, RequestFailed)


def grpc_status(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status code a front door aborts with for `exc`."""
    return classify(exc).grpc_code
