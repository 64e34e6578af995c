"""PeerGroup: what one worker holds for one peer, and the pair's failure/epoch protocol.

Each pair rendezvous through its own TCPStore, hosted by the prefill side (rank 0) and wrapped
in a PrefixStore. The backend group is built per *epoch*: when a transfer fails, the group is
aborted and the pair's epoch in the store moves from e to e + 1 (compare-and-set, so both sides
together advance it once); the next transfer builds a fresh group under the new epoch's prefix.
A fresh prefix matters: gloo's rendezvous keys of a failed attempt point at dead sockets.

Deadlines: backend operations are bounded by work.wait(timeout) (kvtransfer.wire). Store
calls are bounded here: a TCPStore client call blocks forever when the store's host process
hangs, so on the joined side every store call and group construction runs on the pair's one
long-lived caller thread (`BoundedCaller`), and the caller stops waiting after the deadline.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kvtransfer.backends import BACKENDS
from kvtransfer.errors import PeerLost, TransferTimeout

logger = logging.getLogger(__name__)

EPOCH_KEY = "epoch"
ANNOUNCE_KEY = "announce"  # queue of announced transfers and pull asks, host -> joiner
ANSWER_KEY = "answer"  # queue of answers to pull asks, joiner -> host
HOST_RANK, JOIN_RANK = 0, 1  # host = prefill side (owns the store), join = decode side


class StoreHung(Exception):
    """A bounded call did not return in time; `done` is set if the abandoned call ever ends."""

    def __init__(self, done: threading.Event) -> None:
        super().__init__("no answer")
        self.done = done


class _Call:
    """One call for a BoundedCaller's thread; `done` is set once it returned or raised."""

    __slots__ = ("device", "done", "error", "fn", "value")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        # The caller's CUDA device (a backend group built here binds to the current device).
        self.device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        self.value: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            if self.device is not None:
                torch.cuda.set_device(self.device)
            self.value = self.fn()
        except BaseException as e:  # handed to the caller by BoundedCaller.call
            self.error = e
        finally:
            self.done.set()


