"""BlockPool (ids, reference counts, prefix-cache map, LRU eviction, events) and block hashes."""

from __future__ import annotations

import copy
import hashlib
from collections import Counter

import msgpack
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.block_hash import hash_block, hash_prompt_blocks, root_hash
from engine.block_pool import BlockPool, KVBlock, KVEvent
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams

SEED = "pool-test-seed"
ROOT = root_hash(SEED)
BS = 4


def make_request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), arrival_time=0.0, cache_salt=salt)


def cache(pool: BlockPool, block: KVBlock, parent: int, tokens: tuple[int, ...]) -> int:
    """Register `block` as holding `tokens` after `parent`; returns its hash."""
    h = hash_block(parent, tokens)
    pool.cache_block(block, h, (parent, tokens, ()))
    return h


def free_order(pool: BlockPool) -> list[int]:
    """Block ids in the order allocation would take them (probed on a copy of the pool)."""
    probe = copy.deepcopy(pool)
    return [b.block_id for b in probe.allocate(probe.num_free_blocks)]


def pending_events(pool: BlockPool) -> list[KVEvent]:
    """Events not yet taken (probed on a copy of the pool)."""
    return copy.deepcopy(pool).take_events()


def compute(kv: KVCacheManager, req: Request) -> None:
    """Allocate, 'compute' and cache the whole of req's tokens."""
    assert kv.allocate_slots(req, req.num_tokens - req.num_computed_tokens)
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req, req.num_computed_tokens)


# ---- allocation, reference counts, free order ---------------------------------------------
def test_pool_needs_a_block():
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        BlockPool(0)


def test_allocate_takes_ids_in_free_queue_order():
    pool = BlockPool(5)
    a = pool.allocate(2)
    assert [b.block_id for b in a] == [0, 1]
    assert [b.ref_cnt for b in a] == [1, 1]
    assert pool.num_free_blocks == 3
    assert pool.usage() == pytest.approx(0.4)
    b = pool.allocate(3)
    assert [x.block_id for x in b] == [2, 3, 4]
    assert pool.num_free_blocks == 0
    assert pool.usage() == 1.0
    assert pool.allocate(0) == []
    pool.check_integrity()


def test_freed_blocks_go_to_the_back_in_the_order_given():
    pool = BlockPool(6)
    blocks = pool.allocate(4)  # 0..3; queue [4, 5]
    pool.free([blocks[2], blocks[0]])
    assert free_order(pool) == [4, 5, 2, 0]
    assert [b.block_id for b in pool.allocate(4)] == [4, 5, 2, 0]
    assert [b.ref_cnt for b in pool.blocks] == [1, 1, 1, 1, 1, 1]
    pool.check_integrity()


def test_touch_and_free_reference_counts():
    pool = BlockPool(4)
    (b0,) = pool.allocate(1)
    pool.touch([b0])
    assert b0.ref_cnt == 2
    pool.free([b0])
    assert b0.ref_cnt == 1
    assert pool.num_free_blocks == 3  # still held: not back in the queue
    assert free_order(pool) == [1, 2, 3]
    pool.free([b0])
    assert b0.ref_cnt == 0
    assert free_order(pool) == [1, 2, 3, 0]
    pool.check_integrity()


def test_touch_pulls_a_cached_block_off_the_free_queue():
    pool = BlockPool(4)
    (b0,) = pool.allocate(1)
    h = cache(pool, b0, ROOT, (1, 2, 3, 4))
    pool.free([b0])
    assert free_order(pool) == [1, 2, 3, 0]
    pool.touch([b0])
    assert b0.ref_cnt == 1
    assert free_order(pool) == [1, 2, 3]
    # Allocating everything left cannot evict the touched block.
    assert [b.block_id for b in pool.allocate(3)] == [1, 2, 3]
    assert pool.cached_hashes() == {h}
    assert pool.lookup(h, (ROOT, (1, 2, 3, 4), ())) is b0
    pool.check_integrity()


def test_double_free_raises():
    pool = BlockPool(4)
    (b0,) = pool.allocate(1)
    pool.free([b0])
    with pytest.raises(RuntimeError, match="double free of block 0"):
        pool.free([b0])
    with pytest.raises(RuntimeError, match="double free of block 3"):
        pool.free([pool.blocks[3]])  # never allocated
    assert [b.ref_cnt for b in pool.blocks] == [0, 0, 0, 0]
    assert free_order(pool) == [1, 2, 3, 0]
    pool.check_integrity()


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(4)
    pool.allocate(1)
    with pytest.raises(RuntimeError, match="cannot allocate 4 blocks: only 3 free"):
        pool.allocate(4)
    assert free_order(pool) == [1, 2, 3]
    assert [b.ref_cnt for b in pool.blocks] == [1, 0, 0, 0]
    pool.check_integrity()


