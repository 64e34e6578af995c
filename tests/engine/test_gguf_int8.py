"""int8 activations (EngineOptions.int8_activations): the activation quantization equals a torch
reference bit for bit; every int8 kernel this CPU runs equals a torch reference of the same
integer arithmetic (exact int sums, float32 scales); the result stays within the bound the
rounding of x implies of the float32 product; the engine option reaches every block layer,
produces tokens, refuses where it cannot run, and leaves the default path unchanged."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from benchmarks.checkpoints import make_checkpoint
from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.model import gguf_kernel
from engine.model.gguf_kernel import (
    gguf_matmul,
    gguf_matmul_int8,
    gguf_matmul_q8,
    int8_isa,
    int8_isas,
    load_kernel,
    quantize_rows_q8,
)
from engine.model.gguf_linear import QUANT_MAX_ROWS, GGUFBlockLinear
from tests.engine.test_gguf_blocks import VOCAB
from tests.helpers import random_prompts

Q4_1, Q8_0 = int(gguf.GGMLQuantizationType.Q4_1), int(gguf.GGMLQuantizationType.Q8_0)

lib = load_kernel()
pytestmark = pytest.mark.skipif(lib is None, reason="no x86-64 AVX2/FMA/F16C CPU or C compiler")


def cpu_flags() -> set[str]:
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


FLAGS = cpu_flags()
EXPECTED_ISAS = (
    ["avx2"]
    + (["avxvnni"] if "avx_vnni" in FLAGS else [])
    + (["avx512vnni"] if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= FLAGS else [])
)
RUNNABLE = int8_isas(lib) if lib is not None else []


def quantized(rows: int, cols: int, qtype: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random weights as GGUF blocks [rows, bytes] and the float32 weights they hold."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    blocks = quantize(w, gguf.GGMLQuantizationType(qtype))
    weight = dequantize(blocks, gguf.GGMLQuantizationType(qtype)).copy()
    return torch.from_numpy(blocks), torch.from_numpy(weight)


def reference_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The documented quantization in float32 torch: d = amax / 127, q = round_half_even(x *
    (1 / d)) (0 for an all-zero block), s = d * sum(q)."""
    blocks = x.view(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv[..., None])
    return q.to(torch.int8).view_as(x), d, d * q.sum(-1)


def block_fields(blocks: torch.Tensor, qtype: int, k: int):
    """(d_w, m_w or None, q_w int64 [N, K / 32, 32]) read straight from the block bytes."""
    raw = blocks.numpy().reshape(blocks.shape[0], k // 32, -1)

    def f16(lo: int) -> torch.Tensor:
        return torch.from_numpy(raw[:, :, lo : lo + 2].copy().view(np.float16)[..., 0]).float()

    if qtype == Q4_1:
        nibbles = torch.from_numpy(raw[:, :, 4:].copy()).long()
        return f16(0), f16(2), torch.cat([nibbles & 15, nibbles >> 4], -1)
    return f16(0), None, torch.from_numpy(raw[:, :, 2:].copy().view(np.int8)).long()


def reference_int8_product(q, d, s, blocks, qtype) -> torch.Tensor:
    """The kernels' arithmetic in torch: exact integer block sums, times (d_w * d_x) rounded to
    float32 once, plus m_w * s_x (Q4_1); the terms summed in float64."""
    m, k = q.shape
    dw, mw, qw = block_fields(blocks, qtype, k)
    dots = torch.einsum("nbj,mbj->mnb", qw, q.view(m, k // 32, 32).long()).double()
    scale = (dw[None] * d[:, None]).double()  # [M, N, nb], float32 products
    y = (dots * scale).sum(-1)
    if mw is not None:
        y += (mw[None].double() * s[:, None].double()).sum(-1)
    return y


def test_the_cpu_probe_finds_what_cpuinfo_lists():
    assert RUNNABLE == EXPECTED_ISAS


def test_quantization_equals_the_torch_reference_bit_for_bit():
    x = torch.randn(5, 320, generator=torch.Generator().manual_seed(1)) * 3
    x[1, :32] = 0  # an all-zero block: d = 0, q = 0
    x[2, 32:64] = torch.arange(32) - 15.5  # values on rounding ties after scaling
    x[3, 64:96] = 1e-30  # tiny but not zero
    q, d, s = quantize_rows_q8(lib, x)
    rq, rd, rs = reference_quantize(x)
    assert torch.equal(q, rq) and torch.equal(d, rd) and torch.equal(s, rs)
    assert q.abs().max() <= 127 and torch.equal(d[1, 0], torch.tensor(0.0))


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
@pytest.mark.parametrize("n,k", [(1, 32), (3, 64), (7, 96), (33, 160), (129, 576)])  # odd K/32
def test_each_isa_equals_the_integer_reference(isa, qtype, n, k):
    blocks, _ = quantized(n, k, qtype, seed=n * k)
    for m in (1, 2, 3, 5, QUANT_MAX_ROWS):  # the zmm kernel (1 row) and every row tile
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k))
        q, d, s = quantize_rows_q8(lib, x)
        y = gguf_matmul_q8(lib, q, d, s, blocks, qtype, isa)
        ref = reference_int8_product(q, d, s, blocks, qtype)
        # exact integer sums; only the float32 accumulation of <= 18 block terms differs
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max())
        assert torch.equal(gguf_matmul_int8(lib, x, blocks, qtype, isa=isa), y)


