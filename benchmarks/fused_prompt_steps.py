"""Prompt steps, fused vs per-operation, one run: a step carrying one prompt's chunk of N
tokens beside D decode rows (what a serving engine runs when a request arrives while others
decode), through the fused C step and through the per-operation path:

    python -m benchmarks.fused_prompt_steps [--model smollm2-135m-instruct] [--threads 2]
        [--prompt-lens 256,512,1000] [--decode-rows 0,3,15] [--context 300] [--rounds 5]
        [--json FILE]

One engine; each case runs both ways in turn, the fused bound (the runner's fused_max_rows)
set above and below the step's rows, so that drifts of the machine's speed hit both alike.
Per case: D requests of --context random tokens are prefilled and decoding, then a prompt of
N random tokens arrives and the next step, the one that prefills it beside the D decode rows,
is timed (engine.step(): scheduling, the model, sampling). Printed per (N, D): the median ms
of the step each way over --rounds and the ratio per-operation / fused. These figures chose
fused_decode.MAX_ROWS. Needs a model converted from a GGUF (Q4_1 / Q8_0 blocks), CPU float32.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks.serving_bounds import MODEL_ALIAS, Steps

WAYS = ("fused", "per-operation")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=MODEL_ALIAS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-lens", default="256,512,1000")
    parser.add_argument("--decode-rows", default="0,3,15")
    parser.add_argument("--context", type=int, default=300, help="decode rows' prompt tokens")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    prompt_lens = [int(n) for n in args.prompt_lens.split(",")]
    decode_rows = [int(d) for d in args.decode_rows.split(",")]

    steps = Steps(
        args.model,
        args.threads,
        chunk_size=max(prompt_lens),
        max_num_batched_tokens=max(prompt_lens) + max(decode_rows),
    )
    engine = steps.engine
    if engine.runner.fused is None:
        raise SystemExit(f"{args.model}: the fused step does not run here (needs GGUF blocks, CPU)")

    def prompt_step(n: int, d: int, fused: bool) -> float:
        for _ in range(d):
            steps.add(steps.tokens(args.context), 8)
        steps.prefill_all()  # the D requests decoding
        engine.runner.fused_max_rows = n + d if fused else n + d - 1
        steps.add(steps.tokens(n), 2)
        start = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - start
        steps.finish()
        return seconds

    times: dict[tuple[int, int, str], list[float]] = {}
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}", flush=True)
        for n in prompt_lens:
            for d in decode_rows:
                for way in WAYS if r % 2 == 0 else WAYS[::-1]:
                    seconds = prompt_step(n, d, way == "fused")
                    times.setdefault((n, d, way), []).append(seconds * 1e3)

    rows = []
    print(f"{args.model}, {args.threads} threads; ms of the step that prefills the prompt")
    print("prompt | decode rows | step rows |  fused | per-operation | per-operation / fused")
    for n in prompt_lens:
        for d in decode_rows:
            fused = statistics.median(times[(n, d, "fused")])
            per_op = statistics.median(times[(n, d, "per-operation")])
            rows.append(dict(prompt=n, decode_rows=d, fused_ms=fused, per_operation_ms=per_op))
            print(
                f"{n:6d} | {d:11d} | {n + d:9d} | {fused:6.0f} | {per_op:13.0f} | "
                f"{per_op / fused:20.2f}x"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
