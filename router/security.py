"""API keys and TLS for both front doors.

Keys come from the command line, an environment variable or a file (never the manifest's
YAML itself). HTTP sends `Authorization: Bearer <key>`, gRPC the `authorization` metadata
with the same value; health checks (HTTP /health, grpc.health.v1) stay open. Keys are
compared in constant time and every refusal is counted (`ApiKeys.num_refused`, which the
metrics module reads). TLS for both doors comes from PEM cert/key files, with optional
verification of client certificates against a CA file.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import ssl
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from router.errors import Unauthenticated, grpc_labels, grpc_status

if TYPE_CHECKING:
    from router.metrics import RouterMetrics

logger = logging.getLogger(__name__)

OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/",)  # health probes need no key


def load_api_keys(
    keys: Iterable[str] = (), env_var: str | None = None, file: str | Path | None = None
) -> list[str]:
    """Keys given directly, in environment variable `env_var` (comma-separated) and in
    `file` (one per line; blank lines and # comments skipped). Raises ValueError when a
    named source is missing or empty."""
    out = [k.strip() for k in keys if k.strip()]
    if env_var is not None:
        value = os.environ.get(env_var, "")
        found = [k.strip() for k in value.split(",") if k.strip()]
        if not found:
            raise ValueError(f"api key environment variable {env_var} is unset or empty")
        out += found
    if file is not None:
        path = Path(file)
        if not path.is_file():
            raise ValueError(f"api key file {path} does not exist")
        lines = [line.strip() for line in path.read_text().splitlines()]
        found = [line for line in lines if line and not line.startswith("#")]
        if not found:
            raise ValueError(f"api key file {path} holds no key")
        out += found
    if any(any(c.isspace() for c in k) for k in out):
        raise ValueError("an api key contains whitespace")
    return out


class ApiKeys:
    """The accepted keys; check() compares in constant time and counts refusals."""

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._keys = [k.encode() for k in keys]
        self.num_refused = 0  # missing or wrong key, both doors together

    @property
    def enabled(self) -> bool:
        """False when no key is configured: every request is let in."""
        return bool(self._keys)

    def check(self, authorization: str | None) -> bool:
        """Whether an `authorization` value ("Bearer <key>") carries an accepted key."""
        if not self._keys:
            return True
        presented = (authorization or "").strip()
        if presented[:7].lower() == "bearer ":
            presented = presented[7:].strip()
        given = presented.encode()
        ok = False
        for key in self._keys:  # every key is compared: the time does not say which matched
            ok |= hmac.compare_digest(given, key)
        if not ok:
            self.num_refused += 1
        return ok


class GrpcKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every RPC but the health service without an accepted `authorization` key;
    with `metrics` (router.metrics.RouterMetrics), each refusal is a request error."""

    def __init__(self, keys: ApiKeys, metrics: RouterMetrics | None = None) -> None:
        self.keys = keys
        self.metrics = metrics

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or method.startswith(OPEN_GRPC_PREFIXES):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        if self.keys.check(metadata.get("authorization")):
            return handler
        return _denying(handler, self.metrics)


def _denying(
    handler: grpc.RpcMethodHandler, metrics: RouterMetrics | None
) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that aborts with UNAUTHENTICATED."""

    async def deny(request, context):
        refused = Unauthenticated(
            "missing or invalid API key (metadata 'authorization: Bearer <key>')"
        )
        if metrics is not None:
            metrics.request_error("grpc", *grpc_labels(refused))
        await context.abort(grpc_status(refused), str(refused))

    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(bool(handler.request_streaming), bool(handler.response_streaming))]
    return make(
        deny,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


@dataclass(frozen=True, slots=True)
class TLSFiles:
    """PEM files for a TLS front door; with client_ca_file, clients must present a
    certificate signed by that CA (mutual TLS)."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    def __post_init__(self) -> None:
        for name in ("cert_file", "key_file", "client_ca_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"tls {name} {path} does not exist")


def grpc_server_credentials(tls: TLSFiles) -> grpc.ServerCredentials:
    """Server credentials for grpc.aio: server.add_secure_port(address, these)."""
    ca = Path(tls.client_ca_file).read_bytes() if tls.client_ca_file else None
    return grpc.ssl_server_credentials(
        [(Path(tls.key_file).read_bytes(), Path(tls.cert_file).read_bytes())],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )


def add_port(server: grpc.aio.Server, address: str, tls: TLSFiles | None) -> int:
    """Listen on `address` (TLS when given); returns the bound port, raises OSError."""
    if tls is None:
        bound = server.add_insecure_port(address)
    else:
        bound = server.add_secure_port(address, grpc_server_credentials(tls))
    if bound == 0:
        raise OSError(f"cannot listen on {address}")
    return bound


def uvicorn_ssl_options(tls: TLSFiles | None) -> dict:
    """uvicorn.Config keyword arguments for TLS ({} for plain HTTP)."""
    if tls is None:
        return {}
    options: dict[str, object] = {"ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file}
    if tls.client_ca_file:
        options.update(ssl_ca_certs=tls.client_ca_file, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return options


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname or "" (all interfaces)


def warn_if_exposed(door: str, host: str, keys: ApiKeys) -> str | None:
    """Log (and return) a warning when `door` listens beyond loopback without an API key."""
    if keys.enabled or is_loopback(host):
        return None
    message = (
        f"the {door} front door listens on {host!r} without an API key: anyone who can reach "
        "this address can run requests on the cluster's workers and read their output. Set "
        "--api-key (or spec.router.api_key_env / api_key_file), or listen on 127.0.0.1."
    )
    logger.warning(message)
    return message
