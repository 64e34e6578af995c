"""engine/model/cpu_linear.py: PackedLinear takes the packed (oneDNN) product up to its
max_rows and F.linear above, and the one-time probe that sets max_rows leaves the global RNG
alone."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from engine.model.cpu_linear import (
    PACKED_MAX_ROWS,
    PackedLinear,
    onednn_available,
    packed_max_rows,
)


@pytest.fixture
def layer() -> PackedLinear:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 32, generator=gen)
    if not onednn_available(weight):
        pytest.skip("oneDNN cannot pack weights on this CPU")
    return PackedLinear(weight, torch.randn(48, generator=gen))


def test_rows_up_to_max_rows_take_the_packed_product_and_more_take_f_linear(layer):
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    packed = torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")
    plain = F.linear(x, layer.weight, layer.bias)
    layer.max_rows = 8
    assert torch.equal(layer(x), packed)
    layer.max_rows = 7
    assert torch.equal(layer(x), plain)
    torch.testing.assert_close(packed, plain)  # the same product either way


def test_the_probe_chooses_a_bound_and_leaves_the_global_rng_as_it_was():
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    packed_max_rows.cache_clear()
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    rows = packed_max_rows()
    assert torch.equal(torch.rand(4), expected)
    assert rows in (PACKED_MAX_ROWS, sys.maxsize)
    assert packed_max_rows() == rows  # measured once per process
