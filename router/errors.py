"""One mapping from the exceptions a request can raise to what each front door reports.

Both doors (gRPC in router/server.py, OpenAI-compatible HTTP in router/openai_http.py) ask
`classify(exc)` and use the field they need: a gRPC status code, or an HTTP status with
OpenAI's error `type` and `code`. Exceptions from a worker over RPC arrive as
kvtransfer.control.RemoteError whose `kind` is the original class name; they map like the
original class.
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

# Most specific first: a subclass must come before its base class.
_KINDS: tuple[tuple[type[BaseException], ErrorKind], ...] = (
    (Unauthenticated, UNAUTHENTICATED),
    (AdmissionRefused, BUSY),
    (UnknownModel, NOT_FOUND),
    (PromptTooLongError, TOO_LONG),
    (InvalidRequestError, INVALID),
    (NoFreeBlocksError, BUSY),  # fits, but not now, after the router's wait
    (CapacityError, NEVER_FITS),  # no decode worker's KV cache can ever hold the prompt
    (NoWorkerAvailable, UNAVAILABLE),
    (MigrationLimitExceeded, UNAVAILABLE),  # its workers kept failing; the message names them
)


def classify(exc: BaseException) -> ErrorKind:
    """The ErrorKind of `exc` (INTERNAL for anything not listed)."""
    for cls, kind in _KINDS:
        if isinstance(exc, cls):
            return kind
    remote = getattr(exc, "kind", None)  # RemoteError: the original exception's class name
    if isinstance(remote, str):
        for cls, kind in _KINDS:
            if cls.__name__ == remote:
                return kind
    return INTERNAL


def is_known(exc: BaseException) -> bool:
    """Whether `exc` is a failure a user can act on (its message goes to the client)."""
    return classify(exc) is not INTERNAL or isinstance(exc, RequestFailed)


def grpc_status(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status code a front door aborts with for `exc`."""
    return classify(exc).grpc_code
