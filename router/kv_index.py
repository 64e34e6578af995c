"""KVIndex: which block hashes each worker holds, and where, rebuilt from the workers' own KV
events.

The index is never guessed from routing decisions: a worker's entry changes only when one
of its `stored` / `removed` events is applied. An entry is keyed by (hash, medium): an event's
`medium` says whether it is about the worker's KV cache ("device") or its KV tier ("host",
"disk"), so a tier eviction never drops a hash the device still holds, and a device eviction
never drops the tier's copy. The device entries are two maps kept in step:
    _blocks[worker]  the set of hashes that worker's KV cache holds
    _holders[hash]   the set of workers whose KV cache holds that hash (never an empty set)
and the tier entries one:
    _tier[worker]    medium -> the set of hashes that worker's tier of that medium holds
so that a query costs O(prompt blocks) set lookups, independent of the cache sizes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.block_hash import BlockHash

WorkerId = str

_KINDS = ("stored", "removed")
DEVICE = "device"  # the KV cache's medium; any other medium is a KV tier's
# Tier media whose blocks outlive the worker process: a restarted worker reopens them (its
# disk tier directory) and announces what it kept, so their entries survive a restart.
PERSISTENT_MEDIA = frozenset({"disk"})


@dataclass(frozen=True, slots=True)
class PrefixHits:
    """A prompt's leading blocks on one worker as its engine would find them: `device` in its
    KV cache, then `tier` more in its KV tier right after them (loaded, not computed)."""

    device: int = 0
    tier: int = 0
    medium: str | None = None  # the tier's medium when tier > 0

    @property
    def blocks(self) -> int:
        """Leading blocks the worker need not compute."""
        return self.device + self.tier


class UnknownWorker(KeyError):
    """Events arrived for a worker the index was not told about (add_worker first)."""


def _normalize(event: Any) -> tuple[str, tuple[BlockHash, ...], str]:
    """(kind, block hashes, medium) of a KVEvent or of its plain-dict form from RPC / Ray; an
    event without a medium is the KV cache's."""
    if isinstance(event, Mapping):
        missing = [k for k in ("kind", "block_hashes") if k not in event]
        if missing:
            raise ValueError(f"KV event {event!r} lacks field(s) {', '.join(missing)}")
        kind, hashes = event["kind"], event["block_hashes"]
        medium = event.get("medium") or DEVICE
    else:
        try:
            kind, hashes = event.kind, event.block_hashes
        except AttributeError as exc:
            raise ValueError(f"not a KV event (need kind and block_hashes): {event!r}") from exc
        medium = getattr(event, "medium", None) or DEVICE
    if kind not in _KINDS:
        raise ValueError(f"KV event kind must be one of {_KINDS}, got {kind!r}")
    if not isinstance(medium, str):
        raise ValueError(f"KV event medium must be a string, got {medium!r}")
    return kind, tuple(hashes), medium


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
        self._tier: dict[WorkerId, dict[str, set[BlockHash]]] = {}  # keys: _blocks' keys
        self._lock = threading.Lock()

    # ---- membership ----------------------------------------------------------------------
    def add_worker(self, worker_id: WorkerId) -> None:
        """Register a worker with an empty cache; a known worker keeps its entries."""
        with self._lock:
            self._blocks.setdefault(worker_id, set())
            self._tier.setdefault(worker_id, {})

    def remove_worker(self, worker_id: WorkerId) -> None:
        """Forget a worker and every block it held, in every medium (no-op for an unknown
        worker)."""
        with self._lock:
            for h in self._blocks.pop(worker_id, ()):
                self._drop_holder(h, worker_id)
            self._tier.pop(worker_id, None)

    def restart_worker(self, worker_id: WorkerId) -> None:
        """A worker restarted: its KV cache and any host tier are empty, its PERSISTENT_MEDIA
        entries stay (the restarted worker re-announces what its disk tier kept, and those
        events may arrive before the restart is reported). No-op for an unknown worker."""
        with self._lock:
            if worker_id not in self._blocks:
                return
            for h in self._blocks[worker_id]:
                self._drop_holder(h, worker_id)
            self._blocks[worker_id] = set()
            tiers = self._tier[worker_id]
            for medium in [m for m in tiers if m not in PERSISTENT_MEDIA]:
                del tiers[medium]

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
            tiers = self._tier[worker_id]
            for kind, hashes, medium in batch:
                if medium != DEVICE:
                    media = tiers.setdefault(medium, set())
                    (media.update if kind == "stored" else media.difference_update)(hashes)
                elif kind == "stored":
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
        """Number of leading prompt blocks the worker's KV cache holds (0 for an unknown
        worker).

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

    def hits(self, worker_id: WorkerId, block_hashes: Sequence[BlockHash]) -> PrefixHits:
        """The worker's leading prompt blocks as its engine finds them: prefix_hits in the KV
        cache, then the run its KV tier holds from the first device miss on (a worker has one
        tier; were there several, the one holding the longest run)."""
        device = self.prefix_hits(worker_id, block_hashes)
        rest = block_hashes[device:]
        best = PrefixHits(device)
        with self._lock:
            for medium, held in sorted(self._tier.get(worker_id, {}).items()):
                n = 0
                for h in rest:
                    if h not in held:
                        break
                    n += 1
                if n > best.tier:
                    best = PrefixHits(device, n, medium)
        return best

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

    def num_blocks(self, worker_id: WorkerId, medium: str = DEVICE) -> int:
        """How many block hashes the worker holds in `medium` (0 for an unknown worker)."""
        with self._lock:
            if medium == DEVICE:
                return len(self._blocks.get(worker_id, ()))
            return len(self._tier.get(worker_id, {}).get(medium, ()))

    def check_integrity(self) -> None:
        """Raise AssertionError unless the per-worker and per-hash maps agree exactly."""
        with self._lock:
            pairs = {(w, h) for w, hs in self._blocks.items() for h in hs}
            inverse = {(w, h) for h, ws in self._holders.items() for w in ws}
            if pairs != inverse:
                raise AssertionError(f"index maps disagree on {len(pairs ^ inverse)} entries")
            if any(not ws for ws in self._holders.values()):
                raise AssertionError("a hash has an empty holder set")
            if set(self._tier) != set(self._blocks):
                raise AssertionError("the tier map and the device map name other workers")
