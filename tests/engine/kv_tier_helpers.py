"""Shared pieces of the KV tier tests: an identity, a paged cache with distinct block contents,
exact comparisons of blocks."""

from __future__ import annotations

import torch

from engine.attention.kv_layout import allocate_kv_cache
from engine.kv_tier import BlockDestination, KVTier, TierIdentity, block_views

IDENTITY = TierIdentity(
    model_fingerprint="tiny-llama-test",
    hash_seed="tier-test",
    block_size=4,
    dtype="float32",
    num_layers=2,
    num_kv_heads=2,
    head_dim=8,
)
BLOCK_BYTES = IDENTITY.block_bytes  # 2 * 2 * 4 * 2 * 8 * 4 = 1024
# Hashes >= 2**63: msgpack encodes each in 9 bytes, so every block file has the same size.
H = [2**63 + 0x1000 * (i + 1) for i in range(16)]


def empty_cache(num_blocks: int = 8) -> list[torch.Tensor]:
    """Zeroed per-layer caches [2, num_blocks, BS, KVH, D] (head-major storage)."""
    i = IDENTITY
    return [
        allocate_kv_cache(num_blocks, i.block_size, i.num_kv_heads, i.head_dim, torch.float32)
        for _ in range(i.num_layers)
    ]


def paged_cache(num_blocks: int = 8, seed: int = 0) -> list[torch.Tensor]:
    """Per-layer caches of random values."""
    g = torch.Generator().manual_seed(seed)
    out = empty_cache(num_blocks)
    for layer in out:
        layer.copy_(torch.randn(layer.shape, generator=g))
    return out


def block_of(kv: list[torch.Tensor], block_id: int) -> torch.Tensor:
    """One block's KV [L, 2, BS, KVH, D] (a copy)."""
    return torch.stack(block_views(kv, block_id))


def store(tier: KVTier, kv: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
    """Offer (hash, block id) pairs in order and wait until the writer has stored them."""
    for h, bid in pairs:
        assert tier.offer(h, block_views(kv, bid))
    assert tier.flush(timeout=30)


def load(tier: KVTier, hashes: list[int], dst_kv: list[torch.Tensor], ids: list[int]) -> int:
    """Load synchronously; returns the number of leading blocks loaded."""
    handle = tier.load_async(hashes, BlockDestination(dst_kv, ids))
    assert handle.wait(timeout=30)
    return handle.num_loaded


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exactly equal bits (not just values: -0.0 vs 0.0 and NaNs compare too)."""
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))
