"""IOThread: one daemon thread that runs a function over queued items, oldest first.

A tier has two: the writer (bounded: submit() refuses when `depth` items wait, so the engine
step never waits for a store) and the loader (unbounded: a load is never dropped). Pausing
stops the thread from taking further items (the one it is running finishes), which makes
"the queue is full" reproducible in tests without timing.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class IOThread(Generic[T]):
    """Runs `work(item)` on its own thread for each submitted item, in submission order."""

    def __init__(self, work: Callable[[T], None], name: str, depth: int | None = None) -> None:
        if depth is not None and depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._work = work
        self.depth = depth  # most items waiting (the running one not counted); None: no bound
        self._cond = threading.Condition()
        self._queue: deque[T] = deque()
        self._busy = False
        self._paused = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def has_room(self) -> bool:
        """Whether submit() would accept an item now."""
        with self._cond:
            return not self._closed and (self.depth is None or len(self._queue) < self.depth)

    def submit(self, item: T) -> bool:
        """Queue an item; False (item not queued) when full or closed. Never blocks."""
        with self._cond:
            if self._closed or (self.depth is not None and len(self._queue) >= self.depth):
                return False
            self._queue.append(item)
            self._cond.notify_all()
            return True

    def discard(self, item: T) -> bool:
        """Take a queued item back before it runs; False if it is running, done or unknown."""
        with self._cond:
            for i, queued in enumerate(self._queue):
                if queued is item:
                    del self._queue[i]
                    self._cond.notify_all()
                    return True
            return False

    def pending(self) -> int:
        """Items queued or running."""
        with self._cond:
            return len(self._queue) + int(self._busy)

    def pause(self) -> None:
        """Take no further items until resume() (the running one, if any, completes)."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted item has run; False on timeout (e.g. while paused)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Run what is queued (resuming a paused thread), then stop the thread."""
        with self._cond:
            self._closed = True
            self._paused = False
            self._cond.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or (self._queue and not self._paused))
                if not self._queue:
                    return  # closed and drained
                item = self._queue.popleft()
                self._busy = True
            try:
                self._work(item)
            except Exception:  # a failed item must not stop the thread; work() counts its own
                logger.exception("%s: an item failed", self._thread.name)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