# ---- the prefix-cache map ------------------------------------------------------------------
def test_lookup_rechecks_the_hash_key():
    pool = BlockPool(4)
    (b0,) = pool.allocate(1)
    h = cache(pool, b0, ROOT, (1, 2, 3, 4))
    assert b0.block_hash == h
    assert b0.hash_key == (ROOT, (1, 2, 3, 4), ())
    assert pool.lookup(h, (ROOT, (1, 2, 3, 4), ())) is b0
    # Same hash, different content (a collision): not a hit.
    assert pool.lookup(h, (ROOT, (1, 2, 3, 5), ())) is None
    assert pool.lookup(h, (ROOT + 1, (1, 2, 3, 4), ())) is None
    assert pool.lookup(h, (ROOT, (1, 2, 3, 4), ("salt",))) is None
    assert pool.lookup(h + 1, (ROOT, (1, 2, 3, 4), ())) is None
    assert pool.num_cached_blocks == 1
    pool.check_integrity()


def test_cache_block_on_existing_hash_keeps_the_first_block_canonical():
    pool = BlockPool(4)
    first, second = pool.allocate(2)
    key = (ROOT, (5, 6, 7, 8), ())
    h = cache(pool, first, ROOT, (5, 6, 7, 8))
    pool.cache_block(second, h, key)
    assert first.block_hash == h
    assert second.block_hash is None and second.hash_key is None
    assert pool.lookup(h, key) is first
    assert pool.num_cached_blocks == 1
    assert pool.take_events() == [KVEvent("stored", (h,), ROOT)]
    # Freeing both: only the canonical one stays cached; evicting the duplicate says nothing.
    pool.free([second, first])
    assert free_order(pool) == [2, 3, 1, 0]
    assert [b.block_id for b in pool.allocate(3)] == [2, 3, 1]
    assert pool.take_events() == []
    assert pool.lookup(h, key) is first
    pool.check_integrity()


def test_cache_block_on_an_already_hashed_block_is_a_no_op():
    pool = BlockPool(2)
    (b0,) = pool.allocate(1)
    h1 = cache(pool, b0, ROOT, (1, 1, 1, 1))
    h2 = hash_block(ROOT, (2, 2, 2, 2))
    pool.cache_block(b0, h2, (ROOT, (2, 2, 2, 2), ()))
    assert b0.block_hash == h1
    assert pool.cached_hashes() == {h1}
    assert pool.lookup(h2, (ROOT, (2, 2, 2, 2), ())) is None
    assert pool.take_events() == [KVEvent("stored", (h1,), ROOT)]
    pool.check_integrity()


def test_cache_block_does_nothing_when_caching_is_off():
    pool = BlockPool(2, enable_caching=False)
    (b0,) = pool.allocate(1)
    h = cache(pool, b0, ROOT, (1, 2, 3, 4))
    assert b0.block_hash is None
    assert pool.lookup(h, (ROOT, (1, 2, 3, 4), ())) is None
    assert pool.num_cached_blocks == 0
    assert pool.take_events() == []
    pool.check_integrity()


def test_stored_and_removed_events_in_exact_order():
    pool = BlockPool(3)
    b0, b1 = pool.allocate(2)
    h0 = cache(pool, b0, ROOT, (1, 2, 3, 4))
    h1 = cache(pool, b1, h0, (5, 6, 7, 8))
    assert pool.take_events() == [KVEvent("stored", (h0,), ROOT), KVEvent("stored", (h1,), h0)]
    assert pool.take_events() == []
    pool.free([b1, b0])  # tail first: queue [2, 1, 0]
    assert pool.take_events() == []  # freeing keeps them cached
    assert [b.block_id for b in pool.allocate(1)] == [2]
    assert pool.take_events() == []  # block 2 carried no hash
    assert [b.block_id for b in pool.allocate(2)] == [1, 0]
    assert pool.take_events() == [KVEvent("removed", (h1,)), KVEvent("removed", (h0,))]
    assert pool.stats.evictions == 2
    assert pool.num_cached_blocks == 0
    assert all(b.block_hash is None and b.hash_key is None for b in pool.blocks)
    pool.check_integrity()


