"""A small RPC channel for control messages between worker processes (not for tensors).

Server: exposes the public methods of one object on 127.0.0.1:<free port>. Client: calls
them with a per-call timeout; each concurrent call uses its own pooled connection, so a
long call (a prefill) does not block short ones. A remote error arrives as itself when its
type is in the worker contract's registry (kvtransfer.worker_api.ERRORS), else as RemoteError
carrying its type name and message; never as a hang: a dead server raises PeerUnavailable.
Callers use it through kvtransfer.worker_client's typed clients. Under Ray,
cluster.ray_peer.RayPeer replaces this channel.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from kvtransfer.worker_api import remote_error

logger = logging.getLogger(__name__)


class RemoteError(RuntimeError):
    """The remote method raised an error outside the contract; `kind` is its class name."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


class PeerUnavailable(ConnectionError):
    """The peer process cannot be reached or died during the call."""


class RpcServer:
    """Serves `target`'s public methods until close()."""

    def __init__(self, target: Any, host: str = "127.0.0.1", authkey: bytes | None = None):
        self.target = target
        self.authkey = authkey or secrets.token_bytes(16)
        self._listener = Listener((host, 0), authkey=self.authkey)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="rpc-accept", daemon=True)
        self._thread.start()

    @property
    def address(self) -> dict:
        """What a client needs to connect (msgpack/pickle friendly)."""
        host, port = self._listener.address
        return {"host": host, "port": port, "authkey": self.authkey.hex(), "pid": os.getpid()}

    def close(self) -> None:
        self._closed.set()
        try:
            self._listener.close()
        except OSError:
            pass

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn = self._listener.accept()
            except (OSError, EOFError):
                if self._closed.is_set():
                    return
                continue
            except Exception:  # noqa: BLE001 - bad handshake from a stray client
                continue
            threading.Thread(
                target=self._serve, args=(conn,), daemon=True, name="rpc-serve"
            ).start()

    def _serve(self, conn: Connection) -> None:
        with conn:
            while not self._closed.is_set():
                try:
                    method, args, kwargs = conn.recv()
                except (EOFError, OSError):
                    return
                result: tuple[Any, ...]
                try:
                    if method.startswith("_"):
                        raise AttributeError(f"{method} is not a public method")
                    result = ("ok", getattr(self.target, method)(*args, **kwargs))
                except Exception as exc:  # noqa: BLE001 - returned to the caller
                    result = ("err", type(exc).__name__, str(exc))
                try:
                    conn.send(result)
                except (OSError, EOFError):
                    return


class RpcClient:
    """Calls a remote RpcServer's methods: client.call("name", *args, timeout=...) (a
    worker_client.Transport)."""

    def __init__(self, address: dict, default_timeout: float = 60.0) -> None:
        self.address = dict(address)
        self.default_timeout = default_timeout
        self._idle: list[Connection] = []
        self._lock = threading.Lock()

    def call(self, method: str, *args, timeout: float | None = None, **kwargs) -> Any:
        timeout = self.default_timeout if timeout is None else timeout
        conn = self._checkout()
        try:
            conn.send((method, args, kwargs))
            if not conn.poll(timeout):
                conn.close()
                raise TimeoutError(f"{method} got no answer within {timeout:.1f}s")
            reply = conn.recv()
        except (EOFError, OSError) as exc:
            conn.close()
            raise PeerUnavailable(
                f"peer at {self.address['host']}:{self.address['port']} "
                f"is unreachable ({exc.__class__.__name__})"
            ) from exc
        self._checkin(conn)
        if reply[0] == "ok":
            return reply[1]
        _, kind, message = reply
        raise remote_error(kind, message) or RemoteError(kind, message)

    def close(self) -> None:
        with self._lock:
            for conn in self._idle:
                conn.close()
            self._idle.clear()

    def _checkout(self) -> Connection:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        try:
            return Client(
                (self.address["host"], self.address["port"]),
                authkey=bytes.fromhex(self.address["authkey"]),
            )
        except OSError as exc:
            raise PeerUnavailable(
                f"cannot connect to {self.address['host']}:{self.address['port']}: {exc}"
            ) from exc

    def _checkin(self, conn: Connection) -> None:
        with self._lock:
            self._idle.append(conn)


def serve_until_closed(target: Any, conn: Connection) -> None:
    """Host `target` over RPC in this process: send its address on `conn`, then serve until
    the parent sends anything or closes `conn`; finally call target.shutdown()."""
    server = RpcServer(target)
    conn.send(server.address)
    try:
        conn.recv()
    except (EOFError, OSError):
        pass
    server.close()
    target.shutdown()
