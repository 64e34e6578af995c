"""OutputFeed: one long poll per decode worker carries the outputs of every request a client
streams from it; DecodeClient.poll reads a request's outputs from here.

A poll call per request would cost a call per streaming request per engine step, and hold
one of the worker's call threads (its actor's concurrency) per streaming request while it
waits. The feed's thread runs while some request is read through it: it asks the worker for
the outputs of all of them at once (DecodeAPI.poll_many, which returns as soon as any has
one), puts each output in its request's queue, and stops when no request is left. A request
that starts reading while a poll is in flight wakes it (DecodeAPI.wake_polls, from a thread
of its own: a frozen worker never holds up a reader beyond its timeout), so its first
outputs do not wait out the poll.

A reader belongs to one stream of the worker: DecodeClient.reserve and local_generate reset
the request's reader first (the router retries a request on the same worker under the same
id). What a reader sees is what its own poll calls would have shown: its outputs in order; a
failed poll_many (the worker died, the transport failed) raised to every request being read
at that moment, after the outputs that came before it; a request the worker does not know,
KeyError.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

from kvtransfer.worker_api import TokenOutput

logger = logging.getLogger(__name__)

FEED_WAIT_S = 0.5  # one poll_many's wait when no output comes
READER_TTL_S = 300.0  # a request whose last output nobody read after this is forgotten

PollMany = Callable[[Sequence[str], float], tuple[list[TokenOutput], list[str]]]


class _Reader:
    """One request's outputs (or the error that ended them) waiting for its reader."""

    def __init__(self) -> None:
        self.items: queue.Queue[TokenOutput | BaseException] = queue.Queue()
        self.polled = True  # still asked of the worker (not finished, not failed)
        self.done_at: float | None = None  # when the feed stopped polling it
        self.error: BaseException | None = None  # taken after the outputs before it

    def take(self, timeout: float) -> list[TokenOutput]:
        if self.error is not None:
            raise self.error
        try:
            first = self.items.get(timeout=timeout)
        except queue.Empty:
            return []
        outs: list[TokenOutput] = []
        item: TokenOutput | BaseException | None = first
        while item is not None:
            if isinstance(item, BaseException):
                if not outs:
                    raise item
                self.error = item
                return outs
            outs.append(item)
            try:
                item = self.items.get_nowait()
            except queue.Empty:
                item = None
        return outs


class OutputFeed:
    """poll(request_id, timeout) like DecodeAPI.poll, served by one shared poll_many loop."""

    def __init__(
        self,
        poll_many: PollMany,
        wake: Callable[[], None],
        wait_s: float = FEED_WAIT_S,
        name: str = "output-feed",
    ) -> None:
        self._poll_many = poll_many
        self._wake = wake
        self.wait_s = wait_s
        self.name = name
        self._lock = threading.Lock()
        self._readers: dict[str, _Reader] = {}  # on _lock
        self._thread: threading.Thread | None = None  # on _lock; None: no poll loop running
        self._in_poll = False  # on _lock: a poll_many call is in flight
        self._round_ids: frozenset[str] = frozenset()  # on _lock: the ids it asks for
        self._rounds = 0  # on _lock: poll_many calls that ended
        self._round_ended = threading.Condition(self._lock)
        self._waking = False  # on _lock: a wake_polls call is in flight
        self.calls = 0  # poll_many calls made (for tests and profiles)

    def poll(self, request_id: str, timeout: float = 1.0) -> list[TokenOutput]:
        """The request's outputs since the last call, waiting up to timeout for the first;
        raises what the worker's poll would have (KeyError: unknown; the transport's error)."""
        reader = self._reader(request_id)
        try:
            outs = reader.take(timeout)
        except BaseException:
            self._forget(request_id, reader)
            raise
        if outs and outs[-1].finished:
            self._forget(request_id, reader)
        return outs

    def reset(self, request_id: str, wait_s: float = 2.0) -> None:
        """Forget the request's reader before the worker opens a new stream under the same
        id (the router's next attempt on this worker reuses the id): outputs an earlier
        attempt left unread never reach the new one. Waits (up to wait_s) for a poll in flight
        that asks for the id, so that what it drained of the old stream is dropped."""
        with self._lock:
            self._readers.pop(request_id, None)
            if not (self._in_poll and request_id in self._round_ids):
                return
            rounds = self._rounds
        self._start_wake()
        deadline = time.monotonic() + wait_s
        with self._lock:
            while self._rounds == rounds and (left := deadline - time.monotonic()) > 0:
                self._round_ended.wait(left)

    def num_readers(self) -> int:
        with self._lock:
            return len(self._readers)

    def _reader(self, request_id: str) -> _Reader:
        wake = False
        with self._lock:
            reader = self._readers.get(request_id)
            if reader is not None:
                return reader
            self._drop_stale_readers()
            reader = self._readers[request_id] = _Reader()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            else:
                wake = self._in_poll
        if wake:
            self._start_wake()
        return reader

    def _start_wake(self) -> None:
        """Wake the poll in flight from a thread of its own: a frozen worker must not hold
        up the reader (its poll() still returns after its timeout). One wake at a time."""
        with self._lock:
            if self._waking:
                return
            self._waking = True

        def wake() -> None:
            try:
                self._wake()
            except Exception as exc:  # noqa: BLE001 - then the reader waits for the poll to end
                logger.debug("%s: wake_polls failed: %s", self.name, exc)
            finally:
                with self._lock:
                    self._waking = False

        threading.Thread(target=wake, name=f"{self.name}-wake", daemon=True).start()

    def _forget(self, request_id: str, reader: _Reader) -> None:
        with self._lock:
            if self._readers.get(request_id) is reader:
                del self._readers[request_id]

    def _drop_stale_readers(self) -> None:
        """On _lock: forget requests whose outputs ended long ago and were never read to the
        end (their reader left)."""
        horizon = time.monotonic() - READER_TTL_S
        stale = [
            rid for rid, r in self._readers.items() if r.done_at is not None and r.done_at < horizon
        ]
        for rid in stale:
            del self._readers[rid]

    def _run(self) -> None:
        while True:
            with self._lock:
                ids = [rid for rid, r in self._readers.items() if r.polled]
                if not ids:
                    self._thread = None
                    return
                self._in_poll = True
                self._round_ids = frozenset(ids)
            try:
                outs, unknown = self._poll_many(ids, self.wait_s)
            except Exception as exc:  # noqa: BLE001 - raised to each request's reader
                with self._lock:
                    self._end_round()
                    for rid in ids:
                        self._end(rid, exc)
                continue
            with self._lock:
                self._end_round()
                for out in outs:
                    reader = self._readers.get(out.request_id)
                    if reader is not None and reader.polled:
                        reader.items.put(out)
                        if out.finished:
                            reader.polled = False
                            reader.done_at = time.monotonic()
                for rid in unknown:
                    self._end(rid, KeyError(f"unknown request {rid!r}"))

    def _end_round(self) -> None:
        """On _lock: the poll in flight returned (or failed)."""
        self._in_poll = False
        self._round_ids = frozenset()
        self._rounds += 1
        self._round_ended.notify_all()

    def _end(self, request_id: str, error: BaseException) -> None:
        """On _lock: the request's outputs end with `error`."""
        reader = self._readers.get(request_id)
        if reader is not None and reader.polled:
            reader.items.put(error)
            reader.polled = False
            reader.done_at = time.monotonic()
