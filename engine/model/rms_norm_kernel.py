"""The RMSNorm C kernel (rms_norm.c), built and loaded through engine.native."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from engine.native import load_kernel_library

SOURCE = Path(__file__).with_name("rms_norm.c")


def load_kernel() -> ctypes.CDLL | None:
    """The compiled library with its signature set, or None where it cannot run here."""
    ptr, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    return load_kernel_library(
        SOURCE,
        baton_rms_norm=[ptr, i64, i64, ptr, f32, ptr],
        baton_add_rms_norm=[ptr, ptr, i64, i64, ptr, f32, ptr, ptr],
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """weight * (x / rms(x)) over the last dim of CPU float32 x [M, E]; None where the kernel
    cannot run here or does not take the shape (the caller then uses torch)."""
    lib = load_kernel()
    if lib is None or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    x = x.contiguous()
    y = torch.empty_like(x)
    rc = lib.baton_rms_norm(
        x.data_ptr(), x.shape[0], x.shape[1], weight.contiguous().data_ptr(), eps, y.data_ptr()
    )
    return y if rc == 0 else None


def add_rms_norm(
    x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(s, y) with s = x + r and y = weight * (s / rms(s)), in one pass (rows in parallel),
    for CPU float32 x, r [M, E]; None where the kernel cannot run here or does not take the
    shape (the caller then uses torch)."""
    lib = load_kernel()
    if (
        lib is None
        or weight.dtype != torch.float32
        or weight.device.type != "cpu"
        or r.shape != x.shape
        or r.dtype != torch.float32
    ):
        return None
    x, r = x.contiguous(), r.contiguous()
    s, y = torch.empty_like(x), torch.empty_like(x)
    rc = lib.baton_add_rms_norm(
        x.data_ptr(),
        r.data_ptr(),
        x.shape[0],
        x.shape[1],
        weight.contiguous().data_ptr(),
        eps,
        s.data_ptr(),
        y.data_ptr(),
    )
    return (s, y) if rc == 0 else None