class BoundedCaller:
    """One daemon thread that runs calls in order, for calls into a store whose server runs
    in another process (see module docstring). A call that outlives its deadline keeps the
    thread until it returns; calls queued behind it wait (PeerGroup waits for its `done`
    before it issues more)."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=f"kvt-call-{name}", daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[], Any], timeout: float) -> Any:
        """fn() on the thread; StoreHung if it does not end within `timeout` seconds."""
        call = _Call(fn)
        self._calls.put(call)
        if not call.done.wait(timeout):
            raise StoreHung(call.done)
        if call.error is not None:
            raise call.error
        return call.value

    def close(self) -> None:
        """Stop the thread once the calls queued so far have run."""
        self._calls.put(None)

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            call.run()


# ---- one pair -----------------------------------------------------------------------------
class PeerGroup:
    """Everything this worker holds for one peer: the pair's store, the backend group of the
    current epoch and transfer scratch buffers. One transfer at a time (see `session`)."""

    def __init__(
        self,
        peer_id: str,
        rank: int,
        name: str,
        backend: str,
        device: torch.device,
        timeout: float,
        local_host: str,
        tcp_store: dist.TCPStore,
        caller: BoundedCaller | None = None,
    ) -> None:
        self.peer_id = peer_id
        self.rank = rank
        self.name = name
        self.backend = backend
        self.device = device
        self.timeout = timeout
        self.local_host = local_host
        self.staging: Any = None  # owned by the transfer layer; dropped with the group
        self.pg: Any = None  # backend group of `pg_epoch`, or None
        self.pg_epoch: int | None = None
        self.closed = False  # removed from the registry
        # Set while a store call that outlived its deadline still owns the store connection.
        self._stuck: threading.Event | None = None
        self._tcp: dist.TCPStore | None = tcp_store
        # Joined side: the thread its store calls run on (the host's store is in-process).
        self._caller = caller if caller is not None or self.is_host else BoundedCaller(name)
        self.store: dist.Store | None = dist.PrefixStore(f"kvt/{name}", tcp_store)
        self._failed_epoch: int | None = None  # epoch whose failure is not yet in the store
        self._lock = threading.Lock()

    @property
    def is_host(self) -> bool:
        """True on the side that owns the store (rank 0, the sender)."""
        return self.rank == HOST_RANK

    @contextmanager
    def session(self, wait: float) -> Iterator[PeerGroup]:
        """Hold the pair for one transfer; PeerLost if the peer was removed, TransferTimeout if
        an earlier store call is still unanswered after `wait` more seconds."""
        with self._lock:
            try:
                if self.closed:
                    raise PeerLost(f"peer {self.peer_id!r} was removed; join/host it again")
                if self._stuck is not None:
                    if not self._stuck.wait(wait):
                        raise TransferTimeout(
                            f"peer {self.peer_id!r} still does not answer its "
                            "store; remove() it if it is gone"
                        )
                    self._stuck = None  # the peer answered after all: usable again
                yield self
            finally:
                if self.closed:
                    self._release()

    def live_store(self) -> dist.Store:
        """The pair's store; PeerLost once it was released (the peer was removed)."""
        if self.store is None:
            raise PeerLost(f"peer {self.peer_id!r} was removed; join/host it again")
        return self.store

    # ---- store operations (call inside a session; each bounded by `timeout`) ----------------
    def _bounded(self, what: str, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        if self._caller is None:
            return fn()  # the store server runs in this process: a hung peer cannot stall it
        try:
            return self._caller.call(fn, self.timeout if timeout is None else timeout)
        except StoreHung as hung:
            self._stuck = hung.done
            if self.pg_epoch is not None and self._failed_epoch is None:
                self._failed_epoch = self.pg_epoch
            self._abort()
            raise TransferTimeout(
                f"{what}: peer {self.peer_id!r} did not answer within "
                f"{self.timeout}s; transfers with it wait for that answer "
                "first (remove() it if it is gone)"
            ) from None

    def epoch(self) -> int:
        """The pair's current epoch as recorded in the store."""
        return int(
            self._bounded("reading the pair epoch", lambda: self.live_store().get(EPOCH_KEY))
        )

    def publish_failure(self) -> None:
        """Advance the store's epoch past a failure this side deferred (joiner side)."""
        if self._failed_epoch is not None:
            self._advance(self._failed_epoch)  # raises (keeping it pending) if the peer is down
            self._failed_epoch = None

    def sync_epoch(self) -> int:
        """Publish a deferred failure, then return the current epoch (drops an outdated group)."""
        self.publish_failure()
        epoch = self.epoch()
        if self.pg_epoch is not None and self.pg_epoch != epoch:
            self._abort()  # the peer failed and moved on; our group is dead on its side
        return epoch

    @property
    def _outbox(self) -> str:
        """The queue this side pushes frames to (the peer pops them)."""
        return ANNOUNCE_KEY if self.is_host else ANSWER_KEY

    @property
    def _inbox(self) -> str:
        return ANSWER_KEY if self.is_host else ANNOUNCE_KEY

    def announce(self, frame: bytes) -> None:
        """Queue a frame for the peer (host: a transfer or a pull ask; joiner: an answer)."""
        outbox = self._outbox
        self._bounded("announcing a transfer", lambda: self.live_store().queue_push(outbox, frame))

    def next_announcement(self, wait: float) -> bytes | None:
        """Pop the peer's oldest frame, waiting up to `wait` seconds; None if none came."""
        inbox = self._inbox
        wait = max(wait, 0.001)

        def pop() -> bytes | None:
            # Blocking pop: the store wakes us as soon as a frame is pushed (no polling). The
            # client's timeout is per store object and only this session uses it.
            self.live_store().set_timeout(timedelta(seconds=wait))
            try:
                return self.live_store().queue_pop(inbox, block=True)
            except dist.DistNetworkError:
                raise  # the host is gone
            except dist.DistStoreError:
                return None  # the wait timed out with the queue still empty
            finally:
                self.live_store().set_timeout(timedelta(seconds=self.timeout))

        return self._bounded("waiting for an announcement", pop, timeout=wait + self.timeout)

    def num_announcements(self) -> int:
        """The peer's frames queued for this side and not yet popped."""
        inbox = self._inbox
        return self._bounded("counting announcements", lambda: self.live_store().queue_len(inbox))

    def connect(self, epoch: int) -> Any:
        """The backend group for `epoch`, built now if needed (blocks until the peer joins)."""
        if self.pg is not None and self.pg_epoch == epoch:
            return self.pg
        self._abort()
        store = dist.PrefixStore(f"epoch{epoch}", self.live_store())
        make = BACKENDS[self.backend]
        timeout = timedelta(seconds=self.timeout)

        def build() -> Any:
            pg = make(store, self.rank, timeout, self.device, self.local_host)
            try:
                # One byte host -> joiner: proves the data path, and makes NCCL create its
                # lazily built point-to-point communicator here, under this deadline.
                probe = torch.zeros(1, dtype=torch.uint8, device=self.device)
                if self.is_host:
                    work = pg.send([probe], JOIN_RANK, 0)
                else:
                    work = pg.recv([probe], HOST_RANK, 0)
                if not work.wait(timeout):
                    raise RuntimeError("the connection probe did not complete")
            except BaseException:
                pg.abort()
                raise
            return pg

        # The backend's own rendezvous timeout fires first when the peer is merely absent;
        # the bound catches a hung store host, which the backend would wait on forever.
        self.pg = self._bounded("building the group", build, timeout=self.timeout * 2.5 + 1.0)
        self.pg_epoch = epoch
        logger.debug(
            "kvtransfer: group %s with %s ready (epoch %d)", self.name, self.peer_id, epoch
        )
        return self.pg

    def fail(self, epoch: int | None) -> None:
        """Tear down the group after a failed transfer at `epoch` so the next one rebuilds it."""
        self._abort()
        self.staging = None  # an aborted operation may still own the old buffers
        if epoch is None:
            return
        if self.is_host:
            try:
                self._advance(epoch)  # the store is in-process: this cannot hang on the peer
            except RuntimeError as e:
                logger.warning("kvtransfer: could not advance epoch with %s: %s", self.peer_id, e)
        else:
            # The host may be hung: a store call now could block past the deadline.
            self._failed_epoch = epoch

    def _advance(self, epoch: int) -> None:
        # Compare-and-set: when both sides report the same failure, the epoch moves only once.
        self._bounded(
            "advancing the pair epoch",
            lambda: self.live_store().compare_set(EPOCH_KEY, str(epoch), str(epoch + 1)),
        )

    # ---- teardown -------------------------------------------------------------------------
    def close(self) -> None:
        """Abort the group and release the store; safe while a transfer runs in another thread."""
        self.closed = True
        self._abort()  # unblocks a transfer waiting on the group
        if self._lock.acquire(blocking=False):
            try:
                self._release()
            finally:
                self._lock.release()
        # else: the transfer in flight releases the store when its session ends.

    def _abort(self) -> None:
        pg, self.pg, self.pg_epoch = self.pg, None, None
        if pg is None:
            return
        try:
            pg.abort()
        except RuntimeError as e:  # a broken group may refuse; it is dropped either way
            logger.debug("kvtransfer: abort of group with %s: %s", self.peer_id, e)

    def _release(self) -> None:
        self.staging = None
        self.store = None
        self._tcp = None  # last reference: the host's store server stops with it
        if self._caller is not None:
            self._caller.close()
