"""The CPU attention backend: the torch backend, with decode tokens attended by a C kernel
straight over the paged cache (paged_decode.c) instead of gathering their context first.

A 32-sequence decode step of SmolLM2 spent ~13 ms gathering context blocks and ~10 ms in
the attention matmuls; the kernel reads every key and value once, in place. Prefill chunks
keep the torch path (SDPA's flash kernel). float32 only; other dtypes use the torch path.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from engine.attention.torch_backend import TorchAttentionBackend, _StepPlan
from engine.native import load_kernel_library

SOURCE = Path(__file__).with_name("paged_decode.c")


def load_kernel() -> ctypes.CDLL | None:
    """The compiled kernel with its signature set, or None where it cannot run here."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    # q, cache, 4 cache strides, block tables, their width, lengths, sequences, heads, kv heads,
    # head dim, block size, scale, out
    decode = [ptr, ptr, i64, i64, i64, i64, ptr, i64, ptr, i64, i64, i64, i64, i64]
    decode += [ctypes.c_float, ptr]
    # block tables, their width, lengths, sequences, query heads per KV head, block size,
    # shared keys out, group out
    groups = [ptr, i64, ptr, i64, i64, i64, ptr, ptr]
    # query vectors, their count, limits, cache, 4 cache strides, table, KV head, t0, t1, head
    # dim, block size, scale, path, m out, l out, acc out
    one_pass = [ptr, i64, ptr, ptr, i64, i64, i64, i64, ptr, i64, i64, i64, i64, i64]
    one_pass += [ctypes.c_float, ctypes.c_int, ptr, ptr, ptr]
    return load_kernel_library(
        SOURCE,
        baton_paged_decode=decode,
        baton_paged_decode_groups=groups,
        baton_paged_decode_pass=one_pass,
        baton_paged_decode_isa=[*decode, ctypes.c_int],
        baton_paged_decode_has_avx512=[],
    )


ISAS = {"avx2": 0, "avx512": 1}  # baton_paged_decode_isa's isa argument


class CpuAttentionBackend(TorchAttentionBackend):
    """TorchAttentionBackend whose decode attention runs in a C kernel over the paged cache."""

    name = "cpu"

    def __init__(self, lib: ctypes.CDLL, isa: str | None = None) -> None:
        """isa: "avx2" or "avx512" forces that code (tests); None: AVX-512 where cpuid has it."""
        super().__init__()
        self._lib = lib
        self._isa = None if isa is None else ISAS[isa]

    def _decode(
        self, q: torch.Tensor, blocks: torch.Tensor, plan: _StepPlan, scale: float
    ) -> torch.Tensor:
        """q: [T, H, D]; blocks: [2, KVH, num_blocks, block_size, D]. Returns [Bd, H, D]."""
        if q.dtype != torch.float32 or q.device.type != "cpu":
            return super()._decode(q, blocks, plan, scale)
        decode_rows, tables, decode_lens = plan.decode_tensors()  # tables: [Bd, blocks] int64
        qd = (q if plan.all_decode else q.index_select(0, decode_rows)).contiguous()
        out = torch.empty_like(qd)
        _, num_kv_heads, _, block_size, head_dim = blocks.shape
        isa = () if self._isa is None else (self._isa,)
        kernel = (
            self._lib.baton_paged_decode if self._isa is None else self._lib.baton_paged_decode_isa
        )
        rc = kernel(
            qd.data_ptr(),
            blocks.data_ptr(),
            *blocks.stride()[:4],
            tables.data_ptr(),
            tables.shape[1],
            decode_lens.data_ptr(),
            qd.shape[0],
            qd.shape[1],
            num_kv_heads,
            head_dim,
            block_size,
            scale,
            out.data_ptr(),
            *isa,
        )
        if rc == -3:
            raise RuntimeError("baton_paged_decode_isa: AVX-512 asked for on a CPU without it")
        if rc != 0:  # a shape the kernel does not take (or no scratch memory)
            return super()._decode(q, blocks, plan, scale)
        return out
