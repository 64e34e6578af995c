"""The event loop: a heap of (time, sequence, callback, args); ties run in scheduling order."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class EventLoop:
    """Simulated time; `at` schedules a callback, `run` executes callbacks in time order."""

    def __init__(self) -> None:
        self.now = 0.0
        self.processed = 0
        self._heap: list[tuple[float, int, Callable, tuple]] = []
        self._seq = itertools.count()

    def at(self, t: float, callback: Callable, *args) -> None:
        """Run callback(*args) at time t (never before now)."""
        heapq.heappush(self._heap, (max(t, self.now), next(self._seq), callback, args))

    def run(self) -> None:
        """Until no event is left."""
        heap, pop = self._heap, heapq.heappop
        while heap:
            t, _, callback, args = pop(heap)
            self.now = t
            callback(*args)
            self.processed += 1
