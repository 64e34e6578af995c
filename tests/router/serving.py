"""Test helper: front doors served from an asyncio loop in a background thread, as the
router actor serves them from its own loop."""

from __future__ import annotations

import asyncio
import threading
from contextlib import contextmanager

from router.http_server import start_http_server
from router.security import TLSFiles


class BackgroundLoop:
    """An event loop running in a daemon thread; run() waits for a coroutine's result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@contextmanager
def http_serving(app, tls: TLSFiles | None = None):
    """Serve `app` on a free loopback port; yields (base url, loop)."""
    loop = BackgroundLoop()
    server, port = loop.run(start_http_server(app, "127.0.0.1", 0, tls=tls))
    scheme = "https" if tls else "http"
    try:
        yield f"{scheme}://127.0.0.1:{port}", loop
    finally:
        loop.run(server.stop(grace=1.0))
        loop.close()
