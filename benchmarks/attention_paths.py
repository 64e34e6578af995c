"""The AVX-512 decode attention kernel's two paths on one pass over keys (paged_decode.c's
baton_paged_decode_pass, one thread): register tiles of a few query vectors against 16 query
vectors in the lanes of a vector, which give the same numbers bit for bit. Prints, per number
of query vectors and keys, each path's microseconds per pass (the best of --rounds, each the
mean of --calls passes, the tiles and the lanes alternating) and lanes / tiles. Where the CPU
has AMX, also a window of at most 128 keys on tiles (window_amx.c's baton_window_amx_pass:
the keys and values packed, then attended; a fused step of 9 rows or more attends a prompt's
windows so, packing each window once for all of the prompt's chunks) and amx / tiles.

    python -m benchmarks.attention_paths [--vectors 12,24,32,48,63] [--keys 128,2048]
        [--calls 200] [--rounds 5]

Shapes are SmolLM2's (head dim 64, block size 16); 128 keys is the fused step's window, 63
query vectors its most for SmolLM2 (21 rows of 3 query heads: a prompt chunk's rows). A pass
includes the ctypes call's few microseconds.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time

import torch

from engine.attention.cpu_backend import load_kernel
from engine.model import fused_decode

HEAD_DIM, BLOCK, KV_HEADS = 64, 16, 3
TILES, LANES = 1, 2  # baton_paged_decode_pass's path argument
WINDOW = 128  # keys of the fused step's window: the most baton_window_amx_pass takes


def pass_inputs(vectors: int, keys: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cache, block table, query vectors) of a pass: seeded, blocks out of order."""
    g = torch.Generator().manual_seed(vectors * 10_000 + keys)
    blocks = -(-keys // BLOCK)
    cache = torch.randn(2, KV_HEADS, blocks, BLOCK, HEAD_DIM, generator=g)
    table = torch.randperm(blocks, generator=g).to(torch.int64)
    return cache, table, torch.randn(vectors, HEAD_DIM, generator=g)


def timed_pass(lib, path: int, vectors: int, keys: int, calls: int, rounds: int) -> float:
    """The best of rounds of the mean seconds of calls passes."""
    cache, table, q = pass_inputs(vectors, keys)
    m, total, acc = torch.empty(vectors), torch.empty(vectors), torch.empty(vectors, HEAD_DIM)
    strides = [ctypes.c_int64(s) for s in cache.stride()[:4]]

    def ptr(t: torch.Tensor) -> ctypes.c_void_p:
        return ctypes.c_void_p(t.data_ptr())

    args = (ptr(q), vectors, None, ptr(cache), *strides, ptr(table), 0, 0, keys, HEAD_DIM)
    args += (BLOCK, ctypes.c_float(HEAD_DIM**-0.5), path, ptr(m), ptr(total), ptr(acc))
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            if lib.baton_paged_decode_pass(*args) != 0:
                raise RuntimeError("baton_paged_decode_pass refused the shape")
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def amx_library() -> ctypes.CDLL | None:
    """The fused step's library where it runs AMX, its window entry points typed; else None."""
    lib = fused_decode.load_kernel()
    if lib is None or not lib.baton_cpu_has_amx():
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.baton_window_amx_pass.argtypes = [p, i64, p, p, i64, i64, i64, i64, p, i64, i64, i64]
    lib.baton_window_amx_pass.argtypes += [i64, i64, i64, ctypes.c_float, p, p, p, p]
    lib.baton_window_amx_scratch_floats.restype = i64
    lib.baton_window_amx_scratch_floats.argtypes = [i64]
    return lib


def timed_window(lib, vectors: int, keys: int, calls: int, rounds: int) -> float:
    """timed_pass for baton_window_amx_pass (keys <= WINDOW): pack and attend per call."""
    cache, table, q = pass_inputs(vectors, keys)
    m, total = torch.empty(vectors), torch.empty(vectors)
    acc = torch.empty(-(-vectors // 16) * 16, HEAD_DIM)
    scratch = torch.empty(lib.baton_window_amx_scratch_floats(HEAD_DIM))
    strides = [s for s in cache.stride()[:4]]

    def ptr(t: torch.Tensor) -> int:
        return t.data_ptr()

    args = (ptr(q), vectors, None, ptr(cache), *strides, ptr(table), 0, 0, keys, keys)
    args += (HEAD_DIM, BLOCK, HEAD_DIM**-0.5, ptr(m), ptr(total), ptr(acc), ptr(scratch))
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            if lib.baton_window_amx_pass(*args) != 0:
                raise RuntimeError("baton_window_amx_pass refused the shape")
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vectors", default="12,24,32,48,63")
    p.add_argument("--keys", default="128,2048")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    lib = load_kernel()
    if lib is None or not lib.baton_paged_decode_has_avx512():
        sys.exit("attention_paths: needs the C kernel and an AVX-512 CPU")
    amx = amx_library()
    header = f"{'keys':>6} {'vectors':>8} {'tiles us':>9} {'lanes us':>9} {'lanes/tiles':>12}"
    print(header + (f" {'amx us':>9} {'amx/tiles':>10}" if amx else ""))
    for keys in (int(k) for k in args.keys.split(",")):
        calls = max(args.calls * 128 // keys, 10)
        for vectors in (int(v) for v in args.vectors.split(",")):
            tiles = lanes = window = float("inf")
            for _ in range(args.rounds):  # alternate, so that a drift of speed hits each
                tiles = min(tiles, timed_pass(lib, TILES, vectors, keys, calls, 1))
                lanes = min(lanes, timed_pass(lib, LANES, vectors, keys, calls, 1))
                if amx and keys <= WINDOW:
                    window = min(window, timed_window(amx, vectors, keys, calls, 1))
            ratio = lanes / tiles
            line = f"{keys:>6} {vectors:>8} {tiles * 1e6:>9.1f} {lanes * 1e6:>9.1f} {ratio:>11.2f}x"
            if amx:
                line += (
                    f" {window * 1e6:>9.1f} {window / tiles:>9.2f}x"
                    if keys <= WINDOW
                    else f" {'-':>9} {'-':>10}"
                )
            print(line)


if __name__ == "__main__":
    main()
