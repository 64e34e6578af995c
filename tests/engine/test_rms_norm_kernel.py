"""The RMSNorm C kernel: HF's formula in float32 (only the mean's summation order differs),
used by RMSNorm on small CPU float32 batches, refusing shapes it does not take."""

from __future__ import annotations

import pytest
import torch

from engine.model.llama import RMSNorm
from engine.model.rms_norm_kernel import add_rms_norm, load_kernel, rms_norm

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


@pytest.mark.parametrize("rows,dim", [(1, 576), (3, 64), (64, 576), (301, 200)])  # 64+: threads
def test_add_then_norm_in_one_pass(rows, dim):
    g = torch.Generator().manual_seed(rows + dim)
    x, r = torch.randn(rows, dim, generator=g) * 3, torch.randn(rows, dim, generator=g)
    weight = torch.randn(dim, generator=g)
    s, y = add_rms_norm(x, r, weight, 1e-5)
    assert torch.equal(s, x + r)
    torch.testing.assert_close(y, hf_rms_norm(x + r, weight, 1e-5), rtol=2e-6, atol=2e-6)


def test_the_module_adds_and_norms_with_the_kernel_or_torch():
    norm = RMSNorm(12, 1e-6)  # width 12: the kernel refuses, torch takes over
    x, r = torch.randn(5, 12), torch.randn(5, 12)
    assert add_rms_norm(x, r, norm.weight, 1e-6) is None
    for module, xs, rs in (
        (norm, x, r),
        (RMSNorm(64, 1e-6), torch.randn(70, 64), torch.randn(70, 64)),
    ):
        s, y = module.add_norm(xs, rs)
        assert torch.equal(s, xs + rs)
        torch.testing.assert_close(
            y, hf_rms_norm(xs + rs, module.weight, 1e-6), rtol=2e-6, atol=2e-6
        )
        s, y = module.add_norm(xs, None)  # nothing pending: s is x itself
        assert s is xs
        torch.testing.assert_close(y, hf_rms_norm(xs, module.weight, 1e-6), rtol=2e-6, atol=2e-6)
