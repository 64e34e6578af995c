"""The CPU attention backend: the torch backend, with decode tokens attended by a C kernel
straight over the paged cache (paged_decode.c) instead of gathering their context first.

A 32-sequence decode step of SmolLM2 spent ~13 ms gathering context blocks and ~10 ms in
the attention matmuls; the kernel reads every key and value once, in place. Prefill chunks
keep the torch path (SDPA's flash kernel). float32 only; other dtypes use the torch path.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from engine.attention.torch_backend import TorchAttentionBackend, _StepPlan
from engine.native import load_native

SOURCE = Path(__file__).with_name("paged_decode.c")


@functools.cache
def load_kernel() -> ctypes.CDLL | None:
    """The compiled kernel with its signature set, or None where it cannot run here."""
    lib = load_native(SOURCE)
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.baton_paged_decode.argtypes = [
        ptr,
        ptr,
        i64,
        i64,
        i64,
        i64,
        ptr,
        i64,
        ptr,
        i64,
        i64,
        i64,
        i64,
        i64,
        ctypes.c_float,
        ptr,
    ]
    lib.baton_paged_decode.restype = ctypes.c_int
    return lib


class CpuAttentionBackend(TorchAttentionBackend):
    """TorchAttentionBackend whose decode attention runs in a C kernel over the paged cache."""

    name = "cpu"

    def __init__(self, lib: ctypes.CDLL) -> None:
        super().__init__()
        self._lib = lib

    def _decode(
        self, q: torch.Tensor, blocks: torch.Tensor, plan: _StepPlan, scale: float
    ) -> torch.Tensor:
        """q: [T, H, D]; blocks: [2, KVH, num_blocks, block_size, D]. Returns [Bd, H, D]."""
        if q.dtype != torch.float32 or q.device.type != "cpu":
            return super()._decode(q, blocks, plan, scale)
        qd = (q if plan.all_decode else q.index_select(0, plan.decode_rows)).contiguous()
        out = torch.empty_like(qd)
        _, num_kv_heads, _, block_size, head_dim = blocks.shape
        tables = plan.decode_blocks  # [Bd, blocks] int64, contiguous
        rc = self._lib.baton_paged_decode(
            qd.data_ptr(),
            blocks.data_ptr(),
            *blocks.stride()[:4],
            tables.data_ptr(),
            tables.shape[1],
            plan.decode_lens.data_ptr(),
            qd.shape[0],
            qd.shape[1],
            num_kv_heads,
            head_dim,
            block_size,
            scale,
            out.data_ptr(),
        )
        if rc != 0:  # a shape the kernel does not take (or no scratch memory)
            return super()._decode(q, blocks, plan, scale)
        return out
