"""KVIndex: which block hashes each worker holds, rebuilt from the workers' own KV events.

The index is never guessed from routing decisions: a worker's entry changes only when one
of its `stored` / `removed` events is applied. Two maps are kept in step:
    _blocks[worker]  the set of hashes that worker holds
    _holders[hash]   the set of workers holding that hash (never an empty set)
so that a query costs O(prompt blocks) set lookups, independent of the cache sizes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from engine.block_hash import BlockHash

WorkerId = str

_KINDS = ("stored", "removed")


class UnknownWorker(KeyError):
    """Events arrived for a worker the index was not told about (add_worker first)."""


def _normalize(event: Any) -> tuple[str, tuple[BlockHash, ...]]:
    """(kind, block hashes) of a KVEvent or of its plain-dict form from RPC / Ray."""
    if isinstance(event, Mapping):
        missing = [k for k in ("kind", "block_hashes") if k not in event]
        if missing:
            raise ValueError(f"KV event {event!r} lacks field(s) {', '.join(missing)}")
        kind, hashes = event["kind"], event["block_hashes"]
    else:
        try:
            kind, hashes = event.kind, event.block_hashes
        except AttributeError as exc:
            raise ValueError(f"not a KV event (need kind and block_hashes): {event!r}") from exc
    if kind not in _KINDS:
        raise ValueError(f"KV event kind must be one of {_KINDS}, got {kind!r}")
    return kind, tuple(hashes)


class KVIndex:
    """Per-worker sets of cached block hashes, built only from each worker's KV events.

    Events of one worker must be applied in the order that worker emitted them (its
    BlockPool.take_events order): a `removed` applied before the `stored` it undoes would
    leave a block the worker no longer has. Events of different workers are independent.
    `parent_hash` is not needed: the chained hash already encodes a block's whole prefix.
    All methods are thread-safe.
    """

    def __init__(self) -> None:
        self._blocks: dict[WorkerId, set[BlockHash]] = {}
        self._holders: dict[BlockHash, set[WorkerId]] = {}
        self._lock = threading.Lock()

    # ---- membership ----------------------------------------------------------------------
    def add_worker(self, worker_id: WorkerId) -> None:
        """Register a worker with an empty cache; a known worker keeps its entries."""
        with self._lock:
            self._blocks.setdefault(worker_id, set())

    def remove_worker(self, worker_id: WorkerId) -> None:
        """Forget a worker and every block it held (no-op for an unknown worker).

        A restarted worker starts with an empty cache: remove it, then add it again.
        """
        with self._lock:
            for h in self._blocks.pop(worker_id, ()):
                self._drop_holder(h, worker_id)

    def workers(self) -> list[WorkerId]:
        """Registered worker ids, sorted."""
        with self._lock:
            return sorted(self._blocks)

    # ---- events --------------------------------------------------------------------------
    def apply(self, worker_id: WorkerId, events: Iterable[Any]) -> None:
        """Apply one worker's KV events (KVEvent or dict form), oldest first.

        All events are validated before any is applied, so a bad batch changes nothing.
        Storing a held hash or removing an absent one is a no-op.
        """
        batch = [_normalize(e) for e in events]
        with self._lock:
            held = self._blocks.get(worker_id)
            if held is None:
                # Refuse rather than resurrect a removed worker from late events.
                raise UnknownWorker(
                    f"KV events for unknown worker {worker_id!r}; "
                    f"call add_worker({worker_id!r}) first"
                )
            for kind, hashes in batch:
                if kind == "stored":
                    for h in hashes:
                        if h not in held:
                            held.add(h)
                            self._holders.setdefault(h, set()).add(worker_id)
                else:
                    for h in hashes:
                        if h in held:
                            held.remove(h)
                            self._drop_holder(h, worker_id)

    def _drop_holder(self, h: BlockHash, worker_id: WorkerId) -> None:
        holders = self._holders[h]
        holders.discard(worker_id)
        if not holders:  # invariant: no empty holder sets
            del self._holders[h]

    # ---- queries -------------------------------------------------------------------------
    def prefix_hits(self, worker_id: WorkerId, block_hashes: Sequence[BlockHash]) -> int:
        """Number of leading prompt blocks the worker holds (0 for an unknown worker).

        Counting stops at the first miss: a prefix cache only helps contiguously from the
        start of the prompt.
        """
        with self._lock:
            held = self._blocks.get(worker_id, ())
            n = 0
            for h in block_hashes:
                if h not in held:
                    break
                n += 1
            return n

    def best(self, block_hashes: Sequence[BlockHash]) -> dict[WorkerId, int]:
        """prefix_hits of every registered worker, most hits first (ties by worker id)."""
        with self._lock:
            hits = dict.fromkeys(self._blocks, 0)
            alive = set(self._blocks)  # workers holding every block so far
            for i, h in enumerate(block_hashes):
                alive &= self._holders.get(h, set())
                if not alive:
                    break
                for w in alive:
                    hits[w] = i + 1
        return dict(sorted(hits.items(), key=lambda kv: (-kv[1], kv[0])))

    def num_blocks(self, worker_id: WorkerId) -> int:
        """How many block hashes the worker holds (0 for an unknown worker)."""
        with self._lock:
            return len(self._blocks.get(worker_id, ()))

    def check_integrity(self) -> None:
        """Raise AssertionError unless the per-worker and per-hash maps agree exactly."""
        with self._lock:
            pairs = {(w, h) for w, hs in self._blocks.items() for h in hs}
            inverse = {(w, h) for h, ws in self._holders.items() for w in ws}
            if pairs != inverse:
                raise AssertionError(f"index maps disagree on {len(pairs ^ inverse)} entries")
            if any(not ws for ws in self._holders.values()):
                raise AssertionError("a hash has an empty holder set")