def test_reset_prefix_cache():
    pool = BlockPool(4)
    b0, b1, b2 = pool.allocate(3)
    h0 = cache(pool, b0, ROOT, (1, 2, 3, 4))
    h1 = cache(pool, b1, h0, (5, 6, 7, 8))
    pool.take_events()
    pool.free([b1, b2])  # b0 (hashed) still in use
    assert pool.reset_prefix_cache() is False
    assert pool.cached_hashes() == {h0, h1}
    assert pool.take_events() == []
    assert pool.stats.evictions == 0
    pool.free([b0])
    assert free_order(pool) == [3, 1, 2, 0]
    assert pool.reset_prefix_cache() is True
    assert pool.cached_hashes() == set()
    assert pool.take_events() == [KVEvent("removed", (h0,)), KVEvent("removed", (h1,))]
    assert pool.lookup(h0, (ROOT, (1, 2, 3, 4), ())) is None
    assert free_order(pool) == [3, 1, 2, 0]  # queue order untouched
    assert pool.num_free_blocks == 4
    assert pool.reset_prefix_cache() is True  # nothing left: still succeeds
    assert pool.take_events() == []
    pool.check_integrity()


def test_eviction_follows_free_order_tail_first_through_the_manager():
    pool = BlockPool(6)
    kv = KVCacheManager(pool, 2, SEED)
    req = make_request("a", [1, 2, 3, 4, 5, 6])
    compute(kv, req)
    assert kv.block_ids("a") == [0, 1, 2]
    h0, h1, h2 = req.block_hashes
    assert pool.cached_hashes() == {h0, h1, h2}
    kv.free(req)
    assert free_order(pool) == [3, 4, 5, 2, 1, 0]
    pool.take_events()
    assert [b.block_id for b in pool.allocate(4)] == [3, 4, 5, 2]
    assert pool.cached_hashes() == {h0, h1}  # the tail went first
    assert [b.block_id for b in pool.allocate(1)] == [1]
    assert pool.cached_hashes() == {h0}
    assert pool.take_events() == [KVEvent("removed", (h2,)), KVEvent("removed", (h1,))]
    # The head is still a hit for a request sharing the first two tokens.
    other = make_request("b", [1, 2, 9, 9, 9])
    assert [b.block_id for b in kv.get_computed_blocks(other)] == [0]
    pool.check_integrity()


# ---- check_integrity -----------------------------------------------------------------------
def _pool_with_every_state() -> tuple[BlockPool, list[KVBlock]]:
    """Block 0 cached, block 1 in use and hashed, block 2 in use, block 3 free."""
    pool = BlockPool(4)
    b0, b1, b2 = pool.allocate(3)
    h0 = cache(pool, b0, ROOT, (1, 2, 3, 4))
    cache(pool, b1, h0, (5, 6, 7, 8))
    pool.free([b0])
    return pool, [b0, b1, b2, pool.blocks[3]]


def test_check_integrity_passes_on_a_consistent_pool():
    pool, _ = _pool_with_every_state()
    pool.check_integrity()


def _ref_on_free_block(pool: BlockPool, b: list[KVBlock]) -> None:
    b[3].ref_cnt = 1


def _negative_ref(pool: BlockPool, b: list[KVBlock]) -> None:
    b[3].ref_cnt = -1


def _in_use_swapped_with_free(pool: BlockPool, b: list[KVBlock]) -> None:
    b[2].ref_cnt, b[3].ref_cnt = 0, 1  # counts still add up; the queue holds the wrong block


def _stray_hash(pool: BlockPool, b: list[KVBlock]) -> None:
    b[3].block_hash = 12345


def _map_points_elsewhere(pool: BlockPool, b: list[KVBlock]) -> None:
    pool._cached[b[0].block_hash] = b[2]


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (_ref_on_free_block, "free queue holds 2 blocks, expected 1"),
        (_negative_ref, r"free 0 \+ cached 1 \+ in use 2 != total 4"),
        (_in_use_swapped_with_free, "a block with ref_cnt 0 is missing from the free queue"),
        (_stray_hash, "3 blocks carry a hash, map has 2"),
        (_map_points_elsewhere, "cache map entry .* points at block 2"),
    ],
)
def test_check_integrity_raises_on_corruption(corrupt, message):
    pool, blocks = _pool_with_every_state()
    corrupt(pool, blocks)
    with pytest.raises(AssertionError, match=message):
        pool.check_integrity()


# ---- hashing -------------------------------------------------------------------------------
def test_root_and_block_hash_follow_the_documented_formula():
    digest = hashlib.blake2b(msgpack.packb(["baton-root", SEED]), digest_size=8).digest()
    assert root_hash(SEED) == int.from_bytes(digest, "little")
    payload = msgpack.packb([ROOT, [1, 2, 3, 4], ["s"]])
    expected = int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little")
    assert hash_block(ROOT, (1, 2, 3, 4), ("s",)) == expected
    assert hash_block(ROOT, [1, 2, 3, 4], ("s",)) == expected  # list or tuple alike


