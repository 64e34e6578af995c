"""BlockPool: KV block ids, reference counts, the prefix-cache map and LRU eviction.

Every block is in exactly one state:
  free    ref_cnt == 0, no hash            (in the free queue)
  cached  ref_cnt == 0, hash registered    (in the free queue; evictable, reusable on a hit)
  in use  ref_cnt > 0                       (not in the free queue; may carry a hash)
Allocation pops the front of the free queue (least recently freed first) and evicts the
hash it carries, if any. Callers free a request's blocks tail first, so the tail of a
finished request is evicted before its (more shareable) head.

Retention (engine/retention.py): blocks freed for a session carry its id; while the session
is retained (retain(): until a deadline on `clock`) allocation passes them over and takes them
only when no other block is free, least recently freed first. Without retained sessions the
order is exactly the free queue's.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice

from engine.block_hash import BlockHash

# (parent hash, token ids, extra keys): what a hash stands for; re-checked on every hit.
HashKey = tuple[BlockHash, tuple[int, ...], tuple]


@dataclass(slots=True)
class KVBlock:
    """One block of `block_size` token slots in every layer's KV cache."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    hash_key: HashKey | None = None
    session: str | None = None  # the session that freed it last with retention (cached only)


@dataclass(frozen=True, slots=True)
class KVEvent:
    """A change to the set of cached block hashes, published to routers."""

    kind: str  # "stored" | "removed"
    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None = None
    medium: str = "device"  # where the blocks are: "device", or a KV tier's ("host", "disk")


@dataclass(slots=True)
class BlockPoolStats:
    """Prefix-cache counters since start-up."""

    queries: int = 0  # blocks looked up
    hits: int = 0  # blocks found
    evictions: int = 0
    extra: dict = field(default_factory=dict)


