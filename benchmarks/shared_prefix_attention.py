"""Decode attention over a shared prompt head: the CPU kernel (paged_decode.c) on R decode
rows whose first P tokens are the same prompt head, three ways, one run:

    shared    one call, the tables naming the same physical blocks for the head (what prefix
              caching gives): the kernel groups the rows and reads the head once for them
    per row   the same tables, one call per row: the head read once per row, from the CPU's
              caches after the first (the kernel's cost without grouping, plus R-1 calls'
              overhead, a few microseconds each)
    copied    one call, each row holding its own copy of the head's blocks (same values): R
              reads from memory, what rows with distinct contexts of the same length cost

    python -m benchmarks.shared_prefix_attention [--rows 1,4,8,16,32] [--prefix 2000]
        [--own 100] [--threads 2] [--calls 30] [--rounds 5]

Shapes are SmolLM2's (9 query heads, 3 KV heads, head dim 64, block size 16); a call is one
layer's decode attention, each over a cache of its own, --calls of them timed together (30:
one step of the model's layers). Printed per R: ms per --calls layers each way, per row /
shared and copied / shared, and the KV each reads. All give the same output (within float32
rounding).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time

import torch

from engine.attention.cpu_backend import load_kernel
from engine.attention.kv_layout import allocate_kv_cache, head_major

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
WAYS = ("shared", "per row", "copied")


def tables_for(rows: int, prefix: int, own: int, shared: bool) -> tuple[torch.Tensor, int]:
    """Block tables [rows, blocks] of `rows` sequences of prefix + own tokens (prefix: whole
    blocks): the prefix's blocks shared (the same ids in every table) or copied (ids of their
    own); and the blocks used."""
    head, per_row = prefix // BLOCK, -(-(prefix + own) // BLOCK)
    tables, next_id = [], head if shared else 0
    for _ in range(rows):
        n = per_row - head if shared else per_row
        tables.append((list(range(head)) if shared else []) + list(range(next_id, next_id + n)))
        next_id += n
    return torch.tensor(tables, dtype=torch.int64), next_id


def attend(
    lib,
    q: torch.Tensor,
    cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """One baton_paged_decode call: q [R, H, D] over cache (head-major), tables [R, blocks],
    lens [R], into out."""
    rc = lib.baton_paged_decode(
        q.data_ptr(),
        cache.data_ptr(),
        *cache.stride()[:4],
        tables.data_ptr(),
        tables.shape[1],
        lens.data_ptr(),
        q.shape[0],
        HEADS,
        KV_HEADS,
        HEAD_DIM,
        BLOCK,
        ctypes.c_float(HEAD_DIM**-0.5),
        out.data_ptr(),
    )
    if rc != 0:
        raise RuntimeError(f"baton_paged_decode returned {rc}")


def one_case(lib, rows: int, args) -> dict:
    prefix = args.prefix - args.prefix % BLOCK  # only full blocks are shared
    seq_len = prefix + args.own
    gen = torch.Generator().manual_seed(rows)
    shared_tables, num_shared = tables_for(rows, prefix, args.own, True)
    copied_tables, num_copied = tables_for(rows, prefix, args.own, False)
    # one cache per call, as each layer has its own: the step streams them all from memory
    # kept as head-major [2, KVH, num_blocks, block, D] views, as the kernel reads them
    shared_caches, copied_caches = [], []
    for _ in range(args.calls):
        shared_cache = allocate_kv_cache(
            num_shared, BLOCK, KV_HEADS, HEAD_DIM, torch.float32, "cpu"
        )
        shared_cache.copy_(torch.randn(shared_cache.shape, generator=gen))
        shared_caches.append(head_major(shared_cache))
        # each copied table holds the values of the same row's shared table: the same keys
        copied = allocate_kv_cache(num_copied, BLOCK, KV_HEADS, HEAD_DIM, torch.float32, "cpu")
        copied.copy_(shared_cache[:, shared_tables.flatten()])
        copied_caches.append(head_major(copied))
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=gen)
    lens = torch.full((rows,), seq_len, dtype=torch.int64)
    # (caches, calls per layer as (q, tables, lens, out)) each way
    outs = {way: torch.empty_like(q) for way in WAYS}
    ways = {
        "shared": (shared_caches, [(q, shared_tables, lens, outs["shared"])]),
        "per row": (
            shared_caches,
            [
                (
                    q[r : r + 1],
                    shared_tables[r : r + 1],
                    lens[r : r + 1],
                    outs["per row"][r : r + 1],
                )
                for r in range(rows)
            ],
        ),
        "copied": (copied_caches, [(q, copied_tables, lens, outs["copied"])]),
    }
    best = {}
    for way, (caches, calls) in ways.items():
        for call in calls:  # a warm-up, and the output compared below
            attend(lib, call[0], caches[0], *call[1:])
        times = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            for cache in caches:
                for call in calls:
                    attend(lib, call[0], cache, *call[1:])
            times.append(time.perf_counter() - start)
        best[way] = min(times)
    for way in WAYS[1:]:
        torch.testing.assert_close(outs[way], outs["shared"], atol=1e-5, rtol=1e-5)
    kv_token = KV_HEADS * HEAD_DIM * 8 * args.calls / 2**20  # K and V, float32, every layer
    return {
        "rows": rows,
        **{f"{way.replace(' ', '_')}_ms": 1e3 * best[way] for way in WAYS},
        "per_row_over_shared": best["per row"] / best["shared"],
        "copied_over_shared": best["copied"] / best["shared"],
        "kv_mib_shared": (prefix + rows * args.own) * kv_token,
        "kv_mib_copied": rows * seq_len * kv_token,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", default="1,4,8,16,32", help="comma-separated decode rows")
    p.add_argument("--prefix", type=int, default=2000, help="shared prompt head, tokens")
    p.add_argument("--own", type=int, default=100, help="each row's own tokens after it")
    p.add_argument("--threads", type=int, default=2, help="OpenMP threads")
    p.add_argument("--calls", type=int, default=30, help="calls timed together (layers)")
    p.add_argument("--rounds", type=int, default=5, help="best of this many")
    p.add_argument("--json", help="also write the rows to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    lib = load_kernel()
    if lib is None:
        print("no x86-64 AVX2/FMA CPU or C compiler: the CPU kernel cannot run here")
        return 1
    results = [one_case(lib, int(r), args) for r in args.rows.split(",")]
    print(
        f"prefix {args.prefix - args.prefix % BLOCK} shared tokens + {args.own} own, "
        f"{args.calls} calls, {args.threads} threads; ms per {args.calls} layers"
    )
    print(
        f"{'rows':>4} | {'shared':>7} | {'per row':>7} | {'copied':>7} | {'per row/shared':>14} | "
        f"{'copied/shared':>13} | {'KV MiB shared':>13} | {'KV MiB copied':>13}"
    )
    for r in results:
        print(
            f"{r['rows']:>4} | {r['shared_ms']:>7.2f} | {r['per_row_ms']:>7.2f} | "
            f"{r['copied_ms']:>7.2f} | {r['per_row_over_shared']:>13.2f}x | "
            f"{r['copied_over_shared']:>12.2f}x | {r['kv_mib_shared']:>13.0f} | "
            f"{r['kv_mib_copied']:>13.0f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
