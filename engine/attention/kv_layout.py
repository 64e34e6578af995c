"""Memory layout of one layer's paged KV cache.

Logical shape (what every caller indexes): [2, num_blocks, block_size, num_kv_heads, head_dim].
Physical storage is head-major, [2, num_kv_heads, num_blocks, block_size, head_dim], so the
torch path gathers a head's context as rows of one matrix ([KVH, slots, D]) and feeds batched
matmuls without transposing copies. Kernels and transfers use strides and see no difference.
"""

from __future__ import annotations

import torch


def allocate_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Zeroed cache for one layer: the logical view over head-major storage."""
    storage = torch.zeros(
        2, num_kv_heads, num_blocks, block_size, head_dim, dtype=dtype, device=device
    )
    return storage.permute(0, 2, 3, 1, 4)


def head_major(kv_cache: torch.Tensor) -> torch.Tensor:
    """[2, KVH, num_blocks, block_size, D] contiguous view of a cache from allocate_kv_cache()."""
    storage = kv_cache.permute(0, 3, 1, 2, 4)
    if not storage.is_contiguous():
        raise ValueError("KV cache is not head-major; allocate it with allocate_kv_cache()")
    return storage
