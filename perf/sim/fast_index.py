"""KVIndex with prefix_hits answered for all workers at once: the simulator's speed-up.

A routing decision asks prefix_hits(worker, hashes) for every worker with the same hashes;
with a thousand workers that is most of a simulation's time. This subclass walks the hashes'
holders once per (hashes, index state) and answers each worker from that walk. The answers
are KVIndex's own (tests/sim/test_simulate.py checks them against the base class).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from engine.block_hash import BlockHash
from router.kv_index import KVIndex, WorkerId


class FastKVIndex(KVIndex):
    """KVIndex whose prefix_hits memoizes one holders-walk per query until the next event."""

    def __init__(self) -> None:
        super().__init__()
        self._query: tuple | None = None  # (id, length, last hash) of the hashes walked
        self._hits: dict[WorkerId, int] = {}

    def apply(self, worker_id: WorkerId, events: Iterable[Any]) -> None:
        self._query = None
        super().apply(worker_id, events)

    def remove_worker(self, worker_id: WorkerId) -> None:
        self._query = None
        super().remove_worker(worker_id)

    def restart_worker(self, worker_id: WorkerId) -> None:
        self._query = None
        super().restart_worker(worker_id)

    def prefix_hits(self, worker_id: WorkerId, block_hashes: Sequence[BlockHash]) -> int:
        key = (len(block_hashes), block_hashes[-1] if block_hashes else None)
        if key != self._query:
            self._hits = self._walk(block_hashes)
            self._query = key
        return self._hits.get(worker_id, 0)

    def _walk(self, block_hashes: Sequence[BlockHash]) -> dict[WorkerId, int]:
        """Leading hits of every worker holding the first block (others have 0)."""
        hits: dict[WorkerId, int] = {}
        alive: set[WorkerId] | None = None
        for i, h in enumerate(block_hashes):
            holders = self._holders.get(h)
            if not holders:
                break
            alive = set(holders) if alive is None else alive & holders
            if not alive:
                break
            for w in alive:
                hits[w] = i + 1
        return hits
