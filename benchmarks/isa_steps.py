"""Whole engine steps with two instruction-set choices (the engine option gguf_isa), one run:

    python -m benchmarks.isa_steps [--model smollm2-135m-instruct] [--threads 2]
        [--isas auto,avx512] [--rows 16,32,64] [--prompt-len 256] [--context 256] [--rounds 3]

Two engines of the same model in one process, one per gguf_isa value (auto takes AMX tiles for
the fused step's products of many rows where the CPU has them; avx512 the lanes), timed in
turn each round so that a drift of the machine's speed hits both: a prompt of --prompt-len
random tokens to its first token, and decode steps of each --rows count (that many requests
of --context random tokens, then the median of 16 steps of all rows). Printed per measurement:
each engine's best round in ms, its fused step's parts in that round, and each other engine's
time over the first's.
"""

from __future__ import annotations

import argparse

from benchmarks.serving_bounds import MODEL_ALIAS, Steps
from engine.model.fused_decode import PARTS

DECODE_STEPS = 16
# each fused part's name in the printed lines
PART_LABELS = dict(
    zip(PARTS, ("norms", "qkv", "attention", "o", "gate/up", "down", "logits"), strict=True)
)


def decode_step(steps: Steps, rows: int, context: int) -> tuple[float, list[float]]:
    """Median seconds of a decode step of `rows` requests and the fused parts' seconds a step."""
    seconds, parts = steps.decode([], context, rows, DECODE_STEPS)
    return seconds, [parts.get(name, 0.0) for name in PARTS]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=MODEL_ALIAS)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--isas", default="auto,avx512", help="gguf_isa values, the first the base")
    p.add_argument("--rows", default="16,32,64", help="decode steps of these many rows")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--context", type=int, default=256, help="each decode row's prompt tokens")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    isas = [i for i in args.isas.split(",") if i]
    engines = {isa: Steps(args.model, args.threads, gguf_isa=isa) for isa in isas}
    names = [f"prompt of {args.prompt_len}"] + [f"decode, {r} rows" for r in args.rows.split(",")]
    best: dict[tuple[str, str], tuple[float, list[float]]] = {}
    for _ in range(args.rounds):
        for isa, steps in engines.items():
            seconds, parts = steps.prefill([], args.prompt_len)
            runs = [(seconds, [parts.get(name, 0.0) for name in PARTS])]
            runs += [decode_step(steps, int(r), args.context) for r in args.rows.split(",")]
            for name, run in zip(names, runs, strict=True):
                if (isa, name) not in best or run[0] < best[isa, name][0]:
                    best[isa, name] = run
    print(f"{args.model}, {args.threads} threads, best of {args.rounds} rounds (ms)")
    for name in names:
        base = best[isas[0], name][0]
        for isa in isas:
            seconds, parts = best[isa, name]
            ratio = "" if isa == isas[0] else f"  time {isa} / {isas[0]}: {seconds / base:.2f}x"
            labelled = zip(PART_LABELS.values(), parts, strict=True)
            detail = ", ".join(f"{label} {1e3 * v:.1f}" for label, v in labelled)
            print(f"{name:>18}  {isa:>8} {1e3 * seconds:8.1f}{ratio}  ({detail})")


if __name__ == "__main__":
    main()
