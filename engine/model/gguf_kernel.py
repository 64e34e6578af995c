"""The GGUF block matmul (gguf_gemm.c), built and loaded through engine.native, called on CPU
float32 tensors.

Exact path (the default): two instruction sets, picked at run time: every product has an
AVX2 + FMA kernel; a single row (batch-1 decode) of a Q4_1 matrix takes the AVX-512 kernel
where the CPU has AVX-512 F/BW/VL (cpuid, checked in C) unless the engine option gguf_isa
forces the AVX2 one. Both compute the same float32 products of the same weights; only the
summation order differs.

int8 activations (opt-in, gguf_matmul_int8): x is quantized to int8 per 32 values and each
block's dot product is an integer sum (llama.cpp's arithmetic, see gguf_gemm.c). Three
instruction sets: AVX2 (maddubs), AVX-VNNI (ymm vpdpbusd), AVX-512 VNNI (zmm vpdpbusd); the
best the CPU has unless gguf_isa forces one (int8_isa).

The fused decode step's products of many rows (32 or more: prompt chunks, wide decode steps)
run on AMX tiles where the CPU has them (amx_products; gemm_amx.c: bfloat16 tile products kept
float32-accurate by splitting each input into three bfloat16 parts), else by lanes on AVX-512.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from engine.errors import InvalidRequestError
from engine.native import load_kernel_library
from engine.options import GGUF_ISA_NAMES
from engine.weights.gguf_convert import KEPT_BLOCK_TYPES

SOURCE = Path(__file__).with_name("gguf_gemm.c")
QK = 32  # weights per block
Q4_1 = 3  # GGML type id. Q4_1 rows take the AVX-512 kernel wherever it is chosen:
# measured on this project's EPYC (2 threads, SmolLM2 shapes) it is 1.2-1.3x faster than AVX2
# for Q4_1, but 2x slower for the 49,152-row Q8_0 output projection, which AVX2 already reads
# at ~26 GB/s there. Q8_0 rows take it only where AMX is on too (q8_0_rows_avx512).
# gguf_isa values other than "auto" (EngineOptions) -> (float32 single-row kernel, int8 kernel).
# "avx2" forces AVX2 for both.
ISA_CHOICES = {
    "avx2": ("avx2", "avx2"),
    "avxvnni": ("avx2", "avxvnni"),
    "avx512": ("avx512", "avx512vnni"),
    "avx512vnni": ("avx512", "avx512vnni"),
    "amx": ("avx512", "avx512vnni"),  # and the fused step's products of many rows on AMX
}
INT8_ISA_IDS = {"avx2": 1, "avxvnni": 2, "avx512vnni": 3}  # BATON_I8_* in gguf_gemm.c


def load_kernel() -> ctypes.CDLL | None:
    """The compiled library with its signatures set, or None where it cannot run here."""
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    return load_kernel_library(
        SOURCE,
        baton_gguf_gemm=[ptr, i64, i64, ptr, i64, i32, ptr, ptr],
        baton_gguf_dequantize=[ptr, i64, i64, i32, ptr],
        baton_gguf_gemv_avx512=[ptr, i64, ptr, i64, i32, ptr],
        baton_gguf_gemm_panel=[ptr, i64, i64, ptr, i64, i32, ptr],
        baton_gguf_gemm_lanes=[ptr, i64, i64, ptr, i64, i32, ptr],
        baton_gguf_gemm_amx=[ptr, i64, i64, ptr, i64, i32, ptr],
        baton_cpu_has_avx512=[],
        baton_cpu_has_amx=[],
        baton_cpu_int8_isas=[],
        baton_quantize_row_q8=[ptr, i64, ptr, ptr, ptr],
        baton_gguf_gemm_q8=[ptr, ptr, ptr, i64, i64, ptr, i64, i32, i32, ptr],
        baton_gguf_gemm_q8_f32=[ptr, i64, i64, ptr, i64, i32, i32, ptr, ptr],
    )


def _forced_isa(choice: str) -> str:
    """The ISA_CHOICES key a gguf_isa value forces ("" for auto); an error names the option."""
    if choice not in GGUF_ISA_NAMES:
        raise InvalidRequestError(f"gguf_isa={choice!r}: choose {', '.join(GGUF_ISA_NAMES)}")
    return "" if choice == "auto" else choice


INT8_PREFERENCE = ("avxvnni", "avx512vnni", "avx2")  # fastest first: measured, see gguf_gemm.c


def int8_isas(lib: ctypes.CDLL) -> list[str]:
    """The int8 instruction sets this CPU runs, by cpuid (checked in C)."""
    bits = lib.baton_cpu_int8_isas()
    return [name for name, i in INT8_ISA_IDS.items() if bits & (1 << i)]


def int8_isa(lib: ctypes.CDLL, choice: str = "auto") -> str:
    """The instruction set of the int8 kernels here for the gguf_isa option `choice`: auto,
    the first of INT8_PREFERENCE this CPU has (ymm AVX-VNNI measured fastest, then AVX-512
    VNNI, AVX2); else the one it forces (InvalidRequestError where the CPU lacks it)."""
    forced = _forced_isa(choice)
    have = int8_isas(lib)
    if forced:
        want = ISA_CHOICES[forced][1]
        if want not in have:
            raise InvalidRequestError(
                f"gguf_isa={forced} but this CPU lacks {want} (it has {have})"
            )
        return want
    return next(isa for isa in INT8_PREFERENCE if isa in have)


def gemv_isa(lib: ctypes.CDLL, choice: str = "auto") -> str:
    """The instruction set single-row float32 products use here for the gguf_isa option
    `choice`: "avx512" or "avx2" (InvalidRequestError where it forces AVX-512 on a CPU
    without it)."""
    forced = _forced_isa(choice)
    forced = ISA_CHOICES[forced][0] if forced else ""
    has_avx512 = bool(lib.baton_cpu_has_avx512())
    if forced == "avx512" and not has_avx512:
        raise InvalidRequestError(f"gguf_isa={choice} but this CPU lacks AVX-512 F/BW/VL")
    return "avx2" if forced == "avx2" or not has_avx512 else "avx512"


def amx_products(lib: ctypes.CDLL, choice: str = "auto") -> bool:
    """Whether the fused step multiplies many rows (32 or more) on AMX tiles (gemm_amx.c) for
    the gguf_isa option `choice`: auto where this CPU and OS have AMX with bfloat16 products,
    amx forces it (InvalidRequestError where they lack it), any other value turns it off."""
    forced = _forced_isa(choice)
    if forced and forced != "amx":
        return False
    has_amx = bool(lib.baton_cpu_has_amx())
    if forced == "amx" and not has_amx:
        raise InvalidRequestError(
            "gguf_isa=amx but this CPU or OS lacks AMX tiles with bfloat16 products"
        )
    return has_amx


def q8_0_rows_avx512(lib: ctypes.CDLL, choice: str = "auto") -> bool:
    """Whether single rows of Q8_0 weights (SmolLM2's output projection) take the AVX-512
    kernel as Q4_1 rows do, for the gguf_isa option `choice`: where the products of many rows
    run on AMX (amx_products). AMX marks Intel's server cores, whose 512-bit units are full
    width, and there the AVX-512 kernel is the faster for these rows (measured:
    docs/design/cpu-kernels.md), while Zen 4 splits 512-bit operations in two and its AVX2
    kernel was the faster (above)."""
    return amx_products(lib, choice)


@functools.cache
def _auto_isas(lib: ctypes.CDLL) -> tuple[str, str]:
    """(gemv_isa, int8_isa) with gguf_isa auto, once per library."""
    return gemv_isa(lib), int8_isa(lib)


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
    lib: ctypes.CDLL,
    x: torch.Tensor,
    blocks: torch.Tensor,
    block_type: int,
    isa: str | None = None,
    q8_0_avx512: bool = False,
) -> torch.Tensor:
    """x [M, K] float32 @ W^T where W [N, K] is held in blocks [N, K / 32 * bytes]. isa
    ("avx2" / "avx512") picks the single-row kernel; None: gemv_isa's choice. AVX-512 takes
    Q4_1 rows, and Q8_0 rows where q8_0_avx512 (q8_0_rows_avx512's answer); it falls back to
    AVX2 where the CPU lacks it."""
    m, k = x.shape
    n = blocks.shape[0]
    x = x.contiguous()
    y = torch.empty(m, n, dtype=torch.float32)
    xsum = torch.empty(m * (k // QK), dtype=torch.float32)  # scratch: one sum per x block
    if isa is None:
        isa = _auto_isas(lib)[0]
    if m == 1 and isa == "avx512" and (block_type == Q4_1 or q8_0_avx512):
        rc = lib.baton_gguf_gemv_avx512(
            x.data_ptr(), k, blocks.data_ptr(), n, block_type, y.data_ptr()
        )
        if rc == 0:
            return y
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


def gguf_matmul_int8(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    blocks: torch.Tensor,
    block_type: int,
    isa: str | None = None,
) -> torch.Tensor:
    """x [M, K] float32 @ W^T with int8 activations: x is quantized per 32 values
    (quantize_row_q8) and each block's dot product is an integer sum. isa: "avx2", "avxvnni"
    or "avx512vnni"; None: int8_isa's choice."""
    m, k = x.shape
    n = blocks.shape[0]
    x = x.contiguous()
    y = torch.empty(m, n, dtype=torch.float32)
    scratch = torch.empty(m * (k + 8 * (k // QK)), dtype=torch.uint8)
    if isa is None:
        isa = _auto_isas(lib)[1]
    rc = lib.baton_gguf_gemm_q8_f32(
        x.data_ptr(),
        m,
        k,
        blocks.data_ptr(),
        n,
        block_type,
        INT8_ISA_IDS[isa],
        scratch.data_ptr(),
        y.data_ptr(),
    )
    if rc != 0:
        check_blocks(blocks, n, k, block_type)
        raise RuntimeError(f"baton_gguf_gemm_q8_f32 failed ({rc}, isa {isa})")
    return y


def quantize_rows_q8(
    lib: ctypes.CDLL, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (q [M, K] int8, d [M, K / 32], s [M, K / 32]) as the int8 kernels
    quantize it (gguf_gemm.c: baton_quantize_row_q8)."""
    m, k = x.shape
    if k % QK:
        raise ValueError(f"K={k} is not a multiple of {QK}")
    x = x.contiguous()
    q = torch.empty(m, k, dtype=torch.int8)
    d = torch.empty(m, k // QK, dtype=torch.float32)
    s = torch.empty(m, k // QK, dtype=torch.float32)
    for i in range(m):
        rc = lib.baton_quantize_row_q8(
            x[i].data_ptr(), k, q[i].data_ptr(), d[i].data_ptr(), s[i].data_ptr()
        )
        if rc != 0:
            raise RuntimeError(f"baton_quantize_row_q8 failed ({rc})")
    return q, d, s


def gguf_matmul_q8(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    d: torch.Tensor,
    s: torch.Tensor,
    blocks: torch.Tensor,
    block_type: int,
    isa: str,
) -> torch.Tensor:
    """The int8 product of already quantized rows (quantize_rows_q8's output), on one ISA."""
    m, k = q.shape
    n = blocks.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    rc = lib.baton_gguf_gemm_q8(
        q.data_ptr(),
        d.data_ptr(),
        s.data_ptr(),
        m,
        k,
        blocks.data_ptr(),
        n,
        block_type,
        INT8_ISA_IDS[isa],
        y.data_ptr(),
    )
    if rc != 0:
        check_blocks(blocks, n, k, block_type)
        raise RuntimeError(f"baton_gguf_gemm_q8 failed ({rc}, isa {isa})")
    return y
