"""The decode attention kernel's passes over keys (paged_decode.c) give each query vector the
same numbers whichever AVX-512 path runs them: by register tiles of a few query vectors, or
with 16 query vectors in the lanes of a vector (the path of passes of many query vectors: a
prompt chunk's rows, decode rows over a shared prefix). Bit for bit, for any number of query
vectors, head sizes, key ranges cut anywhere in blocks and spans, and per-vector ends of keys;
and every path within float32 rounding of a softmax computed by torch."""

from __future__ import annotations

import ctypes

import pytest
import torch

from engine.attention.cpu_backend import load_kernel

lib = load_kernel()
pytestmark = pytest.mark.skipif(lib is None, reason="no x86-64 AVX2/FMA/F16C CPU or C compiler")
HAS_AVX512 = lib is not None and bool(lib.baton_paged_decode_has_avx512())
AVX2, AVX512_TILES, AVX512_LANES = 0, 1, 2  # baton_paged_decode_pass's path argument
KV_HEADS, BLOCK, NUM_BLOCKS = 2, 16, 24


def ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def one_pass(path, q, limits, cache, table, h, t0, t1, scale):
    """(running max [ng], running sum [ng], acc [ng, D]) of baton_paged_decode_pass."""
    ng, d = q.shape
    m, total, acc = torch.empty(ng), torch.empty(ng), torch.empty(ng, d)
    strides = [ctypes.c_int64(s) for s in cache.stride()[:4]]  # kv, head, block, token
    limits_ptr = None if limits is None else ptr(limits)
    rc = lib.baton_paged_decode_pass(
        ptr(q),
        ng,
        limits_ptr,
        ptr(cache),
        *strides,
        ptr(table),
        h,
        t0,
        t1,
        d,
        BLOCK,
        ctypes.c_float(scale),
        path,
        ptr(m),
        ptr(total),
        ptr(acc),
    )
    assert rc == 0
    return m, total, acc


def case(ng, d, t0, t1, with_limits, seed):
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, KV_HEADS, NUM_BLOCKS, BLOCK, d, generator=g)
    table = torch.randperm(NUM_BLOCKS, generator=g).to(torch.int64)  # blocks out of order
    q = torch.randn(ng, d, generator=g)
    limits = None
    if with_limits:  # ends before, inside and at the end of the keys, as a prompt's rows
        limits = torch.randint(max(t0 - 3, 0), t1 + 1, (ng,), generator=g).to(torch.int64)
        limits[0] = t1
    return q, limits, cache, table


def keys_of(cache, table, h, which, t0, t1):
    rows = [cache[which, h, table[t // BLOCK], t % BLOCK] for t in range(t0, t1)]
    return torch.stack(rows).double()


SHAPES = [  # (query vectors, head dim, first key, end of keys)
    (ng, d, t0, t1)
    for ng in (1, 3, 12, 15, 16, 17, 40, 64)
    for d in (16, 64, 128)
    for t0, t1 in ((0, 1), (0, 37), (5, 133), (100, 300))
]


@pytest.mark.skipif(not HAS_AVX512, reason="no AVX-512 on this CPU")
@pytest.mark.parametrize("with_limits", [False, True])
@pytest.mark.parametrize(("ng", "d", "t0", "t1"), SHAPES)
def test_lanes_equal_tiles_bit_for_bit(ng, d, t0, t1, with_limits):
    q, limits, cache, table = case(ng, d, t0, t1, with_limits, seed=ng * 1000 + d + t0)
    h, scale = 1, d**-0.5
    tiles = one_pass(AVX512_TILES, q, limits, cache, table, h, t0, t1, scale)
    lanes = one_pass(AVX512_LANES, q, limits, cache, table, h, t0, t1, scale)
    for a, b in zip(tiles, lanes, strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("path", [AVX2, AVX512_TILES, AVX512_LANES])
@pytest.mark.parametrize(
    ("ng", "d", "t0", "t1"), [(3, 64, 0, 37), (40, 64, 5, 133), (17, 16, 100, 300)]
)
def test_every_path_is_the_softmax(path, ng, d, t0, t1):
    if path != AVX2 and not HAS_AVX512:
        pytest.skip("no AVX-512 on this CPU")
    q, limits, cache, table = case(ng, d, t0, t1, True, seed=7)
    h, scale = 0, d**-0.5
    state = one_pass(path, q, limits, cache, table, h, t0, t1, scale)
    assert_each_vector_is_the_softmax(state, q, limits, cache, table, h, t0, t1, scale, 1e-5, 1e-4)


def assert_each_vector_is_the_softmax(
    state, q, limits, cache, table, h, t0, t1, scale, tolerance, acc_tolerance
) -> None:
    """A pass's (max, sum, acc) of each query vector against the softmax in float64 over its
    keys (t0 up to its limit): max and sum within `tolerance`, acc within `acc_tolerance`; a
    vector with no keys keeps the fresh state."""
    m, total, acc = state
    k, v = keys_of(cache, table, h, 0, t0, t1), keys_of(cache, table, h, 1, t0, t1)
    for i in range(len(q)):
        end = t1 - t0 if limits is None else min(int(limits[i]), t1) - t0
        if end <= 0:  # no keys: the fresh state, untouched
            assert m[i] == -float("inf") and total[i] == 0 and not acc[i].any()
            continue
        scores = (k[:end] @ q[i].double()) * scale
        assert m[i].item() == pytest.approx(scores.max().item(), rel=tolerance, abs=tolerance)
        weights = torch.exp(scores - m[i].double())
        torch.testing.assert_close(total[i].double(), weights.sum(), rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(
            acc[i].double(), weights @ v[:end], rtol=acc_tolerance, atol=acc_tolerance
        )


def test_a_pass_refuses_what_it_does_not_take():
    q, _, cache, table = case(3, 64, 0, 8, False, seed=1)
    m, total, acc = torch.empty(65), torch.empty(65), torch.empty(65, 64)
    strides = [ctypes.c_int64(s) for s in cache.stride()[:4]]
    args = (ptr(cache), *strides, ptr(table), 0, 0, 8, 64, BLOCK, ctypes.c_float(0.125))
    big = torch.zeros(65, 64)
    assert (
        lib.baton_paged_decode_pass(ptr(big), 65, None, *args, AVX2, ptr(m), ptr(total), ptr(acc))
        == -1
    )
    assert (
        lib.baton_paged_decode_pass(ptr(q), 3, None, *args, 3, ptr(m), ptr(total), ptr(acc)) == -1
    )
    if not HAS_AVX512:
        rc = lib.baton_paged_decode_pass(
            ptr(q), 3, None, *args, AVX512_LANES, ptr(m), ptr(total), ptr(acc)
        )
        assert rc == -3
