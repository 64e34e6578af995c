"""The RMSNorm C kernel: HF's formula in float32 (only the mean's summation order differs),
used by RMSNorm on small CPU float32 batches, refusing shapes it does not take."""

from __future__ import annotations

import pytest
import torch

from engine.model.llama import RMSNorm
from engine.model.rms_norm_kernel import load_kernel, rms_norm

lib = load_kernel()
pytestmark = pytest.mark.skipif(lib is None, reason="no x86-64 AVX2/FMA/F16C CPU or C compiler")


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm in float32."""
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


@pytest.mark.parametrize("rows,dim", [(1, 8), (1, 576), (3, 64), (17, 200)])
def test_matches_transformers_formula(rows, dim):
    g = torch.Generator().manual_seed(rows * dim)
    x = torch.randn(rows, dim, generator=g) * 3
    weight = torch.randn(dim, generator=g)
    y = rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(y, hf_rms_norm(x, weight, 1e-5), rtol=2e-6, atol=2e-6)


def test_the_module_takes_the_kernel_for_small_batches_and_torch_above():
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 64))
    for rows in (1, RMSNorm.NATIVE_MAX_ROWS, RMSNorm.NATIVE_MAX_ROWS + 1):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(norm(x), hf_rms_norm(x, norm.weight, 1e-6), rtol=2e-6, atol=2e-6)
    view = torch.randn(2, 128)[:, ::2]  # not contiguous: copied first
    torch.testing.assert_close(
        norm(view), hf_rms_norm(view, norm.weight, 1e-6), rtol=2e-6, atol=2e-6
    )


def test_a_width_not_a_multiple_of_8_falls_back_to_torch():
    x, weight = torch.randn(2, 12), torch.randn(12)
    assert rms_norm(x, weight, 1e-6) is None  # the kernel refuses (-1)
    norm = RMSNorm(12, 1e-6)
    torch.testing.assert_close(norm(x), hf_rms_norm(x, norm.weight, 1e-6))
