"""The GGUF block matmul (gguf_gemm.c), built and loaded through engine.native, called on CPU
float32 tensors."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from engine.native import load_native
from engine.weights.gguf_convert import KEPT_BLOCK_TYPES

SOURCE = Path(__file__).with_name("gguf_gemm.c")
QK = 32  # weights per block


@functools.cache
def load_kernel() -> ctypes.CDLL | None:
    """The compiled library with its signatures set, or None where it cannot run here."""
    lib = load_native(SOURCE)
    if lib is None:
        return None
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    lib.baton_gguf_gemm.argtypes = [ptr, i64, i64, ptr, i64, i32, ptr, ptr]
    lib.baton_gguf_gemm.restype = ctypes.c_int
    lib.baton_gguf_dequantize.argtypes = [ptr, i64, i64, i32, ptr]
    lib.baton_gguf_dequantize.restype = ctypes.c_int
    return lib


def check_blocks(blocks: torch.Tensor, n: int, k: int, block_type: int) -> None:
    if block_type not in KEPT_BLOCK_TYPES:
        raise ValueError(
            f"GGML block type {block_type} is not supported (only {sorted(KEPT_BLOCK_TYPES)})"
        )
    if k % QK:
        raise ValueError(f"in_features={k} is not a multiple of {QK}")
    want = (n, k // QK * KEPT_BLOCK_TYPES[block_type])
    if blocks.dtype != torch.uint8 or tuple(blocks.shape) != want or not blocks.is_contiguous():
        raise ValueError(
            f"blocks must be contiguous uint8 {want}, got {blocks.dtype} {tuple(blocks.shape)}"
        )


def gguf_matmul(
    lib: ctypes.CDLL, x: torch.Tensor, blocks: torch.Tensor, block_type: int
) -> torch.Tensor:
    """x [M, K] float32 @ W^T where W [N, K] is held in blocks [N, K / 32 * bytes]."""
    m, k = x.shape
    n = blocks.shape[0]
    x = x.contiguous()
    y = torch.empty(m, n, dtype=torch.float32)
    xsum = torch.empty(m * (k // QK), dtype=torch.float32)  # scratch: one sum per x block
    rc = lib.baton_gguf_gemm(
        x.data_ptr(), m, k, blocks.data_ptr(), n, block_type, xsum.data_ptr(), y.data_ptr()
    )
    if rc != 0:
        check_blocks(blocks, n, k, block_type)
        raise RuntimeError(f"baton_gguf_gemm failed ({rc})")
    return y


def gguf_dequantize(
    lib: ctypes.CDLL, blocks: torch.Tensor, k: int, block_type: int
) -> torch.Tensor:
    """The float32 weights [N, K] that blocks hold (as gguf-py's dequantize computes them)."""
    n = blocks.shape[0]
    check_blocks(blocks, n, k, block_type)
    out = torch.empty(n, k, dtype=torch.float32)
    if lib.baton_gguf_dequantize(blocks.data_ptr(), n, k, block_type, out.data_ptr()) != 0:
        raise RuntimeError("baton_gguf_dequantize failed")
    return out