@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
def test_error_against_float32_is_within_the_rounding_bound(qtype):
    """Each x_j is replaced by d q_j with |x_j - d q_j| <= d / 2, so
    |y_int8 - y_f32| <= sum_b (d_b / 2) sum_{j in b} |w_j| (+ float32 rounding). On random
    data that is about 1% of |y|'s scale; the mean error is a few times smaller."""
    blocks, weight = quantized(257, 576, qtype, seed=11)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(12))
    exact = x.double() @ weight.double().T
    _, d, _ = quantize_rows_q8(lib, x)
    bound = (d.double()[:, None, :] / 2 * weight.abs().double().view(1, 257, 18, 32).sum(-1)).sum(
        -1
    )
    for isa in RUNNABLE:
        err = (gguf_matmul_int8(lib, x, blocks, qtype, isa=isa).double() - exact).abs()
        assert (err <= bound * 1.001 + 1e-4).all(), isa
        assert err.max() < 0.02 * exact.abs().max(), isa  # in numbers: the measured scale


def test_isa_choice_and_forcing():
    assert int8_isa(lib) == next(i for i in gguf_kernel.INT8_PREFERENCE if i in RUNNABLE)
    assert int8_isa(lib, "avx2") == "avx2"
    assert gguf_kernel.gemv_isa(lib, "avx2") == "avx2"  # the float32 kernel too
    for forced, want in (
        ("avxvnni", "avxvnni"),
        ("avx512vnni", "avx512vnni"),
        ("avx512", "avx512vnni"),
    ):
        if want in RUNNABLE:
            assert int8_isa(lib, forced) == want
        else:
            with pytest.raises(InvalidRequestError, match=f"lacks {want}"):
                int8_isa(lib, forced)
    with pytest.raises(InvalidRequestError, match="choose auto, avx2, .*, amx"):
        int8_isa(lib, "sse9")


def test_an_avx2_only_cpu_gets_the_avx2_kernel_and_refusals():
    """What a CPU with AVX2 only sees: the probe lists avx2 alone, the choice is AVX2, forcing a
    VNNI kernel is an error, and the C entry refuses (-2) an ISA the CPU lacks."""

    class Avx2Only:
        def __getattr__(self, name):
            return getattr(lib, name)

        @staticmethod
        def baton_cpu_int8_isas():
            return 1 << gguf_kernel.INT8_ISA_IDS["avx2"]

    fake = Avx2Only()
    assert int8_isas(fake) == ["avx2"] and int8_isa(fake) == "avx2"
    with pytest.raises(InvalidRequestError, match="gguf_isa=avx512vnni but this CPU lacks"):
        int8_isa(fake, "avx512vnni")
    y = torch.empty(1, 1)
    x = torch.zeros(1, 32, dtype=torch.int8)
    dx = torch.zeros(1, 1)
    w = torch.zeros(1, 20, dtype=torch.uint8)
    args = (x.data_ptr(), dx.data_ptr(), dx.data_ptr(), 1, 32, w.data_ptr(), 1, Q4_1)
    assert lib.baton_gguf_gemm_q8(*args, 7, y.data_ptr()) == -2  # no such ISA
    assert lib.baton_gguf_gemm_q8(*args[:4], 48, *args[5:], 0, y.data_ptr()) == -1  # K % 32


