"""Block hashes: the documented formula, chaining, seeds and cache salts (a salted prompt
never shares cached blocks with another salt)."""

from __future__ import annotations

import hashlib

import msgpack
import pytest

from engine.block_hash import hash_block, hash_prompt_blocks, root_hash
from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager
from tests.engine.pool_probes import BS, ROOT, SEED, compute
from tests.engine.requests import make_request


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
