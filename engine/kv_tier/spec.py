"""What a KV tier stores and reports: the identity of its blocks and its statistics.

A tier holds the KV of whole blocks, keyed by block hash. One block's KV is one tensor
[num_layers, 2, block_size, num_kv_heads, head_dim] (keys then values of every layer, in the
logical order of the paged cache): `TierIdentity.block_shape`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TierIdentity:
    """What makes stored KV valid for an engine: the same model (and arithmetic), the same
    hash chain and the same block geometry. A disk tier rejects files of any other identity."""

    model_fingerprint: str  # engine/kv_tier/fingerprint.py: weights + options that change KV
    hash_seed: str
    block_size: int
    dtype: str  # a torch dtype name: "float32", "bfloat16", "float16"
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(f"dtype {self.dtype!r} is not a torch dtype name")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """[num_layers, 2, block_size, num_kv_heads, head_dim]"""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        n = 1
        for d in self.block_shape:
            n *= d
        return n * self.torch_dtype.itemsize


@dataclass(slots=True)
class TierCounters:
    """Running counts of one tier (mutated under the tier's lock)."""

    queries: int = 0  # blocks looked up
    hits: int = 0  # leading blocks found
    blocks_written: int = 0
    bytes_written: int = 0
    blocks_read: int = 0
    bytes_read: int = 0
    loads: int = 0  # finished load_async calls
    load_seconds: float = 0.0  # sum over loads: load_async -> done
    dropped_writes: int = 0  # offers refused because the write queue was full
    rejected_writes: int = 0  # writes that found no room (block over capacity, all pinned)
    failed_writes: int = 0  # writes that raised (e.g. disk full)
    evictions: int = 0  # blocks removed to make room (LRU)
    truncated_dropped: int = 0  # files shorter than their header says (or left-over .tmp)
    corrupted_dropped: int = 0  # bad magic, header checksum, payload checksum or size
    foreign_dropped: int = 0  # another model, hash seed, block size, dtype or shape


@dataclass(frozen=True, slots=True)
class TierStats:
    """A snapshot of a tier's counters and occupancy."""

    medium: str
    capacity_bytes: int
    usage_bytes: int
    num_blocks: int
    queries: int = 0
    hits: int = 0
    blocks_written: int = 0
    bytes_written: int = 0
    blocks_read: int = 0
    bytes_read: int = 0
    loads: int = 0
    load_seconds: float = 0.0
    dropped_writes: int = 0
    rejected_writes: int = 0
    failed_writes: int = 0
    evictions: int = 0
    truncated_dropped: int = 0
    corrupted_dropped: int = 0
    foreign_dropped: int = 0
