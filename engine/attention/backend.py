"""The attention backend contract; implementations are chosen by name in the registry."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from engine.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Paged causal attention over a flattened batch of prefill chunks and decode tokens.

    kv_cache for one layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
    (index 0 keys, 1 values). q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim].
    """

    name: str = ""

    def begin_step(self, meta: AttentionMetadata) -> None:  # noqa: B027 - optional hook
        """Precompute per-step state shared by every layer (may do nothing)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Write k, v into kv_cache at meta.slot_mapping, then return attention [T, H, D]."""
