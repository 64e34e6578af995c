"""Decode speed by batch size, the fused decode step on vs off (engine option fused_decode),
one run:

    python -m benchmarks.decode_batch [--model smollm2-135m-instruct] [--threads 2]
        [--batches 1,2,4,8,16,32] [--prompt-len 128] [--steps 32] [--rounds 3] [--json FILE]

For each batch size B, B requests of --prompt-len random tokens are prefilled together; then
--steps decode steps of all B rows are timed one by one (engine.step(), the whole step as a
token's inter-token latency sees it: scheduling, the model, sampling). Rounds alternate
between the two engines (same model, same prompts), so that drifts of the machine's speed hit
both alike; each engine keeps the best round's median step. Printed per B: ms per step and
decode tokens/s (B / step time) of each, and the ratio fused / unfused of tokens/s.

The fused engine runs every decode-only step in one C call, past fused_decode.MAX_ROWS rows
too (the bound serving uses, chosen from these figures). Needs a model converted from a GGUF
(Q4_1 / Q8_0 blocks), CPU float32; elsewhere both engines run the same unfused path.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from engine import LLM, SamplingParams
from engine.model.fused_decode import MAX_ROWS

MODEL_ALIAS = "smollm2-135m-instruct"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def prompts_of(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab, (length,), generator=g).tolist() for _ in range(n)]


def decode_step_s(llm: LLM, prompts: list[list[int]], steps: int, tag: str) -> float:
    """Median seconds of the decode steps in which all len(prompts) requests decode together
    (the prefill steps before them and the steps after the first request ends are not timed)."""
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    times: list[float] = []
    while engine.has_unfinished():
        start = time.perf_counter()
        result = engine.step()
        elapsed = time.perf_counter() - start
        decode_of_all = len(result.scheduled) == len(prompts) and all(
            n == 1 for n in result.scheduled.values()
        )
        if decode_of_all:
            times.append(elapsed)
    if len(times) < steps:
        raise RuntimeError(f"only {len(times)} of {steps} steps decoded all {len(prompts)} rows")
    return statistics.median(times)


def measure(args) -> list[dict]:
    """Per batch size: the best round's median step time of each engine, and the ratios."""
    batches = [int(b) for b in args.batches.split(",")]
    biggest = max(batches)
    blocks = biggest * -(-(args.prompt_len + args.steps + 1) // 16) + 16
    opts = dict(
        dtype="float32",
        skip_tokenizer_init=True,  # token-id prompts only
        num_threads=args.threads,
        enable_prefix_caching=False,  # every round prefills its prompts anew, alike
        num_kv_blocks=blocks,
        max_num_seqs=biggest,
        max_num_batched_tokens=max(2048, biggest * args.prompt_len),
        prefill_batch_tokens=max(2048, biggest * args.prompt_len),  # the prompts in one step
        chunk_size=max(1024, args.prompt_len),
    )
    engines = {
        "fused": LLM(args.model, fused_decode=True, **opts),
        "unfused": LLM(args.model, fused_decode=False, **opts),
    }
    engines["fused"].engine.runner.fused_max_rows = biggest  # measured past MAX_ROWS too
    if engines["fused"].engine.runner.fused is None:
        log("note: this model cannot run the fused step here; both engines run unfused")
    vocab = engines["fused"].engine.runner.model.args.vocab_size
    for llm in engines.values():  # warm-up: kernels built, caches touched
        decode_step_s(llm, prompts_of(2, 16, vocab, 0), 2, "warm")
    rows = []
    for b in batches:
        best = {name: float("inf") for name in engines}
        for round_ in range(args.rounds):
            prompts = prompts_of(b, args.prompt_len, vocab, 1000 * b + round_)
            for name, llm in engines.items():
                log(f"batch {b}, round {round_ + 1}/{args.rounds}: {name}")
                step = decode_step_s(llm, prompts, args.steps, f"{name}-{b}-{round_}")
                best[name] = min(best[name], step)
        rows.append(
            {
                "batch": b,
                "fused_runs": engines["fused"].engine.runner.fused is not None,
                "serving_runs_fused": b <= MAX_ROWS,
                "fused_ms_per_step": 1e3 * best["fused"],
                "unfused_ms_per_step": 1e3 * best["unfused"],
                "fused_tok_s": b / best["fused"],
                "unfused_tok_s": b / best["unfused"],
                "speedup": best["unfused"] / best["fused"],
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    print(
        f"{'batch':>5} | {'fused ms/step':>13} | {'unfused ms/step':>15} | "
        f"{'fused tok/s':>11} | {'unfused tok/s':>13} | {'fused/unfused':>13}"
    )
    for r in rows:
        note = "" if r["fused_runs"] else "  (unfused in both)"
        print(
            f"{r['batch']:>5} | {r['fused_ms_per_step']:>13.2f} | "
            f"{r['unfused_ms_per_step']:>15.2f} | {r['fused_tok_s']:>11.1f} | "
            f"{r['unfused_tok_s']:>13.1f} | {r['speedup']:>12.2f}x{note}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=MODEL_ALIAS, help="alias, HF directory or .gguf")
    p.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads")
    p.add_argument("--batches", default="1,2,4,8,16,32", help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per round")
    p.add_argument("--rounds", type=int, default=3, help="best of this many rounds each")
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    rows = measure(args)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