class BlockPool:
    """Owns all KV blocks; knows nothing about requests."""

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        on_evict: Callable[[KVBlock], object] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # Called with a cached block that allocation is about to reuse, hash still set and KV
        # still intact (a KV tier copies it out here: engine/kv_tier/connector.py).
        self.on_evict = on_evict
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}
        self._events: list[KVEvent] = []
        self.stats = BlockPoolStats()
        self.clock = clock  # retention deadlines are on this clock (tests inject one)
        self._sessions: dict[str, float] = {}  # retained session -> its deadline
        self._deadlines: list[tuple[float, str]] = []  # heap; an entry is stale once replaced

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free + evictable cached)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def lookup(self, block_hash: BlockHash, hash_key: HashKey) -> KVBlock | None:
        """The cached block for this hash, if its tokens really match."""
        block = self._cached.get(block_hash)
        if block is None or block.hash_key != hash_key:
            return None
        return block

    def cached_hashes(self) -> set[BlockHash]:
        return set(self._cached)

    def cached_blocks(self) -> list[KVBlock]:
        """Every block carrying a hash: evictable ones in eviction order, then those in use."""
        free = [b for b in self._eviction_order(len(self._free)) if b.block_hash is not None]
        return free + [b for b in self._cached.values() if b.ref_cnt > 0]

    def num_retained(self) -> int:
        """Free blocks allocation passes over now (their session is retained)."""
        self._expire()
        return sum(1 for b in self._free.values() if self._is_retained(b))

    # ---- mutations -----------------------------------------------------------------------
    def touch(self, blocks: list[KVBlock]) -> None:
        """Take one more reference on each block (a prefix hit), pulling it off the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[KVBlock]:
        """Take n blocks in eviction order (the free queue's front first, retained ones
        last), evicting their hashes."""
        if n > len(self._free):
            raise RuntimeError(f"cannot allocate {n} blocks: only {len(self._free)} free")
        out = self._eviction_order(n)
        for block in out:
            del self._free[block.block_id]
            if self.on_evict is not None and block.block_hash is not None:
                self.on_evict(block)
            self._evict(block)
            block.ref_cnt = 1
        return out

    def free(self, blocks: list[KVBlock], session: str | None = None) -> None:
        """Drop one reference per block; blocks reaching zero go to the back of the queue.

        Pass blocks in eviction order: the first one freed is the first one evicted. With a
        session, the cached ones among them are that session's (retained while it is).
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if session is not None and block.block_hash is not None:
                block.session = session
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def retain(self, session: str, until: float) -> None:
        """Blocks of `session` are evicted last until clock() reaches `until` (the deadline
        of the session's last finished request replaces an earlier one)."""
        self._sessions[session] = until
        heapq.heappush(self._deadlines, (until, session))

    def _eviction_order(self, n: int) -> list[KVBlock]:
        """The first n free blocks allocation takes: the queue's order, passing over the
        blocks of retained sessions, which follow in their own queue order."""
        self._expire()
        if not self._sessions:
            return list(islice(self._free.values(), n))
        taken: list[KVBlock] = []
        retained: list[KVBlock] = []
        for block in self._free.values():
            if len(taken) == n:
                return taken
            (retained if self._is_retained(block) else taken).append(block)
        return taken + retained[: n - len(taken)]

    def _is_retained(self, block: KVBlock) -> bool:
        return block.session is not None and block.session in self._sessions

    def _expire(self) -> None:
        """Forget sessions whose deadline passed (their blocks are ordinary again)."""
        if not self._deadlines:
            return
        now = self.clock()
        while self._deadlines and self._deadlines[0][0] <= now:
            until, session = heapq.heappop(self._deadlines)
            if self._sessions.get(session) == until:
                del self._sessions[session]

    def cache_block(self, block: KVBlock, block_hash: BlockHash, hash_key: HashKey) -> None:
        """Register a full, computed block under its hash (no-op if caching is off).

        If another block already holds this hash, that one stays canonical and this block
        remains unhashed (it is freed normally with its request).
        """
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        block.hash_key = hash_key
        self._cached[block_hash] = block
        self._events.append(KVEvent("stored", (block_hash,), hash_key[0]))

    def reset_prefix_cache(self) -> bool:
        """Forget every evictable cached hash. False if some cached block is in use."""
        if any(b.ref_cnt > 0 and b.block_hash is not None for b in self.blocks):
            return False
        for block in list(self._cached.values()):
            self._evict(block)
        return True

    def take_events(self) -> list[KVEvent]:
        """Events since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        del self._cached[block.block_hash]
        self._events.append(KVEvent("removed", (block.block_hash,)))
        self.stats.evictions += 1
        block.block_hash = None
        block.hash_key = None
        block.session = None

    # ---- invariants ----------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError unless free + cached + in use == total and all maps agree."""
        free = sum(1 for b in self.blocks if b.ref_cnt == 0 and b.block_hash is None)
        cached = sum(1 for b in self.blocks if b.ref_cnt == 0 and b.block_hash is not None)
        in_use = sum(1 for b in self.blocks if b.ref_cnt > 0)
        if free + cached + in_use != self.num_blocks:
            raise AssertionError(
                f"free {free} + cached {cached} + in use {in_use} "
                f"!= total {self.num_blocks} (negative ref count?)"
            )
        if len(self._free) != free + cached:
            raise AssertionError(
                f"free queue holds {len(self._free)} blocks, expected {free + cached}"
            )
        if any(self._free.get(b.block_id) is not b for b in self.blocks if b.ref_cnt == 0):
            raise AssertionError("a block with ref_cnt 0 is missing from the free queue")
        for h, b in self._cached.items():
            if b.block_hash != h:
                raise AssertionError(
                    f"cache map entry {h} points at block {b.block_id} whose hash is {b.block_hash}"
                )
        hashed = sum(1 for b in self.blocks if b.block_hash is not None)
        if hashed != len(self._cached):
            raise AssertionError(f"{hashed} blocks carry a hash, map has {len(self._cached)}")
