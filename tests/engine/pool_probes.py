"""Helpers for the block pool's tests: the hashing seed they share, caching a block by hand,
and looks at a pool's free queue and pending events taken on a copy (the pool is untouched)."""

from __future__ import annotations

import copy

from engine.block_hash import hash_block, root_hash
from engine.block_pool import BlockPool, KVBlock, KVEvent
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request

SEED = "pool-test-seed"
ROOT = root_hash(SEED)
BS = 4


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
