"""Async iteration over one Router.generate stream, for a front door on an asyncio loop.

Each next() runs in a thread pool (Router calls block), so the loop never waits on a worker.
close() is safe from any path (done, error, client gone): a request that did not finish is
aborted on both workers, also when it registered with the router only after the client left,
and the generator is closed once no thread is inside it.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor, Future

from router.router import Router
from router.sessions import SessionHint

logger = logging.getLogger(__name__)
_DONE = object()
_background: set[asyncio.Task] = set()  # cleanups in flight (a task needs a reference)


class TokenStream:
    """Router.generate(request_id, ...) as awaitable outputs; None when it ends (the output
    with finished=True is the request's last: with n > 1, every choice is done)."""

    def __init__(
        self,
        router: Router,
        executor: Executor,
        request_id: str,
        prompt_token_ids: list[int],
        params: dict,
        cache_salt: str | None,
        session: SessionHint | None = None,
    ) -> None:
        self.router = router
        self.request_id = request_id
        self.finished = False
        self._executor = executor
        self._outputs = router.generate(request_id, prompt_token_ids, params, cache_salt, session)
        self._pending: Future | None = None
        self._closed = False

    async def next(self) -> dict | None:
        """The next output dict, None after the last; exceptions of the router propagate."""
        if self.finished:
            return None
        self._pending = self._executor.submit(next, self._outputs, _DONE)
        out = await asyncio.wrap_future(self._pending)
        if out is _DONE:
            self.finished = True
            return None
        if out["finished"]:
            self.finished = True
        return out

    def close(self) -> None:
        """Abort the request if it did not finish and close the generator, in a task of its
        own (so that a cancelled caller cannot interrupt the cleanup)."""
        if self._closed:
            return
        self._closed = True
        task = asyncio.get_running_loop().create_task(self._cleanup())
        _background.add(task)
        task.add_done_callback(_background.discard)

    async def _cleanup(self) -> None:
        loop = asyncio.get_running_loop()

        def run(fn, *args):
            return loop.run_in_executor(self._executor, fn, *args)

        try:
            if not self.finished:
                await run(self.router.abort, self.request_id)
            pending = self._pending
            if pending is not None and not pending.done():
                # A thread is inside the generator (choosing workers or polling): wait for it,
                # then abort again in case the request registered meanwhile.
                await asyncio.wait([asyncio.wrap_future(pending)])
                if not self.finished:
                    await run(self.router.abort, self.request_id)
            await run(self._outputs.close)
        except Exception:  # noqa: BLE001 - the client is gone; nothing to report it to
            logger.exception("cleanup of request %s failed", self.request_id)


async def merged(streams: list[TokenStream], firsts: list[dict | None]):
    """(position in `streams`, output) of several streams as each output arrives, starting
    with `firsts` (each stream's first output, already taken); ends when all have ended."""
    for i, out in enumerate(firsts):
        if out is not None:
            yield i, out
    pending = {asyncio.ensure_future(s.next()): i for i, s in enumerate(streams) if not s.finished}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                i = pending.pop(task)
                out = task.result()
                if out is None:
                    continue
                yield i, out
                if not streams[i].finished:
                    pending[asyncio.ensure_future(streams[i].next())] = i
    finally:
        for task in pending:
            task.cancel()
