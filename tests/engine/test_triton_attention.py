"""Triton attention kernels against the torch reference backend.

Without CUDA the kernels run on CPU tensors under the Triton interpreter. Triton decides
whether to interpret when it is first imported (its own library, tl.zeros etc., is jitted at
that moment), so TRITON_INTERPRET is set below before anything imports triton. On a CPU-only
machine that setting is the only one under which triton can run at all, so leaving it set
for the rest of the session harms no other test module. If triton was already imported by an
earlier module, the kernel tests skip here and rerun in a fresh process instead.
Shapes are tiny: the interpreter is about 1000x slower than a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ON_CPU = not torch.cuda.is_available()
if ON_CPU:
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

from triton.runtime.jit import JITFunction  # noqa: E402

from engine.attention import get_attention_backend  # noqa: E402
from engine.attention.kv_layout import allocate_kv_cache  # noqa: E402
from engine.attention.metadata import AttentionMetadata, build_metadata  # noqa: E402
from engine.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from engine.attention.triton_backend import (  # noqa: E402
    TritonAttentionBackend,
    reshape_and_cache,
)
from tests.engine.paged_inputs import random_inputs, random_step, shuffled_step  # noqa: E402

# False when triton had been imported (compiled mode) before this module set the variable.
KERNELS_RUN_HERE = not ON_CPU or not isinstance(triton.language.zeros, JITFunction)
needs_kernels = pytest.mark.skipif(
    not KERNELS_RUN_HERE,
    reason="triton was imported before TRITON_INTERPRET=1; see test_kernels_in_fresh_process",
)

DEVICE = torch.device("cpu" if ON_CPU else "cuda")
# fp32: exact-ish on CPU (numpy dots); CUDA reductions reorder sums, so allow a little more.
FP32_ATOL = 1e-5 if DEVICE.type == "cpu" else 1e-4

# One step mixing every case: a fresh prefill (no cached context), a prefill chunk spanning
# several query tiles on top of cached context, and decodes at seq_len 1 (first token), inside
# a block, and across several key tiles.
QUERY_LENS = [7, 20, 1, 1, 1]
SEQ_LENS = [7, 29, 1, 6, 37]


def _backend() -> TritonAttentionBackend:
    # Small tiles so the tiny test sequences still span several query tiles (8 tokens x 2
    # heads) and several key steps (16 keys), exercising the tile search and online softmax.
    return TritonAttentionBackend(block_m=16, block_n=16)


def _step(
    query_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    num_blocks: int,
    gen: torch.Generator,
) -> AttentionMetadata:
    return shuffled_step(query_lens, seq_lens, block_size, num_blocks, gen, DEVICE)


def _inputs(
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_blocks: int,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> tuple[torch.Tensor, ...]:
    return random_inputs(
        num_tokens, num_heads, num_kv_heads, head_dim, block_size, num_blocks, dtype, gen, DEVICE
    )


@needs_kernels
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [
        (4, 2, 16, 4),  # GQA, power-of-two sizes
        (6, 2, 24, 8),  # group of 3 and head_dim 24: both padded and masked in the kernel
        (2, 2, 32, 4),  # plain multi-head attention
    ],
)
def test_mixed_step_matches_torch_fp32(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    gen = torch.Generator().manual_seed(0)
    num_blocks = 32
    heads = (num_heads, num_kv_heads, head_dim)
    q, k, v, cache, meta = random_step(
        QUERY_LENS, SEQ_LENS, *heads, block_size, num_blocks, gen, DEVICE
    )
    scale = head_dim**-0.5
    ref_cache, tri_cache = cache.clone(), cache.clone()

    ref = TorchAttentionBackend().forward(q, k, v, ref_cache, meta, scale)
    out = _backend().forward(q, k, v, tri_cache, meta, scale)

    assert torch.equal(tri_cache, ref_cache)
    assert not torch.equal(tri_cache, cache)  # the step did write something
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, atol=FP32_ATOL, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize(
    ("dtype", "atol"),
    [
        (torch.float16, 2e-3),
        # The interpreter's tl.dot multiplies bf16 bit patterns (triton-lang/triton#11584).
        pytest.param(
            torch.bfloat16,
            2e-2,
            marks=pytest.mark.skipif(
                ON_CPU, reason="Triton interpreter: tl.dot does not support bfloat16"
            ),
        ),
    ],
)
def test_low_precision_matches_fp32_reference(dtype: torch.dtype, atol: float) -> None:
    gen = torch.Generator().manual_seed(1)
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 4, 2, 16, 4, 32
    heads = (num_heads, num_kv_heads, head_dim)
    q, k, v, cache, meta = random_step(
        QUERY_LENS, SEQ_LENS, *heads, block_size, num_blocks, gen, DEVICE, dtype
    )
    scale = head_dim**-0.5
    # Oracle: the same (already rounded) inputs upcast to fp32.
    ref_cache = cache.float()
    ref = TorchAttentionBackend().forward(q.float(), k.float(), v.float(), ref_cache, meta, scale)
    tri_cache = cache.clone()

    out = _backend().forward(q, k, v, tri_cache, meta, scale)

    assert out.dtype == dtype
    assert torch.equal(tri_cache, ref_cache.to(dtype))  # a plain copy: exact in any dtype
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=0)


@needs_kernels
def test_decode_only_step_matches_torch() -> None:
    gen = torch.Generator().manual_seed(2)
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 4, 2, 16, 8, 24
    seq_lens = [1, 9, 16, 17, 40, 3]
    heads = (num_heads, num_kv_heads, head_dim)
    q, k, v, cache, meta = random_step(
        [1] * len(seq_lens), seq_lens, *heads, block_size, num_blocks, gen, DEVICE
    )
    ref_cache, tri_cache = cache.clone(), cache.clone()

    ref = TorchAttentionBackend().forward(q, k, v, ref_cache, meta, 0.25)
    out = _backend().forward(q, k, v, tri_cache, meta, 0.25)

    assert torch.equal(tri_cache, ref_cache)
    torch.testing.assert_close(out, ref, atol=FP32_ATOL, rtol=1e-5)


@needs_kernels
def test_strided_qkv_views_match_torch() -> None:
    # q, k, v as column slices of one packed projection output, as a fused QKV linear gives.
    gen = torch.Generator().manual_seed(3)
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 4, 2, 16, 4, 32
    meta = _step(QUERY_LENS, SEQ_LENS, block_size, num_blocks, gen)
    num_tokens = sum(QUERY_LENS)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    qkv = qkv.to(DEVICE)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    cache = allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, torch.float32, DEVICE)
    cache.copy_(torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen))
    ref_cache, tri_cache = cache.clone(), cache.clone()

    ref = TorchAttentionBackend().forward(
        q.contiguous(), k.contiguous(), v.contiguous(), ref_cache, meta, 0.25
    )
    out = _backend().forward(q, k, v, tri_cache, meta, 0.25)

    assert torch.equal(tri_cache, ref_cache)
    torch.testing.assert_close(out, ref, atol=FP32_ATOL, rtol=1e-5)


@needs_kernels
def test_prefill_then_decode_reads_what_it_wrote() -> None:
    # Two steps on one cache per backend: the decode step attends to keys the prefill wrote.
    gen = torch.Generator().manual_seed(4)
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 4
    tables = [[5, 2, 7], [0, 6, 1, 3]]
    cache = allocate_kv_cache(8, block_size, num_kv_heads, head_dim, torch.float32, DEVICE)
    ref_cache, tri_cache = cache.clone(), cache.clone()
    torch_backend, triton_backend = TorchAttentionBackend(), _backend()
    for query_lens, seq_lens in [([9, 13], [9, 13]), ([1, 1], [10, 14])]:
        meta = build_metadata(query_lens, seq_lens, tables, block_size, DEVICE)
        q, k, v, _ = _inputs(
            sum(query_lens), num_heads, num_kv_heads, head_dim, block_size, 1, torch.float32, gen
        )
        ref = torch_backend.forward(q, k, v, ref_cache, meta, 0.25)
        out = triton_backend.forward(q, k, v, tri_cache, meta, 0.25)
        assert torch.equal(tri_cache, ref_cache)
        torch.testing.assert_close(out, ref, atol=FP32_ATOL, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_skips_negative_slots(dtype: torch.dtype) -> None:
    num_kv_heads, head_dim, block_size = 2, 16, 4
    cache = torch.zeros(2, 3, block_size, num_kv_heads, head_dim, device=DEVICE, dtype=dtype)
    k = torch.randn(3, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    v = torch.randn(3, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    slots = torch.tensor([9, -1, 2], dtype=torch.int64, device=DEVICE)

    reshape_and_cache(k, v, cache[0], cache[1], slots)

    flat = cache.view(2, -1, num_kv_heads, head_dim)
    expected = torch.zeros_like(flat)
    expected[0, [9, 2]] = k[[0, 2]]
    expected[1, [9, 2]] = v[[0, 2]]
    assert torch.equal(flat, expected)


def test_registry_builds_triton_backend() -> None:
    backend = get_attention_backend("triton", DEVICE)
    assert isinstance(backend, TritonAttentionBackend)
    assert backend.name == "triton"


@pytest.mark.skipif(KERNELS_RUN_HERE, reason="the kernel tests ran in this process")
def test_kernels_in_fresh_process() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
