"""TierIndex: the blocks a tier holds, in LRU order, under a byte bound.

Not thread-safe: the tier calls it under its own lock. Invariants:
  usage_bytes == sum(entry.nbytes) <= capacity_bytes
  order of `_entries` == least recently used first
  an entry with pins > 0 (a load is reading it) is never chosen for eviction
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from engine.block_hash import BlockHash
from engine.block_pool import HashKey


@dataclass(slots=True)
class TierEntry:
    """One stored block."""

    block_hash: BlockHash
    nbytes: int  # what it occupies in the tier (a disk file: header + payload)
    parent_hash: BlockHash | None = None
    hash_key: HashKey | None = None  # re-checked on lookup when the caller passes keys
    last_use: int = 0  # a strictly increasing clock (ns); a disk tier's file mtime
    pins: int = 0


class TierIndex:
    """Entries by block hash, least recently used first, bounded by capacity_bytes."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be >= 1, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.usage_bytes = 0
        self._entries: OrderedDict[BlockHash, TierEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._entries

    def __iter__(self) -> Iterator[TierEntry]:
        """Entries, least recently used first."""
        return iter(list(self._entries.values()))

    def get(self, block_hash: BlockHash) -> TierEntry | None:
        return self._entries.get(block_hash)

    def leading(
        self, block_hashes: Sequence[BlockHash], hash_keys: Sequence[HashKey] | None = None
    ) -> int:
        """How many leading hashes are held (and, with keys, stand for those keys)."""
        n = 0
        for i, h in enumerate(block_hashes):
            entry = self._entries.get(h)
            if entry is None:
                break
            if hash_keys is not None and entry.hash_key is not None:
                if entry.hash_key != hash_keys[i]:
                    break
            n += 1
        return n

    def touch(self, block_hash: BlockHash, now: int) -> None:
        """Mark as most recently used at clock value `now`."""
        entry = self._entries[block_hash]
        entry.last_use = now
        self._entries.move_to_end(block_hash)

    def make_room(self, nbytes: int) -> list[TierEntry] | None:
        """The least recently used unpinned entries whose removal lets `nbytes` fit (not yet
        removed: call remove() for each), or None when no choice of them can."""
        if nbytes > self.capacity_bytes:
            return None
        need = self.usage_bytes + nbytes - self.capacity_bytes
        victims: list[TierEntry] = []
        for entry in self._entries.values():
            if need <= 0:
                break
            if entry.pins == 0:
                victims.append(entry)
                need -= entry.nbytes
        return victims if need <= 0 else None

    def add(self, entry: TierEntry) -> None:
        """Insert as most recently used; the caller made room first."""
        if entry.block_hash in self._entries:
            raise KeyError(f"block {entry.block_hash:#x} is already in the tier")
        if self.usage_bytes + entry.nbytes > self.capacity_bytes:
            raise ValueError(
                f"{entry.nbytes} bytes do not fit: {self.usage_bytes} of "
                f"{self.capacity_bytes} in use"
            )
        self._entries[entry.block_hash] = entry
        self.usage_bytes += entry.nbytes

    def remove(self, block_hash: BlockHash) -> TierEntry | None:
        entry = self._entries.pop(block_hash, None)
        if entry is not None:
            self.usage_bytes -= entry.nbytes
        return entry

    def check_integrity(self) -> None:
        """Raise AssertionError unless usage and LRU order agree with the entries."""
        total = sum(e.nbytes for e in self._entries.values())
        if total != self.usage_bytes or total > self.capacity_bytes:
            raise AssertionError(
                f"usage {self.usage_bytes}, entries sum to {total}, capacity {self.capacity_bytes}"
            )
        uses = [e.last_use for e in self._entries.values()]
        if uses != sorted(uses):
            raise AssertionError("entries are not in last-use order")
        if any(e.pins < 0 for e in self._entries.values()):
            raise AssertionError("negative pin count")
