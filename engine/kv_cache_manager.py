"""KVCacheManager: per-request block tables on top of the BlockPool.

The scheduler talks to this class in block counts and ids; it never sees the free queue.
"""

from __future__ import annotations

from engine.block_hash import hash_prompt_blocks, root_hash
from engine.block_pool import BlockPool, HashKey, KVBlock
from engine.request import Request
from engine.retention import Retention


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Allocates, caches and frees the blocks of each request."""

    def __init__(self, pool: BlockPool, block_size: int, hash_seed: str) -> None:
        self.pool = pool
        self.block_size = block_size
        self.hash_seed = hash_seed
        self._root = root_hash(hash_seed)
        self._tables: dict[str, list[KVBlock]] = {}
        self._num_hashed: dict[str, int] = {}  # leading table blocks already offered to the pool

    # ---- hashing -------------------------------------------------------------------------
    def update_block_hashes(self, request: Request) -> None:
        """Extend request.block_hashes to cover every full block of its tokens."""
        have = len(request.block_hashes)
        parent = request.block_hashes[-1] if have else None
        request.block_hashes.extend(
            hash_prompt_blocks(
                request.token_ids,
                self.block_size,
                self.hash_seed,
                request.cache_salt,
                start=have,
                parent=parent,
            )
        )

    def hash_key(self, request: Request, i: int) -> HashKey:
        """What block i's hash stands for (parent, tokens, extra keys); hashes must be current."""
        return self._hash_key(request, i)

    def _hash_key(self, request: Request, i: int) -> HashKey:
        parent = request.block_hashes[i - 1] if i > 0 else self._root
        tokens = tuple(request.token_ids[i * self.block_size : (i + 1) * self.block_size])
        extra = (request.cache_salt,) if (i == 0 and request.cache_salt) else ()
        return parent, tokens, extra

    # ---- scheduling ----------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """Longest run of cached blocks that prefix the request (takes no references).

        At most (num_tokens - 1) // block_size blocks: the last token is always computed,
        since its logits are needed.
        """
        if not self.pool.enable_caching:
            return []
        self.update_block_hashes(request)
        limit = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for i in range(min(limit, len(request.block_hashes))):
            block = self.pool.lookup(request.block_hashes[i], self._hash_key(request, i))
            if block is None:
                break
            hits.append(block)
        self.pool.stats.queries += limit
        self.pool.stats.hits += len(hits)
        return hits

    def cached_run(self, request: Request, start: int, stop: int) -> list[KVBlock]:
        """The cached blocks of request's blocks [start, stop), up to the first miss (takes no
        references; request.block_hashes must cover them)."""
        if not self.pool.enable_caching:
            return []
        run: list[KVBlock] = []
        for i in range(start, min(stop, len(request.block_hashes))):
            block = self.pool.lookup(request.block_hashes[i], self._hash_key(request, i))
            if block is None:
                break
            run.append(block)
        return run

    def pin(self, table_id: str, blocks: list[KVBlock], num_new: int = 0) -> bool:
        """Give table_id a table of `blocks` (one more reference each), then num_new fresh
        blocks; False (nothing changed) when the pool cannot supply them."""
        if table_id in self._tables:
            raise KeyError(f"{table_id!r} already holds a block table")
        leaving = num_new + sum(1 for b in blocks if b.ref_cnt == 0)
        if leaving > self.pool.num_free_blocks:
            return False
        self.pool.touch(blocks)
        self._tables[table_id] = list(blocks) + self.pool.allocate(num_new)
        return True

    def cache_range(self, table_id: str, request: Request, start: int, stop: int) -> int:
        """Register table_id's blocks [start, stop) as request's blocks of the same indices
        (their KV is in place); returns how many took the hash (a block already cached under
        it elsewhere stays the canonical one)."""
        table = self._tables[table_id]
        n = 0
        for i in range(start, stop):
            self.pool.cache_block(table[i], request.block_hashes[i], self._hash_key(request, i))
            n += table[i].block_hash == request.block_hashes[i]
        return n

    def num_blocks_needed(
        self, request: Request, num_new_tokens: int, computed: list[KVBlock] | None = None
    ) -> int:
        """Free-queue blocks an allocate_slots call with these arguments would consume."""
        table = self._tables.get(request.request_id, [])
        computed = computed or []
        total = _cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        new = max(0, total - len(table) - len(computed))
        # Hits on evictable cached blocks also leave the free queue.
        return new + sum(1 for b in computed if b.ref_cnt == 0)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: list[KVBlock] | None = None
    ) -> bool:
        """Make room for num_new_tokens more tokens; attach `computed` prefix hits first.

        Returns False (changing nothing) when the pool cannot supply the blocks.
        """
        if self.num_blocks_needed(request, num_new_tokens, computed) > self.pool.num_free_blocks:
            return False
        table = self._tables.setdefault(request.request_id, [])
        if computed:
            self.pool.touch(computed)
            table.extend(computed)
        total = _cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        if total > len(table):
            table.extend(self.pool.allocate(total - len(table)))
        return True

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the full blocks among the first num_computed_tokens tokens."""
        if not self.pool.enable_caching:
            return
        self.update_block_hashes(request)
        table = self._tables.get(request.request_id, [])
        n_full = min(num_computed_tokens // self.block_size, len(request.block_hashes), len(table))
        start = self._num_hashed.get(request.request_id, 0)
        self._num_hashed[request.request_id] = max(start, n_full)
        for i in range(start, n_full):
            if table[i].block_hash is None:
                self.pool.cache_block(table[i], request.block_hashes[i], self._hash_key(request, i))

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> list[tuple[int, int]] | None:
        """Give child_id a table for the first num_tokens tokens of parent_id's: the full
        blocks are shared (one more reference each), the block holding a partial tail is
        copied into a fresh block (both sequences write their next tokens into it). Returns
        the (src, dst) block copies the caller makes in the KV tensors, or None (nothing
        changed) when no block is free for the copy."""
        table = self._tables[parent_id]
        full, partial = divmod(num_tokens, self.block_size)
        if partial and self.pool.num_free_blocks < 1:
            return None
        shared = table[:full]
        self.pool.touch(shared)
        child = list(shared)
        copies = []
        if partial:
            (block,) = self.pool.allocate(1)
            child.append(block)
            copies.append((table[full].block_id, block.block_id))
        self._tables[child_id] = child
        self._num_hashed[child_id] = min(self._num_hashed.get(parent_id, 0), full)
        return copies

    def free(self, request: Request, finished: bool = False) -> None:
        """Release all of the request's blocks, tail first (evicted before the head); a
        finished request's are retained for its session if it asked (request.retention)."""
        self.free_table(request.request_id, request.retention if finished else None)

    def free_table(self, request_id: str, retention: Retention | None = None) -> None:
        """Release the blocks held under request_id (no-op if there are none), with
        `retention`: kept for that session, from now on, for retention.seconds."""
        table = self._tables.pop(request_id, None)
        self._num_hashed.pop(request_id, None)
        if not table:
            return
        session = None
        if retention is not None:
            session = retention.session_id
            self.pool.retain(session, self.pool.clock() + retention.seconds)
        self.pool.free(list(reversed(table)), session)

    def table_ids(self) -> list[str]:
        """Ids of every request that holds a block table (live or held for transfer)."""
        return list(self._tables)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._tables.get(request_id, [])]

    def blocks(self, request_id: str) -> list[KVBlock]:
        return list(self._tables.get(request_id, []))

    def num_requests(self) -> int:
        return len(self._tables)
