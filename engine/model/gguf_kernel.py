"""The GGUF block matmul (gguf_gemm.c): compiled once per machine with the system C compiler,
loaded with ctypes, called on CPU float32 tensors.

The library links the OpenMP runtime by its soname (libgomp.so.1); torch has already loaded
its own copy under that soname, so the kernel's parallel loop runs on torch's thread pool
rather than on a second one competing for the same cores.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("gguf_gemm.c")
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared",
          "-fPIC"]
CPU_FLAGS = ("avx2", "fma", "f16c")
QK = 32  # weights per block
# GGML tensor type id -> (name, bytes per block of 32 weights)
BLOCK_TYPES = {3: ("Q4_1", 20), 8: ("Q8_0", 34)}


def kernel_dir() -> Path:
    """Where the compiled library is cached: $BATON_KERNEL_DIR or ~/.cache/baton/kernels."""
    env = os.environ.get("BATON_KERNEL_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "baton" / "kernels"


def _cpu_supports() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return all(f in flags for f in CPU_FLAGS)


def _build(target: Path) -> None:
    """Compile SOURCE into target atomically (a concurrent build loses the rename harmlessly)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}-", dir=target.parent)
    os.close(fd)
    try:
        compiler = os.environ.get("CC", "cc")
        subprocess.run([compiler, *CFLAGS, "-o", tmp, str(SOURCE)], check=True,
                       capture_output=True, text=True, timeout=120)
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def load_kernel() -> ctypes.CDLL | None:
    """The compiled library, or None (logged once) where this CPU or machine cannot run it."""
    if not _cpu_supports():
        logger.info("GGUF block matmul needs an x86-64 CPU with %s; using dense weights",
                    "/".join(CPU_FLAGS))
        return None
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:16]
    target = kernel_dir() / f"gguf_gemm-{digest}.so"
    try:
        if not target.is_file():
            _build(target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("could not build the GGUF block matmul (%s); using dense weights",
                       str(detail).strip()[:500])
        return None
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    lib.baton_gguf_gemm.argtypes = [ptr, i64, i64, ptr, i64, i32, ptr, ptr]
    lib.baton_gguf_gemm.restype = ctypes.c_int
    lib.baton_gguf_dequantize.argtypes = [ptr, i64, i64, i32, ptr]
    lib.baton_gguf_dequantize.restype = ctypes.c_int
    return lib


def check_blocks(blocks: torch.Tensor, n: int, k: int, block_type: int) -> None:
    if block_type not in BLOCK_TYPES:
        raise ValueError(f"GGML block type {block_type} is not supported (only "
                         f"{sorted(BLOCK_TYPES)})")
    if k % QK:
        raise ValueError(f"in_features={k} is not a multiple of {QK}")
    want = (n, k // QK * BLOCK_TYPES[block_type][1])
    if blocks.dtype != torch.uint8 or tuple(blocks.shape) != want or not blocks.is_contiguous():
        raise ValueError(f"blocks must be contiguous uint8 {want}, got {blocks.dtype} "
                         f"{tuple(blocks.shape)}")


def gguf_matmul(lib: ctypes.CDLL, x: torch.Tensor, blocks: torch.Tensor, block_type: int
                ) -> torch.Tensor:
    """x [M, K] float32 @ W^T where W [N, K] is held in blocks [N, K / 32 * bytes]."""
    m, k = x.shape
    n = blocks.shape[0]
    x = x.contiguous()
    y = torch.empty(m, n, dtype=torch.float32)
    xsum = torch.empty(m * (k // QK), dtype=torch.float32)  # scratch: one sum per x block
    rc = lib.baton_gguf_gemm(x.data_ptr(), m, k, blocks.data_ptr(), n, block_type,
                             xsum.data_ptr(), y.data_ptr())
    if rc != 0:
        check_blocks(blocks, n, k, block_type)
        raise RuntimeError(f"baton_gguf_gemm failed ({rc})")
    return y


def gguf_dequantize(lib: ctypes.CDLL, blocks: torch.Tensor, k: int, block_type: int
                    ) -> torch.Tensor:
    """The float32 weights [N, K] that blocks hold (as gguf-py's dequantize computes them)."""
    n = blocks.shape[0]
    check_blocks(blocks, n, k, block_type)
    out = torch.empty(n, k, dtype=torch.float32)
    if lib.baton_gguf_dequantize(blocks.data_ptr(), n, k, block_type, out.data_ptr()) != 0:
        raise RuntimeError("baton_gguf_dequantize failed")
    return out
