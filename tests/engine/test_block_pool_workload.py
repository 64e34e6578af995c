"""A random workload over BlockPool and KVCacheManager (a Hypothesis state machine):
requests sharing prefixes, chunked allocation, caching, frees, aborts and cache resets, with the
pool's invariants checked after every step."""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.block_pool import BlockPool, KVBlock
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from tests.engine.pool_probes import BS, SEED, free_order, pending_events
from tests.engine.requests import make_request

# The second prefix shares its first block with the first one; () leaves the suffix alone.
PREFIXES = [(), tuple(range(100, 108)), tuple(range(100, 104)) + tuple(range(200, 207))]
NUM_BLOCKS = 8
CHUNK = 8
MAX_LIVE = 3


class Workload(RuleBasedStateMachine):
    """Requests sharing prefixes, chunked allocation, caching, frees and aborts."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.kv = KVCacheManager(self.pool, BS, SEED)
        self.live: dict[str, Request] = {}
        self.pending: dict[str, int] = {}  # tokens allocated, not yet computed
        self.count = 0

    def _snapshot(self) -> tuple:
        return (
            free_order(self.pool),
            [(b.ref_cnt, b.block_hash) for b in self.pool.blocks],
            {rid: self.kv.block_ids(rid) for rid in self.live},
            self.kv.num_requests(),
            pending_events(self.pool),
        )

    def _allocate(self, req: Request, n: int, hits: list[KVBlock] | None = None) -> bool:
        before = self._snapshot()
        ok = self.kv.allocate_slots(req, n, hits)
        if not ok:
            assert self._snapshot() == before
        return ok

    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(0, 2), max_size=9),
        salt=st.sampled_from([None, None, "t"]),
    )
    def add(self, prefix: tuple[int, ...], suffix: list[int], salt: str | None) -> None:
        tokens = list(prefix) + suffix or [7]
        req = make_request(f"r{self.count}", tokens, salt)
        self.count += 1
        cached = self.pool.cached_hashes()
        refs = [b.ref_cnt for b in self.pool.blocks]
        hits = self.kv.get_computed_blocks(req)
        assert [b.ref_cnt for b in self.pool.blocks] == refs  # takes no references
        # The hit is the longest cached run, capped so the last token is computed.
        expect = 0
        while expect < (len(tokens) - 1) // BS and req.block_hashes[expect] in cached:
            expect += 1
        assert len(hits) == expect
        for i, block in enumerate(hits):
            assert block.block_hash == req.block_hashes[i]
            assert block.hash_key[1] == tuple(tokens[i * BS : (i + 1) * BS])
        req.num_computed_tokens = len(hits) * BS
        n = min(req.num_tokens - req.num_computed_tokens, CHUNK)
        if self._allocate(req, n, hits):
            self.live[req.request_id] = req
            self.pending[req.request_id] = n

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """Finish the request's pending chunk, maybe decode a token, allocate the next chunk."""
        rid = data.draw(st.sampled_from(sorted(self.live)))
        req = self.live[rid]
        req.num_computed_tokens += self.pending.pop(rid, 0)
        self.kv.cache_blocks(req, req.num_computed_tokens)
        if req.num_computed_tokens == req.num_tokens:
            req.token_ids.append(data.draw(st.integers(0, 2)))
        n = min(req.num_tokens - req.num_computed_tokens, CHUNK)
        if self._allocate(req, n):
            self.pending[rid] = n

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        """Finish or abort (pending tokens never computed) a request."""
        rid = data.draw(st.sampled_from(sorted(self.live)))
        table = self.kv.blocks(rid)
        refs = {b.block_id: b.ref_cnt for b in table}
        self.kv.free(self.live.pop(rid))
        self.pending.pop(rid, None)
        assert self.kv.block_ids(rid) == []
        for b in table:
            assert b.ref_cnt == refs[b.block_id] - 1
        # Blocks that reached zero joined the back of the queue, tail first.
        released = [b.block_id for b in reversed(table) if b.ref_cnt == 0]
        queue = free_order(self.pool)
        assert queue[len(queue) - len(released) :] == released

    @rule(go=st.integers(0, 3))
    def reset(self, go: int) -> None:
        if go:
            return  # rare: a reset wipes the cache the other rules are building
        in_use_hashed = any(b.ref_cnt > 0 and b.block_hash is not None for b in self.pool.blocks)
        assert self.pool.reset_prefix_cache() is (not in_use_hashed)
        if not in_use_hashed:
            assert self.pool.num_cached_blocks == 0

    @invariant()
    def consistent(self) -> None:
        self.pool.check_integrity()
        holders = Counter(b for rid in self.live for b in self.kv.block_ids(rid))
        assert [b.ref_cnt for b in self.pool.blocks] == [holders[i] for i in range(NUM_BLOCKS)]
        assert self.kv.num_requests() == len(self.live)
        for rid, req in self.live.items():
            table = self.kv.blocks(rid)
            need = req.num_computed_tokens + self.pending.get(rid, 0)
            assert len(table) == -(-need // BS)
            for i, block in enumerate(table):
                if block.block_hash is not None:
                    assert block.block_hash == req.block_hashes[i]
                    assert block.hash_key[1] == tuple(req.token_ids[i * BS : (i + 1) * BS])


Workload.TestCase.settings = settings(max_examples=50, stateful_step_count=60, deadline=None)
TestWorkload = Workload.TestCase