def test_hashes_are_chained():
    tokens = list(range(12))
    h = hash_prompt_blocks(tokens, BS, SEED)
    assert h == [
        hash_block(ROOT, tokens[0:4]),
        hash_block(h[0], tokens[4:8]),
        hash_block(h[1], tokens[8:12]),
    ]
    assert len(set(h)) == 3
    changed0 = hash_prompt_blocks([99] + tokens[1:], BS, SEED)
    assert all(a != b for a, b in zip(h, changed0, strict=True))
    changed1 = hash_prompt_blocks(tokens[:5] + [99] + tokens[6:], BS, SEED)
    assert changed1[0] == h[0]
    assert changed1[1] != h[1] and changed1[2] != h[2]


def test_same_prefix_same_hashes_and_partial_block_not_hashed():
    tokens = list(range(12))
    h = hash_prompt_blocks(tokens, BS, SEED)
    diverging = hash_prompt_blocks(tokens[:9] + [77, 78, 79], BS, SEED)
    assert diverging[:2] == h[:2]
    assert diverging[2] != h[2]
    assert hash_prompt_blocks(tokens[:11], BS, SEED) == h[:2]
    assert hash_prompt_blocks(tokens[:3], BS, SEED) == []
    assert hash_prompt_blocks(tokens + [1, 2, 3], BS, SEED) == h


def test_seed_changes_every_hash():
    tokens = list(range(12))
    a = hash_prompt_blocks(tokens, BS, "seed-a")
    b = hash_prompt_blocks(tokens, BS, "seed-b")
    assert root_hash("seed-a") != root_hash("seed-b")
    assert all(x != y for x, y in zip(a, b, strict=True))
    assert hash_prompt_blocks(tokens, BS, "seed-a") == a  # deterministic


def test_salt_changes_every_hash():
    tokens = list(range(12))
    plain = hash_prompt_blocks(tokens, BS, SEED)
    a = hash_prompt_blocks(tokens, BS, SEED, cache_salt="a")
    b = hash_prompt_blocks(tokens, BS, SEED, cache_salt="b")
    assert a[0] == hash_block(ROOT, tokens[:4], ("a",))
    assert a[1] == hash_block(a[0], tokens[4:8])  # salt is an extra key of block 0 only
    for i in range(3):
        assert len({plain[i], a[i], b[i]}) == 3


def test_incremental_hashing_matches_the_whole_prompt():
    tokens = list(range(20))
    full = hash_prompt_blocks(tokens, BS, SEED, cache_salt="t")
    assert hash_prompt_blocks(tokens, BS, SEED, "t", start=2, parent=full[1]) == full[2:]
    assert hash_prompt_blocks(tokens, BS, SEED, "t", start=5, parent=full[4]) == []
    with pytest.raises(ValueError, match="parent hash is required when start > 0"):
        hash_prompt_blocks(tokens, BS, SEED, start=1)


def test_salts_do_not_share_cached_blocks():
    pool = BlockPool(16)
    kv = KVCacheManager(pool, BS, SEED)
    tokens = list(range(9))
    reqs = {salt: make_request(f"r-{salt}", tokens, salt) for salt in ("a", "b", None)}
    for r in reqs.values():
        kv.update_block_hashes(r)
    hashes = [r.block_hashes for r in reqs.values()]
    assert all(len(h) == 2 for h in hashes)
    assert len({h for hs in hashes for h in hs}) == 6
    compute(kv, reqs["a"])
    # The salt is part of the re-checked key of block 0 only.
    first, second = kv.blocks("r-a")[:2]
    assert first.hash_key == (ROOT, (0, 1, 2, 3), ("a",))
    assert second.hash_key == (reqs["a"].block_hashes[0], (4, 5, 6, 7), ())
    kv.free(reqs["a"])
    # Only the same salt hits.
    again = {salt: make_request(f"s-{salt}", tokens, salt) for salt in ("a", "b", None)}
    assert [b.block_id for b in kv.get_computed_blocks(again["a"])] == [0, 1]
    assert kv.get_computed_blocks(again["b"]) == []
    assert kv.get_computed_blocks(again[None]) == []
    compute(kv, reqs[None])
    assert kv.get_computed_blocks(again["b"]) == []
    assert [b.block_id for b in kv.get_computed_blocks(again[None])] == kv.block_ids("r-None")[:2]
    assert [b.block_id for b in kv.get_computed_blocks(again["a"])] == [0, 1]
    pool.check_integrity()


# ---- a random workload ---------------------------------------------------------------------
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
