"""gemm_amx.c, the product of many rows on AMX tiles (the fused step's products from
AMX_MIN_ROWS rows where the CPU has AMX): float32-accurate although the tiles multiply
bfloat16 (each input split into three bfloat16 parts, the quants exact in bfloat16), and each
row's numbers the same bit for bit whatever the other rows of the product."""

from __future__ import annotations

import ctypes

import pytest
import torch

from engine.model.gguf_kernel import load_kernel
from tests.engine.test_gguf_blocks import Q4_1, Q8_0, quantized

lib = load_kernel()
HAS_AMX = lib is not None and bool(lib.baton_cpu_has_amx())
needs_amx = pytest.mark.skipif(not HAS_AMX, reason="needs AMX tiles with bfloat16 products")


def amx(x: torch.Tensor, blocks: torch.Tensor, n: int, qtype) -> tuple[int, torch.Tensor]:
    y = torch.full((x.shape[0], n), float("nan"))
    status = lib.baton_gguf_gemm_amx(
        ctypes.c_void_p(x.data_ptr()), x.shape[0], x.shape[1],
        ctypes.c_void_p(blocks.data_ptr()), n, int(qtype), ctypes.c_void_p(y.data_ptr()),
    )  # fmt: skip
    return status, y


def error_bound(x: torch.Tensor, weight: torch.Tensor, k: int) -> torch.Tensor:
    """A float32 sum of k products, each exact, is within k ulps of the sums of magnitudes."""
    return (x.double().abs() @ weight.double().abs().T) * k * 2.0**-24


@needs_amx
@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
@pytest.mark.parametrize("rows", [1, 16, 37])  # one group of 16 input rows, then 16 + 16 + 5
def test_the_product_is_float32_accurate(qtype, rows):
    blocks, weight = quantized(29, 96, qtype, seed=3)  # 29: a short last pack of weight rows
    g = torch.Generator().manual_seed(4)
    # magnitudes from 1e-3 to 1e3: every bfloat16 part of an input carries its share
    x = torch.randn(rows, 96, generator=g) * 10.0 ** torch.randint(-3, 4, (rows, 96), generator=g)
    status, y = amx(x, blocks, 29, qtype)
    assert status == 0
    exact = x.double() @ weight.double().T
    assert ((y.double() - exact).abs() <= error_bound(x, weight, 96)).all()
    # relative to the magnitudes: bfloat16 inputs alone would be ~1e-3 off
    relative = (y.double() - exact).abs() / (x.double().abs() @ weight.double().abs().T)
    assert relative.max() < 2e-6


@needs_amx
def test_a_row_has_the_same_numbers_whatever_the_other_rows():
    blocks, _ = quantized(50, 128, Q4_1, seed=5)
    x = torch.randn(70, 128, generator=torch.Generator().manual_seed(6))
    _, whole = amx(x, blocks, 50, Q4_1)
    for lo, hi in [(0, 1), (3, 4), (0, 16), (5, 38), (33, 70), (69, 70)]:
        _, part = amx(x[lo:hi].contiguous(), blocks, 50, Q4_1)
        assert torch.equal(part, whole[lo:hi])


@needs_amx
@pytest.mark.parametrize("n", [16, 29])  # whole packs of 16 weight rows; a short last pack
def test_q4_1_tiles_hold_the_quants_as_q8_0_tiles_do(n):
    """Q4_1 blocks are packed into tiles by their own route (a transpose of the quant bytes'
    words); Q8_0 blocks with the same quants, the same d and no m give the same products bit
    for bit only if both routes put the same values in the same places."""
    k, blocks_per_row = 96, 96 // 32
    g = torch.Generator().manual_seed(8)
    quants = torch.randint(0, 16, (n, blocks_per_row, 32), generator=g, dtype=torch.uint8)
    d = (torch.rand(n, blocks_per_row, 1, generator=g) + 0.01).half().view(torch.uint8)
    nibbles = quants[..., :16] | (quants[..., 16:] << 4)  # byte i: quants i and i + 16
    no_m = torch.zeros(n, blocks_per_row, 2, dtype=torch.uint8)
    q4_1 = torch.cat([d, no_m, nibbles], dim=2).reshape(n, -1).contiguous()
    q8_0 = torch.cat([d, quants], dim=2).reshape(n, -1).contiguous()
    x = torch.randn(21, k, generator=g) * 10.0 ** torch.randint(-3, 4, (21, k), generator=g)
    status_q4_1, y_q4_1 = amx(x, q4_1, n, Q4_1)
    status_q8_0, y_q8_0 = amx(x, q8_0, n, Q8_0)
    assert status_q4_1 == status_q8_0 == 0
    assert torch.equal(y_q4_1, y_q8_0)
    scales = d.view(torch.float16).float().expand(n, blocks_per_row, 32).reshape(n, k)
    weight = quants.reshape(n, k).float() * scales
    exact = x.double() @ weight.double().T
    assert ((y_q4_1.double() - exact).abs() <= error_bound(x, weight, k)).all()


@pytest.mark.skipif(lib is None, reason="needs the kernel")
def test_bad_shapes_and_missing_amx_are_refused():
    blocks, _ = quantized(4, 64, Q4_1, seed=7)
    x = torch.randn(2, 64)
    assert amx(x, blocks, 4, 2)[0] == -1  # not Q4_1 or Q8_0
    assert amx(x[:, :48].contiguous(), blocks, 4, Q4_1)[0] == -1  # K not a multiple of 32
    assert amx(x, blocks, 4, Q4_1)[0] == (0 if HAS_AMX else -2)
