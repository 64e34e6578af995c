"""The SwiGLU activation C kernel (swiglu.c), built and loaded through engine.native."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from engine.native import load_kernel_library

SOURCE = Path(__file__).with_name("swiglu.c")


def load_kernel() -> ctypes.CDLL | None:
    """The compiled library with its signature set, or None where it cannot run here."""
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    return load_kernel_library(SOURCE, baton_swiglu=[ptr, i64, i64, i64, ptr])


def swiglu(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up of CPU float32 gate_up [M, 2 I] (gate first) as a contiguous [M, I];
    None where the kernel cannot run here or does not take the shape (the caller uses torch)."""
    lib = load_kernel()
    if (
        lib is None
        or gate_up.dtype != torch.float32
        or gate_up.device.type != "cpu"
        or gate_up.dim() != 2
        or gate_up.stride(1) != 1
        or gate_up.shape[1] % 2
    ):
        return None
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
    rc = lib.baton_swiglu(gate_up.data_ptr(), rows, width // 2, gate_up.stride(0), out.data_ptr())
    return out if rc == 0 else None
