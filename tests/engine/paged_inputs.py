"""Random paged-attention steps for backend tests: metadata whose sequences own shuffled,
non-contiguous cache blocks, and q/k/v with a cache full of stale random values."""

from __future__ import annotations

import torch

from engine.attention.kv_layout import allocate_kv_cache
from engine.attention.metadata import AttentionMetadata, build_metadata


def shuffled_step(
    query_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    num_blocks: int,
    gen: torch.Generator,
    device: torch.device,
) -> AttentionMetadata:
    """Metadata whose sequences own shuffled, non-contiguous cache blocks."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for seq_len in seq_lens:
        n = -(-seq_len // block_size)
        tables.append(perm[used : used + n])
        used += n
    assert used <= num_blocks
    return build_metadata(query_lens, seq_lens, tables, block_size, device)


def random_inputs(
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_blocks: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    device: torch.device,
) -> tuple[torch.Tensor, ...]:
    """q, k, v and a cache pre-filled with random values (stale data must never be read)."""

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    q = rand(num_tokens, num_heads, head_dim)
    k = rand(num_tokens, num_kv_heads, head_dim)
    v = rand(num_tokens, num_kv_heads, head_dim)
    cache = allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    cache.copy_(rand(2, num_blocks, block_size, num_kv_heads, head_dim))
    return q, k, v, cache


def random_step(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_blocks: int,
    gen: torch.Generator,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, ...]:
    """One whole random step: (q, k, v, cache, metadata), the metadata drawn first."""
    meta = shuffled_step(query_lens, seq_lens, block_size, num_blocks, gen, device)
    q, k, v, cache = random_inputs(
        sum(query_lens),
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        num_blocks,
        dtype,
        gen,
        device,
    )
    return q, k, v, cache, meta
