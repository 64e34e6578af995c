"""A window of keys attended on AMX (window_amx.c), as the fused step of many rows does with
AMX on: within float32 rounding of the softmax computed in float64 (the six bfloat16 part
products keep float32's accuracy), and a query vector's numbers bit for bit the same whichever
vectors share its pass."""

from __future__ import annotations

import ctypes

import pytest
import torch

from engine.model import fused_decode
from tests.engine.test_attention_paths import (
    AVX512_LANES,
    BLOCK,
    assert_each_vector_is_the_softmax,
    case,
    keys_of,
    one_pass,
    ptr,
)

lib = fused_decode.load_kernel()
HAS_AMX = lib is not None and bool(lib.baton_cpu_has_amx())
pytestmark = pytest.mark.skipif(not HAS_AMX, reason="no AMX on this CPU (or no C compiler)")
if lib is not None:
    P, I64 = ctypes.c_void_p, ctypes.c_int64
    lib.baton_window_amx_pass.argtypes = [P, I64, P, P, I64, I64, I64, I64, P, I64, I64, I64]
    lib.baton_window_amx_pass.argtypes += [I64, I64, I64, ctypes.c_float, P, P, P, P]
    lib.baton_window_amx_scratch_floats.restype = I64
    lib.baton_window_amx_scratch_floats.argtypes = [I64]


def scratch(d: int) -> torch.Tensor:
    return torch.empty(lib.baton_window_amx_scratch_floats(d))


def window(q, limits, cache, table, h, t0, t1, scale, packed_to=None):
    """(max [ng], sum [ng], acc [ng, D]) of baton_window_amx_pass over keys [t0, t1), packed
    to packed_to (default t1)."""
    ng, d = q.shape
    m, total, acc = torch.empty(ng), torch.empty(ng), torch.empty(-(-ng // 16) * 16, d)
    strides = [ctypes.c_int64(s) for s in cache.stride()[:4]]  # kv, head, block, token
    space = scratch(d)
    rc = lib.baton_window_amx_pass(
        ptr(q),
        ng,
        None if limits is None else ptr(limits),
        ptr(cache),
        *strides,
        ptr(table),
        h,
        t0,
        t1 if packed_to is None else packed_to,
        t1 - t0,
        d,
        BLOCK,
        ctypes.c_float(scale),
        ptr(m),
        ptr(total),
        ptr(acc),
        ptr(space),
    )
    assert rc == 0
    assert not acc[ng:].any()  # rows past ng: zeros
    return m, total, acc[:ng]


SHAPES = [  # (query vectors, head dim, first key, end of keys): at most 128 keys
    (ng, d, t0, t1)
    for ng in (1, 3, 17, 40, 64)
    for d in (32, 64, 128)
    for t0, t1 in ((0, 1), (0, 37), (5, 133), (128, 200))
]


@pytest.mark.parametrize("with_limits", [False, True])
@pytest.mark.parametrize(("ng", "d", "t0", "t1"), SHAPES)
def test_a_window_is_the_softmax(ng, d, t0, t1, with_limits):
    q, limits, cache, table = case(ng, d, t0, t1, with_limits, seed=ng * 1000 + d + t0)
    q *= 3  # scores of a few units, so that the weights spread over orders of magnitude
    h, scale = 1, d**-0.5
    state = window(q, limits, cache, table, h, t0, t1, scale)
    assert_each_vector_is_the_softmax(state, q, limits, cache, table, h, t0, t1, scale, 2e-6, 1e-5)


def test_a_window_is_as_close_to_the_softmax_as_the_lanes_pass():
    """The AMX window's error against float64 is of float32's order: no more than a few times
    that of the float32 lanes pass over the same keys."""
    q, limits, cache, table = case(63, 64, 256, 384, True, seed=5)
    q *= 3
    h, scale = 0, 0.125
    k, v = keys_of(cache, table, h, 0, 256, 384), keys_of(cache, table, h, 1, 256, 384)
    errors = []
    for _max, total, acc in (
        window(q, limits, cache, table, h, 256, 384, scale),
        one_pass(AVX512_LANES, q, limits, cache, table, h, 256, 384, scale),
    ):
        worst = 0.0
        for i in range(63):
            end = int(limits[i]) - 256
            if end <= 0:
                continue
            scores = (k[:end] @ q[i].double()) * scale
            want = torch.softmax(scores, 0) @ v[:end]
            worst = max(worst, (acc[i].double() / total[i].double() - want).abs().max().item())
        errors.append(worst)
    amx, lanes = errors
    assert amx < 1e-5 and amx < 8 * lanes


def test_a_vectors_numbers_do_not_depend_on_the_others():
    q, limits, cache, table = case(64, 64, 0, 128, True, seed=11)
    h, scale = 1, 0.125
    together = window(q, limits, cache, table, h, 0, 128, scale)
    for lo, hi in ((0, 1), (5, 6), (17, 40), (33, 64)):
        apart = window(q[lo:hi].clone(), limits[lo:hi].clone(), cache, table, h, 0, 128, scale)
        for a, b in zip(together, apart, strict=True):
            assert torch.equal(a[lo:hi].view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize(("t1", "packed_to"), [(1, 128), (37, 64), (37, 128), (100, 101)])
def test_keys_packed_past_the_window_change_nothing(t1, packed_to):
    """A prompt's chunks share one pack of a window's keys, made to the last chunk's end: an
    earlier chunk's numbers are those of a pack of its own keys."""
    q, limits, cache, table = case(40, 64, 0, t1, True, seed=t1 + packed_to)
    own = window(q, limits, cache, table, 0, 0, t1, 0.125)
    shared = window(q, limits, cache, table, 0, 0, t1, 0.125, packed_to=packed_to)
    for a, b in zip(own, shared, strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_a_window_refuses_what_it_does_not_take():
    q, _, cache, table = case(3, 64, 0, 8, False, seed=1)
    m, total, acc = torch.empty(80), torch.empty(80), torch.empty(80, 64)
    strides = [ctypes.c_int64(s) for s in cache.stride()[:4]]
    space = scratch(128)

    def rc(q, ng, t0, t1, d, n=None):
        n = t1 - t0 if n is None else n
        return lib.baton_window_amx_pass(
            ptr(q),
            ng,
            None,
            ptr(cache),
            *strides,
            ptr(table),
            0,
            t0,
            t1,
            n,
            d,
            BLOCK,
            ctypes.c_float(0.125),
            ptr(m),
            ptr(total),
            ptr(acc),
            ptr(space),
        )

    assert rc(torch.zeros(65, 64), 65, 0, 8, 64) == -1  # more than 64 query vectors
    assert rc(q, 3, 0, 129, 64) == -1  # more than a window's 128 keys
    assert rc(q, 3, 0, 8, 16) == -1  # head_dim not a multiple of 32
    assert rc(q, 3, 8, 0, 64) == -1
    assert rc(q, 3, 0, 8, 64, n=9) == -1  # more keys than packed
    assert rc(q, 3, 0, 8, 64) == 0
