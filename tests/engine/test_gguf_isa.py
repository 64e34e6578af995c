"""The single-row GGUF kernels per instruction set: each path this CPU can run agrees with a
float64 torch reference over the exactly dequantized weights, and the run-time choice falls
back to AVX2 where AVX-512 is missing or the engine option gguf_isa=avx2 asks for it."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from engine import LLM
from engine.errors import InvalidRequestError
from engine.model import gguf_kernel, gguf_linear
from engine.model.gguf_kernel import (
    ISA_CHOICES,
    amx_products,
    gemv_isa,
    gguf_matmul,
    load_kernel,
    q8_0_rows_avx512,
)
from engine.model.gguf_linear import GGUFBlockLinear
from engine.options import GGUF_ISA_NAMES

Q4_1, Q8_0 = int(gguf.GGMLQuantizationType.Q4_1), int(gguf.GGMLQuantizationType.Q8_0)

lib = load_kernel()
pytestmark = pytest.mark.skipif(lib is None, reason="no x86-64 AVX2/FMA/F16C CPU or C compiler")


def cpu_flags() -> set[str]:
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


HAS_AVX512 = {"avx512f", "avx512bw", "avx512vl"} <= cpu_flags()
RUNNABLE_ISAS = ["avx2", "avx512"] if HAS_AVX512 else ["avx2"]


def quantized(rows: int, cols: int, qtype: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random weights as GGUF blocks [rows, bytes] and the float32 weights they hold."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    blocks = quantize(w, gguf.GGMLQuantizationType(qtype))
    weight = dequantize(blocks, gguf.GGMLQuantizationType(qtype)).copy()
    return torch.from_numpy(blocks), torch.from_numpy(weight)


@pytest.mark.parametrize("isa", RUNNABLE_ISAS)
@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
@pytest.mark.parametrize("rows,cols", [(1, 32), (2, 64), (7, 96), (33, 160)])  # odd N: a lone row
def test_single_row_matches_float64_reference(isa, qtype, rows, cols):
    blocks, weight = quantized(rows, cols, qtype, seed=rows * cols)
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(cols))
    y = gguf_matmul(lib, x, blocks, qtype, isa=isa)
    ref = (x.double() @ weight.double().T).float()
    assert y.shape == (1, rows)
    # float32 sums of at most 160 products: only the rounding of another summation order
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
def test_the_two_paths_agree_to_rounding(qtype):
    blocks, _ = quantized(129, 576, qtype, seed=3)
    x = torch.randn(1, 576, generator=torch.Generator().manual_seed(4))
    paths = [gguf_matmul(lib, x, blocks, qtype, isa=isa) for isa in RUNNABLE_ISAS]
    for y in paths[1:]:  # sums of 576 products of magnitude ~1: float32 rounding ~1e-5
        torch.testing.assert_close(y, paths[0], rtol=1e-4, atol=1e-4)


def test_detection_matches_cpuinfo_and_the_option_forces_avx2():
    assert bool(lib.baton_cpu_has_avx512()) == HAS_AVX512
    assert gemv_isa(lib) == gemv_isa(lib, "auto") == ("avx512" if HAS_AVX512 else "avx2")
    assert gemv_isa(lib, "avx2") == "avx2"
    assert gemv_isa(lib, "avxvnni") == "avx2"  # an int8 choice: float32 rows stay AVX2
    with pytest.raises(
        InvalidRequestError, match="choose auto, avx2, avxvnni, avx512, avx512vnni, amx"
    ):
        gemv_isa(lib, "sse9")
    if HAS_AVX512:
        assert gemv_isa(lib, "avx512") == gemv_isa(lib, "avx512vnni") == "avx512"
    else:
        with pytest.raises(InvalidRequestError, match="gguf_isa=avx512 but this CPU lacks"):
            gemv_isa(lib, "avx512")
    assert tuple(ISA_CHOICES) == GGUF_ISA_NAMES[1:]  # every option value but auto has kernels


@pytest.mark.parametrize("isa", RUNNABLE_ISAS)
def test_the_engine_option_reaches_every_block_layer(quantized_llama, isa):
    llm = LLM(str(quantized_llama), gguf_isa=isa, skip_tokenizer_init=True, num_kv_blocks=16)
    model = llm.engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, GGUFBlockLinear)]  # lm_head too
    assert len(layers) == 1 + 4 * len(model.layers) and {m.isa for m in layers} == {isa}
    assert {m.q8_0_avx512 for m in layers} == {q8_0_rows_avx512(lib, isa)} == {False}


def test_an_isa_the_cpu_lacks_is_refused_at_start(quantized_llama, monkeypatch):
    opts = dict(skip_tokenizer_init=True, num_kv_blocks=16)
    with pytest.raises(InvalidRequestError, match="gguf_isa='sse9' is invalid: choose auto"):
        LLM(str(quantized_llama), gguf_isa="sse9", **opts)
    monkeypatch.setattr(gguf_linear, "load_kernel", NoAvx512)  # the loader sees such a CPU
    with pytest.raises(InvalidRequestError, match="gguf_isa=avx512 but this CPU lacks"):
        LLM(str(quantized_llama), gguf_isa="avx512", **opts)
    model = LLM(str(quantized_llama), **opts).engine.runner.model  # auto: AVX2 there
    assert model.layers[0].mlp.down_proj.isa == "avx2"


class NoAvx512:
    """The real library, with the CPU probe answering as an AVX2-only machine would."""

    def __getattr__(self, name):
        return getattr(lib, name)

    @staticmethod
    def baton_cpu_has_avx512():
        return 0

    @staticmethod
    def baton_gguf_gemv_avx512(*args):
        return -2  # what the C entry point returns on such a CPU


def test_a_cpu_without_avx512_falls_back_to_avx2():
    """What a CPU without AVX-512 sees: the probe says no, the choice is AVX2, and asking for
    the AVX-512 kernel anyway still returns the right numbers (the C kernel refuses, -2)."""

    fake = NoAvx512()
    assert gemv_isa(fake) == "avx2"
    with pytest.raises(InvalidRequestError, match="gguf_isa=avx512 but this CPU lacks"):
        gemv_isa(fake, "avx512")
    blocks, weight = quantized(5, 64, Q4_1, seed=9)
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(9))
    y = gguf_matmul(fake, x, blocks, Q4_1, isa="avx512")
    torch.testing.assert_close(y, (x.double() @ weight.double().T).float(), rtol=1e-5, atol=1e-5)


def test_bad_k_is_refused_by_the_avx512_entry():
    if not HAS_AVX512:
        pytest.skip("no AVX-512 here")
    x = torch.zeros(1, 48)
    out = torch.empty(1, 1)
    w = torch.zeros(1, 40, dtype=torch.uint8)
    args = (x.data_ptr(), 48, w.data_ptr(), 1, Q4_1, out.data_ptr())
    assert lib.baton_gguf_gemv_avx512(*args) == -1  # K = 48 is not a multiple of 32
    assert gguf_kernel.Q4_1 == Q4_1


def test_amx_where_the_cpu_has_it_and_the_option_forces_it_or_turns_it_off():
    has_amx = bool(lib.baton_cpu_has_amx())
    if not HAS_AVX512 or not {"amx_tile", "amx_bf16", "avx512_bf16"} <= cpu_flags():
        assert not has_amx
    assert amx_products(lib) == amx_products(lib, "auto") == has_amx
    assert not amx_products(lib, "avx512") and not amx_products(lib, "avx2")
    if has_amx:
        assert amx_products(lib, "amx") and gemv_isa(lib, "amx") == "avx512"
    else:
        with pytest.raises(InvalidRequestError, match="gguf_isa=amx but this CPU or OS lacks"):
            amx_products(lib, "amx")


def test_q8_0_rows_take_the_avx512_kernel_where_amx_is_on(quantized_llama):
    """Q8_0 rows (the output projection) take the one-row AVX-512 kernel only beside AMX: the
    layers get that choice, and a layer's product is then that kernel's, bit for bit, else the
    AVX2 kernel's (the two sum in different orders, so the test tells them apart)."""
    assert q8_0_rows_avx512(lib) == amx_products(lib)
    assert not q8_0_rows_avx512(lib, "avx512") and not q8_0_rows_avx512(lib, "avx2")
    head = LLM(str(quantized_llama), skip_tokenizer_init=True, num_kv_blocks=16)
    head = head.engine.runner.model.lm_head
    assert isinstance(head, GGUFBlockLinear) and head.block_type == Q8_0
    assert head.q8_0_avx512 == amx_products(lib)
    if not HAS_AVX512:
        pytest.skip("no AVX-512 here")
    n, k = 129, 576
    blocks, weight = quantized(n, k, Q8_0, seed=6)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(6))
    xsum, by_avx512, by_avx2 = torch.empty(k // 32), torch.empty(1, n), torch.empty(1, n)
    ptrs = (x.data_ptr(), k, blocks.data_ptr(), n, Q8_0)
    assert lib.baton_gguf_gemv_avx512(*ptrs, by_avx512.data_ptr()) == 0
    assert lib.baton_gguf_gemm(x.data_ptr(), 1, *ptrs[1:], xsum.data_ptr(), by_avx2.data_ptr()) == 0
    assert not torch.equal(by_avx512, by_avx2)
    assert torch.equal(gguf_matmul(lib, x, blocks, Q8_0, "avx512", q8_0_avx512=True), by_avx512)
    assert torch.equal(gguf_matmul(lib, x, blocks, Q8_0, "avx512"), by_avx2)
    ref = (x.double() @ weight.double().T).float()
    torch.testing.assert_close(by_avx512, ref, rtol=1e-5, atol=1e-4)
