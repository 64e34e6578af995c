"""The fused step's products of many rows, on SmolLM2's shapes: gguf_gemm.c's panels (any
x86-64 CPU; float32 register tiles of 3 rows x 4 weight rows, 8 lanes over k) against
gemm_lanes.c's lanes (AVX-512: 16 input rows in the lanes, weights broadcast), gemm_amx.c's
AMX tiles where the CPU has them (two more columns: amx and amx / lanes), and PyTorch's float32
product of the dequantized weights as a reference, all on the same random Q4_1 blocks
and threads. Prints GFLOP/s per shape and row count (the best of --rounds, the paths
alternating) and lanes / panels.

    python -m benchmarks.product_paths [--rows 9,12,13,16,32,64,256] [--threads 2] [--rounds 5]

A step of LANES_MIN_ROWS rows or more takes the lanes on AVX-512 (decode_matrix.c).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from engine.model.gguf_kernel import load_kernel

Q4_1 = int(GGMLQuantizationType.Q4_1)
# (name, K, N): SmolLM2-135M's layer products (qkv, gate/up, down); o is qkv's K with N = K
SHAPES = (("qkv", 576, 960), ("gate/up", 576, 3072), ("down", 1536, 576))


def q4_1_blocks(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Random normal weights [n, k] as Q4_1 blocks [n, k / 32 * 20] (gguf's quantizer)."""
    weights = torch.randn(n, k, generator=g).numpy()
    return torch.from_numpy(quantize(weights, GGMLQuantizationType.Q4_1))


def seconds(run: Callable[[], None], flops: float) -> float:
    """One round: the mean seconds of enough calls for ~0.2 GFLOP (at least 3)."""
    calls = max(3, int(2e8 / flops))
    run()
    start = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - start) / calls


def paths(lib, blocks: torch.Tensor, weight: torch.Tensor, x: torch.Tensor) -> dict:
    """Each path as a call computing x [m, k] W^T into one output."""
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty(m, n)

    def kernel(fn: Callable[..., int]) -> Callable[[], None]:
        def run() -> None:
            if fn(x.data_ptr(), m, k, blocks.data_ptr(), n, Q4_1, y.data_ptr()) != 0:
                raise RuntimeError(f"{fn.__name__} refused {m} x {k} x {n}")

        return run

    runs = {
        "panels": kernel(lib.baton_gguf_gemm_panel),
        "lanes": kernel(lib.baton_gguf_gemm_lanes),
        "torch": lambda: torch.mm(x, weight.t(), out=y),
    }
    if lib.baton_cpu_has_amx():
        runs["amx"] = kernel(lib.baton_gguf_gemm_amx)
    return runs


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="9,12,13,16,32,64,256")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    lib = load_kernel()
    if lib is None or not lib.baton_cpu_has_avx512():
        sys.exit("product_paths: needs the C kernels and an AVX-512 CPU")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    print(f"{args.threads} threads, GFLOP/s, best of {args.rounds} rounds")
    amx = bool(lib.baton_cpu_has_amx())
    print(
        f"{'product':>8} {'rows':>5} {'panels':>7} {'lanes':>7} {'torch':>7} {'lanes/panels':>13}"
        + (f" {'amx':>7} {'amx/lanes':>10}" if amx else "")
    )
    for name, k, n in SHAPES:
        blocks = q4_1_blocks(n, k, g)
        weight = torch.empty(n, k)
        lib.baton_gguf_dequantize(blocks.data_ptr(), n, k, Q4_1, weight.data_ptr())
        for m in (int(r) for r in args.rows.split(",")):
            runs = paths(lib, blocks, weight, torch.randn(m, k, generator=g))
            flops = 2.0 * m * k * n
            best = dict.fromkeys(runs, float("inf"))
            for _ in range(args.rounds):  # alternate, so that a drift of speed hits every path
                for path, run in runs.items():
                    best[path] = min(best[path], seconds(run, flops))
            rate = {path: flops / s / 1e9 for path, s in best.items()}
            ratio = best["panels"] / best["lanes"]
            line = (
                f"{name:>8} {m:>5} {rate['panels']:>7.0f} {rate['lanes']:>7.0f} "
                f"{rate['torch']:>7.0f} {ratio:>12.2f}x"
            )
            if amx:
                line += f" {rate['amx']:>7.0f} {best['lanes'] / best['amx']:>9.2f}x"
            print(line)


if __name__ == "__main__":
    main()