def test_layer_uses_int8_up_to_the_row_limit_then_the_dense_weight():
    blocks, weight = quantized(40, 64, Q4_1, seed=2)
    dense = torch.nn.Linear(64, 40)
    with torch.no_grad():
        dense.weight.copy_(weight)
    layer = GGUFBlockLinear(dense, blocks, Q4_1, 64, lib, int8_activations=True)
    with torch.no_grad():
        small = torch.randn(QUANT_MAX_ROWS, 64)
        want = gguf_matmul_int8(lib, small, blocks, Q4_1) + dense.bias
        assert torch.equal(layer(small), want)
        assert not torch.equal(want, gguf_matmul(lib, small, blocks, Q4_1) + dense.bias)
        big = torch.randn(QUANT_MAX_ROWS + 1, 64)
        assert torch.equal(layer(big), dense(big))  # the exact float32 layer


OPTS = dict(skip_tokenizer_init=True, block_size=4, num_kv_blocks=64)


def block_layers(llm: LLM) -> list[GGUFBlockLinear]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, GGUFBlockLinear)]


def test_engine_option_end_to_end(quantized_llama):
    prompts = random_prompts([5, 9, 17], seed=41, vocab=VOCAB)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    # no prefix caching: a cached prompt would be prefilled in fewer rows, and rows <= 8 take
    # int8 arithmetic where a longer prefill is float32, so the tokens could differ
    int8 = LLM(str(quantized_llama), int8_activations=True, enable_prefix_caching=False, **OPTS)
    exact = LLM(str(quantized_llama), **OPTS)
    dense = LLM(str(quantized_llama), use_gguf_blocks=False, **OPTS)
    assert len(block_layers(int8)) == 2 * 4 + 1  # qkv, o, gate_up, down per layer + lm_head
    assert all(layer.int8_activations for layer in block_layers(int8))
    assert not any(layer.int8_activations for layer in block_layers(exact))
    agree = 0
    for prompt in prompts:  # one at a time: every decode step has one row
        ours = int8.generate([prompt], params)[0].token_ids
        assert len(ours) == 12 and all(0 <= t < VOCAB for t in ours)
        assert ours == int8.generate([prompt], params)[0].token_ids  # deterministic
        reference = exact.generate([prompt], params)[0].token_ids
        assert reference == dense.generate([prompt], params)[0].token_ids  # default: unchanged
        agree += ours[0] == reference[0]
    assert agree >= 2  # int8 rounding rarely flips the first greedy token of a random model


def test_refused_where_it_cannot_run(tmp_path):
    for bad, reason in (
        (dict(dtype="bfloat16"), "dtype is bfloat16"),
        (dict(device="cuda"), "device is cuda"),
        (dict(use_gguf_blocks=False), "use_gguf_blocks is off"),
    ):
        with pytest.raises(InvalidRequestError, match=f"int8_activations needs .*{reason}"):
            EngineConfig(int8_activations=True, **bad)
    plain = make_checkpoint(tmp_path / "plain")  # a float checkpoint: no GGUF blocks
    with pytest.raises(InvalidRequestError, match="not converted from a GGUF"):
        LLM(str(plain), int8_activations=True, **OPTS)


@pytest.mark.parametrize("isa", RUNNABLE)
def test_the_engine_option_picks_the_int8_kernel(quantized_llama, isa):
    llm = LLM(str(quantized_llama), int8_activations=True, gguf_isa=isa, **OPTS)
    assert {layer.isa for layer in block_layers(llm)} == {isa}
