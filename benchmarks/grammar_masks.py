"""What structured-output masks cost per decode step: the same prompts decoded with every row
constrained by one JSON schema and with none, one run:

    python -m benchmarks.grammar_masks [--model smollm2-135m-instruct] [--threads 2]
        [--batches 1,32] [--prompt-len 64] [--steps 32] [--rounds 3] [--json FILE]

For each batch size B, B requests of --prompt-len random tokens decode --steps + 1 tokens
each (ignore_eos), constrained or not; the decode steps in which all B rows decode are timed
one by one (engine.step(), the whole step as an inter-token latency sees it). The schema's
array needs more items than the run has tokens, so the grammar never ends a request early
and both runs decode the same number of tokens. In the constrained run the mask work is
timed inside the step: the bitmask fill (per row: the matcher accepts the last token and
fills the next token's bitmask, GrammarManager.bitmask) and the apply (one batched
apply_token_bitmask_inplace over the rows, logits_processors._apply_bitmasks). Rounds
alternate between the two modes on one engine; each mode keeps its best round's medians.

Printed per B: ms per step unconstrained and constrained, the difference, and the fill and
apply ms with their sum as a fraction of the constrained step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

import engine.logits_processors as logits_processors
from engine import LLM, SamplingParams

MODEL_ALIAS = "smollm2-135m-instruct"


def schema(min_items: int) -> dict:
    """An object of named counts; at least min_items items, so it cannot end sooner."""
    item = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
        "required": ["name", "count"],
    }
    items = {"type": "array", "items": item, "minItems": min_items}
    return {"type": "object", "properties": {"items": items}, "required": ["items"]}


@dataclass(frozen=True, slots=True)
class StepTimes:
    """Medians over the timed steps of one round, in seconds."""

    step: float
    fill: float = 0.0
    apply: float = 0.0


class MaskClock:
    """Seconds spent in the mask work since the last take(): fill and apply."""

    def __init__(self) -> None:
        self.fill = 0.0
        self.apply = 0.0

    def take(self) -> tuple[float, float]:
        out = (self.fill, self.apply)
        self.fill = self.apply = 0.0
        return out

    def timed(self, fn, kind: str):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                setattr(self, kind, getattr(self, kind) + elapsed)

        return wrapper


@contextmanager
def clocked(llm: LLM, clock: MaskClock):
    """The engine's bitmask fill and the sampler's bitmask apply, timed into `clock`."""
    grammar = llm.engine.grammar
    fill, apply = grammar.bitmask, logits_processors._apply_bitmasks
    grammar.bitmask = clock.timed(fill, "fill")
    logits_processors._apply_bitmasks = clock.timed(apply, "apply")
    try:
        yield
    finally:
        del grammar.bitmask
        logits_processors._apply_bitmasks = apply


def decode_round(llm: LLM, prompts: list, params: SamplingParams, tag: str, clock) -> StepTimes:
    """Medians of the steps in which all len(prompts) rows decode (prefill steps and the steps
    after the first request ends are not timed); raises if a request ended early."""
    engine = llm.engine
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    steps, fills, applies = [], [], []
    produced = dict.fromkeys(ids, 0)
    while engine.has_unfinished():
        clock.take()
        start = time.perf_counter()
        result = engine.step()
        elapsed = time.perf_counter() - start
        fill, apply = clock.take()
        for rid, out in result.outputs.items():
            produced[rid] += len(out.new_token_ids)
        if len(result.scheduled) == len(prompts) and all(n == 1 for n in result.scheduled.values()):
            steps.append(elapsed)
            fills.append(fill)
            applies.append(apply)
    short = {rid: n for rid, n in produced.items() if n != params.max_tokens}
    if short:
        raise RuntimeError(f"requests ended before max_tokens={params.max_tokens}: {short}")
    return StepTimes(statistics.median(steps), statistics.median(fills), statistics.median(applies))


def measure(args) -> list[dict]:
    """Per batch size: the best round of each mode, and the mask work's share."""
    batches = [int(b) for b in args.batches.split(",")]
    biggest = max(batches)
    tokens = args.prompt_len + args.steps + 2
    llm = LLM(
        args.model,
        dtype="float32",
        num_threads=args.threads,
        enable_prefix_caching=False,  # every round prefills its prompts anew, alike
        num_kv_blocks=biggest * -(-tokens // 16) + 16,
        max_num_seqs=biggest,
        max_num_batched_tokens=max(2048, biggest * args.prompt_len),
        prefill_batch_tokens=max(2048, biggest * args.prompt_len),  # the prompts in one step
        chunk_size=max(1024, args.prompt_len),
    )
    vocab = llm.engine.runner.model.args.vocab_size
    constrained = SamplingParams(
        max_tokens=args.steps + 1,
        temperature=0.0,
        ignore_eos=True,
        structured_output={"json": schema(args.steps + 2)},
    )
    free = SamplingParams(max_tokens=args.steps + 1, temperature=0.0, ignore_eos=True)
    clock = MaskClock()
    rows = []
    with clocked(llm, clock):
        for b in batches:
            g = torch.Generator().manual_seed(b)
            prompts = [torch.randint(100, vocab, (args.prompt_len,), generator=g).tolist()] * b
            best: dict[str, StepTimes] = {}
            for r in range(args.rounds):
                for mode, params in (("free", free), ("masked", constrained)):
                    got = decode_round(llm, prompts, params, f"{mode}-{b}-{r}", clock)
                    if mode not in best or got.step < best[mode].step:
                        best[mode] = got
            masked, base = best["masked"], best["free"]
            rows.append(
                {
                    "batch": b,
                    "free_ms": base.step * 1e3,
                    "masked_ms": masked.step * 1e3,
                    "fill_ms": masked.fill * 1e3,
                    "apply_ms": masked.apply * 1e3,
                    "mask_fraction": (masked.fill + masked.apply) / masked.step,
                    "free": asdict(base),
                    "masked": asdict(masked),
                }
            )
            print(f"B={b} done", file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=MODEL_ALIAS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    rows = measure(args)
    print(
        f"{'B':>3} {'free ms':>8} {'masked ms':>9} {'+ms':>7} {'fill ms':>8} {'apply ms':>8} "
        f"{'mask/step':>9}"
    )
    for r in rows:
        print(
            f"{r['batch']:>3} {r['free_ms']:8.2f} {r['masked_ms']:9.2f} "
            f"{r['masked_ms'] - r['free_ms']:7.2f} {r['fill_ms']:8.2f} {r['apply_ms']:8.3f} "
            f"{r['mask_fraction']:9.1%}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
