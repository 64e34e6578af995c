"""gemm_lanes.c, the AVX-512 product of many rows by lanes (the fused step's products from
LANES_MIN_ROWS rows): the dense product of the checkpoint's weights, each output element one
running sum of fused multiply-adds over k in order, and so each row's numbers the same bit for
bit whatever the other rows of the product."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from engine.model.gguf_kernel import load_kernel
from tests.engine.test_gguf_blocks import Q4_1, Q8_0, quantized

lib = load_kernel()
pytestmark = pytest.mark.skipif(
    lib is None or not lib.baton_cpu_has_avx512(), reason="needs the kernel and AVX-512"
)


def lanes(x: torch.Tensor, blocks: torch.Tensor, n: int, qtype) -> torch.Tensor:
    y = torch.full((x.shape[0], n), float("nan"))
    status = lib.baton_gguf_gemm_lanes(
        ctypes.c_void_p(x.data_ptr()), x.shape[0], x.shape[1],
        ctypes.c_void_p(blocks.data_ptr()), n, int(qtype), ctypes.c_void_p(y.data_ptr()),
    )  # fmt: skip
    assert status == 0
    return y


def fma_chain(x: torch.Tensor, weight: torch.Tensor) -> np.ndarray:
    """Every element's s = x[i, k] w[n, k] + s over k in order, rounded to float32 once per
    step: the float64 product of two float32 is exact, and the float64 sum's own rounding
    can change the float32 result only in a tie (never met with these draws)."""
    xs, ws = x.double().numpy(), weight.double().numpy()
    s = np.zeros((x.shape[0], weight.shape[0]), dtype=np.float32)
    for k in range(x.shape[1]):
        s = (np.outer(xs[:, k], ws[:, k]) + s.astype(np.float64)).astype(np.float32)
    return s


@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
@pytest.mark.parametrize("rows", [3, 37])  # the weight rows in the lanes; 16 + 16 + 5 input rows
def test_each_element_is_one_chain_of_fused_multiply_adds(qtype, rows):
    blocks, weight = quantized(29, 96, qtype, seed=3)  # 29: a short last tile of weight rows
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(4))
    y = lanes(x, blocks, 29, qtype)
    assert np.array_equal(y.numpy(), fma_chain(x, weight))
    torch.testing.assert_close(y, (x.double() @ weight.double().T).float(), rtol=1e-5, atol=1e-5)


def test_a_row_has_the_same_numbers_whatever_the_other_rows():
    blocks, _ = quantized(50, 128, Q4_1, seed=5)
    x = torch.randn(70, 128, generator=torch.Generator().manual_seed(6))
    whole = lanes(x, blocks, 50, Q4_1)
    for lo, hi in [(0, 1), (3, 4), (0, 16), (5, 38), (33, 70), (69, 70)]:
        assert torch.equal(lanes(x[lo:hi].contiguous(), blocks, 50, Q4_1), whole[lo:hi])


def test_a_shape_it_cannot_take_is_refused():
    blocks, _ = quantized(4, 64, Q4_1, seed=7)
    x, y = torch.randn(2, 64), torch.empty(2, 4)
    args = (ctypes.c_void_p(x.data_ptr()), 2)
    out = ctypes.c_void_p(y.data_ptr())
    blocks_ptr = ctypes.c_void_p(blocks.data_ptr())
    assert lib.baton_gguf_gemm_lanes(*args, 48, blocks_ptr, 4, int(Q4_1), out) == -1  # K % 32
    assert lib.baton_gguf_gemm_lanes(*args, 64, blocks_ptr, 4, 2, out) == -1  # not Q4_1 / Q8_0
    assert lib.baton_gguf_gemm_lanes(ctypes.c_void_p(x.data_ptr()), 0, 64, blocks_ptr, 4,
                                     int(Q4_1), out) == -1  # fmt: skip
