"""The SwiGLU C kernel: silu(gate) * up as torch computes it (to float32 rounding), taken by
LlamaMLP on CPU float32, refusing widths it does not take."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.llama import LlamaArgs, LlamaMLP
from engine.model.swiglu_kernel import load_kernel, swiglu

lib = load_kernel()
pytestmark = pytest.mark.skipif(lib is None, reason="no x86-64 AVX2/FMA/F16C CPU or C compiler")


def reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.double().chunk(2, dim=-1)
    return (F.silu(gate) * up).float()


@pytest.mark.parametrize("rows,inter", [(1, 8), (3, 64), (40, 1536)])  # 40 rows: threads
def test_matches_silu_times_up(rows, inter):
    g = torch.Generator().manual_seed(rows + inter)
    gate_up = torch.randn(rows, 2 * inter, generator=g) * 4
    gate_up[0, :4] = torch.tensor([0.0, -100.0, 100.0, -20.0])  # e^-g's clamps and zero
    out = swiglu(gate_up)
    assert out.is_contiguous() and out.shape == (rows, inter)
    torch.testing.assert_close(out, reference(gate_up), rtol=3e-7, atol=1e-30)


def test_strided_rows_and_refused_shapes():
    wide = torch.randn(5, 40)
    view = wide[:, :32]  # row stride 40: read in place
    torch.testing.assert_close(swiglu(view), reference(view), rtol=3e-7, atol=1e-30)
    assert swiglu(torch.randn(2, 12)) is None  # I = 6: not a multiple of 8
    assert swiglu(torch.randn(2, 32, dtype=torch.float64)) is None


def test_the_mlp_takes_the_kernel_and_matches_torch():
    args = LlamaArgs(100, 16, 24, 1, 2, 1, 8, 1e-6, True)
    mlp = LlamaMLP(args)
    x = torch.randn(7, 16)
    gate, up = mlp.gate_up_proj(x).split(24, dim=-1)
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), mlp.down_proj(F.silu(gate) * up), rtol=1e-6, atol=1e-6)
