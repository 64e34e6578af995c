"""Run an ASGI app with uvicorn on the current asyncio loop, beside grpc.aio.

uvicorn serves as a task of the caller's loop (the router actor's), so both front doors
share one loop and one Router. It never installs signal handlers: the process's owner
(Ray, pytest, `baton serve`) handles signals.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import uvicorn

from router.security import TLSFiles, uvicorn_ssl_options


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield


class HttpServer:
    """A running uvicorn server; stop() ends it."""

    def __init__(self, server: uvicorn.Server, task: asyncio.Task, sock: socket.socket) -> None:
        self._server = server
        self._task = task
        self._sock = sock

    async def stop(self, grace: float = 5.0) -> None:
        """Stop accepting, give open requests `grace` seconds, then cancel them (a cancelled
        request is aborted on its workers) and close their connections."""
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), grace)
        except TimeoutError:
            self._server.force_exit = True
            await self._task
        finally:
            self._sock.close()
        state = self._server.server_state
        tasks = list(state.tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=grace)
        for connection in list(state.connections):
            transport = getattr(connection, "transport", None)
            if transport is not None:
                transport.close()


async def start_http_server(
    app, host: str = "127.0.0.1", port: int = 8000, tls: TLSFiles | None = None
) -> tuple[HttpServer, int]:
    """Serve `app` on host:port (TLS when given) as a task of the running loop; returns
    (server, bound port). Port 0 picks a free one; raises OSError when it cannot listen."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted connections only for TCP
    # sockets, and without it a response written as headers then body waits ~40 ms for the
    # client's delayed ACK (measured by benchmarks/front_doors.py on short SSE streams).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc}") from exc
    sock.set_inheritable(True)
    config = uvicorn.Config(
        app,
        loop="none",
        lifespan="off",
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=None,
        **uvicorn_ssl_options(tls),
    )
    try:
        config.load()  # bad TLS files raise here, not inside the task
    except Exception:
        sock.close()
        raise
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name=f"http:{host}:{port}")
    while not server.started:
        if task.done():  # failed to start (bad TLS files, ...): report why
            sock.close()
            task.result()
            raise OSError(f"HTTP server on {host}:{port} stopped while starting")
        await asyncio.sleep(0.01)
    return HttpServer(server, task, sock), sock.getsockname()[1]
