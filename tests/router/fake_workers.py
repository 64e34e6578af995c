"""Prefill and decode workers in pure Python for the router's tests: they answer the worker
contract's calls the router makes, record what they were asked, and stream one token per
request once the test releases it."""

from __future__ import annotations

import threading

from engine.errors import NoFreeBlocksError
from kvtransfer.worker_api import PrefillResult, Reservation, Role, TokenOutput, WorkerStats


class FakePrefill:
    """Prefills every request at once (first token 7); `events_fail`: reporting KV events
    raises, as a restarting worker's does."""

    def __init__(self, events_fail: bool = False) -> None:
        self.events_fail = events_fail
        self.prefilled: list[str] = []  # request ids, in order

    def kv_events(self) -> list:
        if self.events_fail:
            raise ConnectionError("worker is restarting")
        return []

    def prefill(self, request, *args) -> PrefillResult:
        self.prefilled.append(request.request_id)
        return PrefillResult("prefilled", first_token=7, seed=1, num_cached_tokens=0)

    def abort(self, request_id, propagate=True) -> None:
        pass


class FakeDecode:
    """Streams one token per request once the request's release event is set; records which
    requests it prefilled itself (local) and which it reserved blocks for (a transfer)."""

    def __init__(self) -> None:
        self.release: dict[str, threading.Event] = {}  # every request it was given
        self.local: list[str] = []
        self.reserved: list[str] = []

    def kv_events(self) -> list:
        return []

    def stats(self) -> WorkerStats:
        return WorkerStats(
            "d0", Role.DECODE, free_blocks=100, num_blocks=100, num_requests=len(self.release)
        )

    def reserve(self, request, *args) -> Reservation:
        self.reserved.append(request.request_id)
        self.release.setdefault(request.request_id, threading.Event())
        return Reservation(num_hit_blocks=0, dst_block_ids=(0,), num_blocks=2)

    def local_generate(self, request) -> None:
        self.local.append(request.request_id)
        self.release.setdefault(request.request_id, threading.Event())

    def poll(self, request_id, wait) -> list[TokenOutput]:
        if not self.release[request_id].wait(wait):
            return []
        return [TokenOutput(request_id, (7,), "", True, "length", num_cached_tokens=0)]

    def abort(self, request_id, propagate=True) -> None:
        pass


class FullDecode(FakeDecode):
    """A decode worker whose KV cache is full until `room` is set; `stale` reservations are
    refused even though its stats claim room (blocks taken in between)."""

    def __init__(self, num_blocks: int = 100, stale: int = 0) -> None:
        super().__init__()
        self.room = threading.Event()
        self.num_blocks, self.stale = num_blocks, stale
        self.refused = 0

    def stats(self) -> WorkerStats:
        free = self.num_blocks if self.room.is_set() else 0
        return WorkerStats("d0", Role.DECODE, free_blocks=free, num_blocks=self.num_blocks)

    def reserve(self, request, *args) -> Reservation:
        if not self.room.is_set() or self.refused < self.stale:
            self.refused += 1
            raise NoFreeBlocksError("not enough free KV blocks for 5 tokens (0 free)")
        return super().reserve(request, *args)
