"""Attention backends, chosen by name: `torch` (reference, any device) and `triton` (CUDA)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata, build_metadata
from engine.attention.torch_backend import TorchAttentionBackend


def _triton_backend() -> AttentionBackend:
    from engine.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()


BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
    "torch": TorchAttentionBackend,
    "triton": _triton_backend,
}


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto` picks triton on CUDA and torch elsewhere."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(BACKENDS)}")
    return BACKENDS[name]()


__all__ = ["AttentionBackend", "AttentionMetadata", "BACKENDS", "build_metadata",
           "get_attention_backend"]
