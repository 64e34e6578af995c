"""Attention backends, chosen by name: `torch` (reference, any device), `cpu` (torch with a C
decode kernel) and `triton` (CUDA)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata, build_metadata
from engine.attention.torch_backend import TorchAttentionBackend


def _triton_backend() -> AttentionBackend:
    from engine.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()


def _cpu_backend() -> AttentionBackend:
    from engine.attention.cpu_backend import CpuAttentionBackend, load_kernel

    lib = load_kernel()
    if lib is None:
        raise ValueError(
            "the cpu attention backend needs an x86-64 CPU with AVX2/FMA/F16C "
            "and a C compiler; use torch"
        )
    return CpuAttentionBackend(lib)


BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
    "torch": TorchAttentionBackend,
    "cpu": _cpu_backend,
    "triton": _triton_backend,
}


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto` picks triton on CUDA; on CPU, cpu where its C decode kernel builds, else torch."""
    if name == "auto":
        if device.type == "cuda":
            name = "triton"
        else:
            from engine.attention.cpu_backend import load_kernel

            name = "cpu" if load_kernel() is not None else "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(BACKENDS)}")
    return BACKENDS[name]()


__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "BACKENDS",
    "build_metadata",
    "get_attention_backend",
]
