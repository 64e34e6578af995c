"""Decode attention over a shared prompt head: the CPU kernel (paged_decode.c) on R decode
rows whose first P tokens are the same prompt head, once with their tables naming the same
physical blocks (what prefix caching gives: the kernel reads them once for the group) and once
with each row holding its own copy of those blocks (same values: the kernel reads them R
times), one run:

    python -m benchmarks.shared_prefix_attention [--rows 1,4,8,16,32] [--prefix 2000]
        [--own 100] [--threads 2] [--calls 30] [--rounds 5]

Shapes are SmolLM2's (9 query heads, 3 KV heads, head dim 64, block size 16); a call is one
layer's decode attention, each over a cache of its own, --calls of them timed together (30:
one step of the model's layers). Printed per R: ms per --calls calls, shared and copied,
copied / shared and the KV each reads. Both give the same output (within float32 rounding).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from engine.attention.cpu_backend import CpuAttentionBackend, load_kernel
from engine.attention.kv_layout import allocate_kv_cache
from engine.attention.metadata import build_metadata

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def tables_for(rows: int, prefix: int, own: int, shared: bool) -> tuple[list[list[int]], int]:
    """Block tables of `rows` sequences of prefix + own tokens (prefix: whole blocks): the
    prefix's blocks shared (the same ids in every table) or copied (ids of their own); and the
    blocks used."""
    head, per_row = prefix // BLOCK, -(-(prefix + own) // BLOCK)
    tables, next_id = [], head if shared else 0
    for _ in range(rows):
        n = per_row - head if shared else per_row
        tables.append((list(range(head)) if shared else []) + list(range(next_id, next_id + n)))
        next_id += n
    return tables, next_id


def one_case(lib, rows: int, args) -> dict:
    prefix = args.prefix - args.prefix % BLOCK  # only full blocks are shared
    seq_len = prefix + args.own
    gen = torch.Generator().manual_seed(rows)
    tables, caches = {}, {}
    tables["shared"], num_shared = tables_for(rows, prefix, args.own, True)
    tables["copied"], num_copied = tables_for(rows, prefix, args.own, False)
    # one cache per call, as each layer has its own: the step streams them all from memory
    for name, n in (("shared", num_shared), ("copied", num_copied)):
        caches[name] = [
            allocate_kv_cache(n, BLOCK, KV_HEADS, HEAD_DIM, torch.float32, "cpu")
            for _ in range(args.calls)
        ]
    gather = torch.tensor(sum(tables["shared"], []))
    for shared_cache, copied_cache in zip(caches["shared"], caches["copied"], strict=True):
        shared_cache.copy_(torch.randn(shared_cache.shape, generator=gen))
        # each copied table holds the values of the same row's shared table: the same keys
        copied_cache.copy_(shared_cache[:, gather])
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(rows, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(rows, KV_HEADS, HEAD_DIM, generator=gen)
    backend = CpuAttentionBackend(lib)
    scale = HEAD_DIM**-0.5
    best, outs = {}, {}
    for name in ("shared", "copied"):
        meta = build_metadata(
            [1] * rows, [seq_len] * rows, tables[name], BLOCK, torch.device("cpu")
        )
        outs[name] = backend.forward(q, k, v, caches[name][0], meta, scale)  # and a warm-up
        times = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            for cache in caches[name]:
                backend.forward(q, k, v, cache, meta, scale)
            times.append(time.perf_counter() - start)
        best[name] = min(times)
    torch.testing.assert_close(outs["shared"], outs["copied"], atol=1e-5, rtol=1e-5)
    return {
        "rows": rows,
        "shared_ms": 1e3 * best["shared"],
        "copied_ms": 1e3 * best["copied"],
        "speedup": best["copied"] / best["shared"],
        "kv_mib_copied": rows * seq_len * KV_HEADS * HEAD_DIM * 8 * args.calls / 2**20,
        "kv_mib_shared": (prefix + rows * args.own) * KV_HEADS * HEAD_DIM * 8 * args.calls / 2**20,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", default="1,4,8,16,32", help="comma-separated decode rows")
    p.add_argument("--prefix", type=int, default=2000, help="shared prompt head, tokens")
    p.add_argument("--own", type=int, default=100, help="each row's own tokens after it")
    p.add_argument("--threads", type=int, default=2, help="OpenMP threads")
    p.add_argument("--calls", type=int, default=30, help="calls timed together (layers)")
    p.add_argument("--rounds", type=int, default=5, help="best of this many")
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    lib = load_kernel()
    if lib is None:
        print("no x86-64 AVX2/FMA CPU or C compiler: the CPU kernel cannot run here")
        return 1
    results = [one_case(lib, int(r), args) for r in args.rows.split(",")]
    print(
        f"prefix {args.prefix - args.prefix % BLOCK} shared tokens + {args.own} own, "
        f"{args.calls} calls, {args.threads} threads"
    )
    print(
        f"{'rows':>4} | {'shared ms':>9} | {'copied ms':>9} | {'copied/shared':>13} | "
        f"{'KV MiB shared':>13} | {'KV MiB copied':>13}"
    )
    for r in results:
        print(
            f"{r['rows']:>4} | {r['shared_ms']:>9.2f} | {r['copied_ms']:>9.2f} | "
            f"{r['speedup']:>12.2f}x | {r['kv_mib_shared']:>13.0f} | {r['kv_mib_copied']:>13.0f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
