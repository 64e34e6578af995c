"""Packing: gather/scatter of blocks into layer-major message buffers, message plans, checks."""

from __future__ import annotations

import pytest
import torch

from kvtransfer import (
    DescriptorError,
    Staging,
    check_cache,
    pack,
    plan_messages,
    unpack,
    wire_order,
)
from kvtransfer.packing import layers_per_message
from tests.kvtransfer.peer import BLOCK_SHAPE, make_cache, make_descriptor


def test_pack_then_unpack_moves_exact_blocks():
    src_cache = make_cache(num_blocks=12, seed=1)
    dst_cache = make_cache(num_blocks=9, seed=2)
    before = [t.clone() for t in dst_cache]
    src, dst = [7, 0, 11, 3], [2, 8, 5, 0]
    desc = make_descriptor("r", src, dst, layers=(1, 4))
    buf = Staging(torch.device("cpu")).view(0, desc, 3)
    block_size, num_kv_heads, head_dim = BLOCK_SHAPE
    assert buf.shape == (3, 2, num_kv_heads, 4, block_size, head_dim) and buf.is_contiguous()

    pack(src_cache, (1, 4), torch.tensor(src), buf)
    unpack(buf, dst_cache, (1, 4), torch.tensor(dst))

    for layer in range(4):
        for s, d in zip(src, dst, strict=True):
            expect = src_cache[layer][:, s] if layer >= 1 else before[layer][:, d]
            assert torch.equal(dst_cache[layer][:, d], expect)
        untouched = [b for b in range(9) if b not in dst or layer == 0]
        assert torch.equal(dst_cache[layer][:, untouched], before[layer][:, untouched])


def test_wire_order_sorts_by_destination_keeping_pairs():
    desc = make_descriptor("r", [7, 0, 11, 3], [2, 8, 5, 0])
    assert wire_order(desc) == ([3, 7, 11, 0], [0, 2, 5, 8])


def test_plan_messages_covers_the_layer_range_in_order():
    desc = make_descriptor("r", [0], [0], layers=(1, 4))
    assert plan_messages(desc, 1) == [(1, 2), (2, 3), (3, 4)]
    assert plan_messages(desc, 2) == [(1, 3), (3, 4)]
    assert plan_messages(desc, 10) == [(1, 4)]
    with pytest.raises(ValueError, match=">= 1"):
        plan_messages(desc, 0)


def test_layers_per_message_follows_the_byte_target():
    desc = make_descriptor("r", [0, 1], [0, 1])  # 4 layers
    per_layer = 2 * desc.layer_block_bytes
    assert layers_per_message(desc, per_layer) == 1
    assert layers_per_message(desc, 3 * per_layer + 1) == 3
    assert layers_per_message(desc, 1) == 1  # at least one layer
    assert layers_per_message(desc, 1 << 40) == 4  # at most the whole range


def test_staging_reuses_and_grows_buffers():
    staging = Staging(torch.device("cpu"))
    big = make_descriptor("r", list(range(8)), list(range(8)))
    small = make_descriptor("s", [0], [0])
    a = staging.view(0, big, 2)
    b = staging.view(0, small, 1)
    assert b.data_ptr() == a.data_ptr()  # reused, not reallocated
    assert staging.nbytes == 2 * 8 * big.layer_block_bytes
    staging.view(1, big, 4)
    assert staging.nbytes == (2 + 4) * 8 * big.layer_block_bytes


def test_check_cache_accepts_a_matching_cache():
    check_cache(make_cache(8, 0), make_descriptor("r", [1, 7], [0, 1]), [1, 7], "sender")


@pytest.mark.parametrize(
    "case, message",
    [
        ("layers", "exceed the receiver's 4-layer KV cache"),
        ("ids", r"block ids \[8\] are out of range for a cache of 8 blocks"),
        ("dtype", "receiver KV cache is bfloat16 but the transfer is float32"),
        ("shape", r"receiver layer 0 has shape \(2, 8, 4, 2, 4\)"),
    ],
)
def test_check_cache_rejects_mismatches(case, message):
    cache = make_cache(8, 0)
    desc = make_descriptor(
        "r", [1, 2], [0, 8 if case == "ids" else 1], layers=(0, 5) if case == "layers" else (0, 4)
    )
    if case == "dtype":
        cache = make_cache(8, 0, dtype="bfloat16")
    if case == "shape":
        cache = [t[..., :4].contiguous() for t in cache]
    with pytest.raises(DescriptorError, match=message):
        check_cache(cache, desc, desc.dst_block_ids, "receiver")
