"""Which Ray cluster a `baton deploy` command means, and whether anything answers there.

Resolved the way Ray's `ray.init(address="auto")` does, but without Ray, so that a cluster
that is gone is reported at once instead of after Ray's own minutes of retries:

1. `--address` (unless "auto"),
2. else `$RAY_ADDRESS` (unless empty or "auto"),
3. else the `ray_current_cluster` file that `ray start --head` writes into Ray's temp dir:
   `$RAY_TMPDIR/ray`, else `$TMPDIR/ray`, else `/tmp/ray` (Ray's own rule; tests point
   `RAY_TMPDIR` at a temporary directory so as never to read a user's `/tmp/ray`).

probe() then opens a plain TCP connection to the GCS port: a cluster whose head was killed
(its file left behind) or an address nobody listens on is refused within PROBE_TIMEOUT_S.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

PROBE_TIMEOUT_S = 3.0  # a live GCS accepts a TCP connection well within this
RAY_CLIENT_PREFIX = "ray://"


@dataclass(frozen=True, slots=True)
class RayAddress:
    """A Ray cluster address and where it came from, for messages."""

    address: str  # host:port, or ray://host:port (Ray Client)
    source: str  # "--address", "$RAY_ADDRESS" or the path of the ray_current_cluster file


class NoAddress(LookupError):
    """Neither --address, $RAY_ADDRESS nor a ray_current_cluster file names a cluster."""


def ray_address_file() -> Path:
    """Where `ray start --head` records the cluster this machine's commands connect to."""
    tmp = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    return Path(tmp) / "ray" / "ray_current_cluster"


def resolve(flag: str | None) -> RayAddress:
    """The address a command connects to (order in the module docstring); NoAddress says
    what was looked at when none names one."""
    if flag and flag != "auto":
        return RayAddress(flag, "--address")
    env = os.environ.get("RAY_ADDRESS", "")
    if env and env != "auto":
        return RayAddress(env, "$RAY_ADDRESS")
    path = ray_address_file()
    try:
        recorded = path.read_text().strip()
    except OSError:
        recorded = ""
    if recorded:
        return RayAddress(recorded, str(path))
    raise NoAddress(
        f"no Ray cluster to connect to: no --address, no $RAY_ADDRESS and no {path} "
        "(which `ray start --head` writes)"
    )


def host_port(address: str) -> tuple[str, int] | None:
    """("host", port) of "host:port" or "ray://host:port"; None when it is neither."""
    host, sep, port = address.removeprefix(RAY_CLIENT_PREFIX).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host.strip("[]"), int(port)  # [::1]:6379 -> ::1


def probe(address: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """None when something accepts a TCP connection at the address, else why not."""
    parsed = host_port(address)
    if parsed is None:
        return "not a HOST:PORT address"
    try:
        with socket.create_connection(parsed, timeout=timeout):
            return None
    except TimeoutError:
        return f"no answer within {timeout:g} s"
    except OSError as exc:  # refused, unknown host, unreachable network
        return exc.strerror or str(exc)
