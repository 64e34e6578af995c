"""First-token times of prompts that arrive together, by prefill_batch_tokens, one run:

    python -m benchmarks.prefill_batching [--model smollm2-135m-instruct] [--threads 2]
        [--limits none,32] [--prompts 4] [--cached 2000] [--new 64] [--decodes 3]
        [--output-len 16] [--rounds 3]

A wave of --prompts requests, each --cached tokens of one shared system prompt (cached by a
warm-up request) and --new tokens of its own, reaches an engine that is decoding --decodes
other requests, all at the same moment: a closed-loop client's streams that finished
together. Printed per limit (engine option prefill_batch_tokens; none: prompts batch up to
max_num_batched_tokens): each prompt's time to first token (ms from the wave's arrival to
the step that sampled it), their median, and the time until the whole wave has its first
tokens. Rounds alternate between the engines; each keeps the round with the lowest median.

On CPU a step of a few dozen prompt tokens is compute-bound already: batching the wave into
one step costs about as much as prefilling it one prompt after another, so the limit moves
the earlier prompts' first tokens forward; the wave's last first token comes later by what
the decode rows add to each extra step (they are not idle: each such step gives every
running request a token). On CUDA the engine's default is no limit.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine import LLM, SamplingParams

MODEL_ALIAS = "smollm2-135m-instruct"


def parse_limits(text: str) -> list[int | None]:
    return [None if part == "none" else int(part) for part in text.split(",")]


def build(model: str, threads: int, limit: int | None):
    # None here means "no limit": the engine option's None would pick the device default
    batch = limit if limit is not None else 1 << 20
    options = dict(dtype="float32", skip_tokenizer_init=True, num_threads=threads)
    return LLM(model, prefill_batch_tokens=batch, **options).engine


def wave(engine, args, system: list[int], g: torch.Generator, tag: str) -> list[float]:
    """Time to first token (ms) of each prompt of one wave, in arrival order."""
    vocab = 40_000

    def add(rid: str, tokens: int, out: int) -> None:
        prompt = system + torch.randint(100, vocab, (tokens,), generator=g).tolist()
        params = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)
        engine.add_request(rid, prompt, params)

    for i in range(args.decodes):
        add(f"{tag}-decode{i}", args.new, args.output_len + 1000)
    while engine.scheduler.waiting or any(
        r.num_tokens - r.num_computed_tokens > 1 for r in engine.scheduler.running
    ):
        engine.step()  # the decodes are decoding
    arrival = time.perf_counter()
    for i in range(args.prompts):
        add(f"{tag}-p{i}", args.new, args.output_len)
    first: dict[str, float] = {}
    while len(first) < args.prompts:
        outputs = engine.step().outputs
        now = time.perf_counter()
        for rid in outputs:
            if "-p" in rid:
                first.setdefault(rid, 1e3 * (now - arrival))
    for rid in list(engine.scheduler.requests):
        engine.abort(rid)
    return [first[f"{tag}-p{i}"] for i in range(args.prompts)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=MODEL_ALIAS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--limits", type=parse_limits, default=parse_limits("none,32"))
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--cached", type=int, default=2000)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--decodes", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    system = torch.randint(100, 40_000, (args.cached,), generator=g).tolist()
    engines = {limit: build(args.model, args.threads, limit) for limit in args.limits}
    for limit, engine in engines.items():
        wave(engine, args, system, g, f"warm{limit}")  # caches the system prompt
    best: dict[int | None, list[float]] = {}
    for r in range(args.rounds):
        for limit, engine in engines.items():
            ttft = wave(engine, args, system, g, f"r{r}l{limit}")
            if limit not in best or statistics.median(ttft) < statistics.median(best[limit]):
                best[limit] = ttft
    print(
        f"{args.prompts} prompts of {args.cached} cached + {args.new} new tokens arriving "
        f"together beside {args.decodes} decodes, {args.threads} threads; ms to first token"
    )
    print(f"{'prefill_batch_tokens':>20}  {'each prompt':<32} {'median':>8} {'last':>8}")
    for limit, ttft in best.items():
        each = " ".join(f"{t:.0f}" for t in ttft)
        name = "none" if limit is None else str(limit)
        print(f"{name:>20}  {each:<32} {statistics.median(ttft):>8.0f} {max(ttft):>8.0f}")
    base = best.get(None)
    for limit, ttft in best.items():
        if base is not None and limit is not None:
            ratio = statistics.median(base) / statistics.median(ttft)
            last = max(ttft) / max(base)
            print(f"limit {limit}: median first token {ratio:.2f}x sooner, wave's last {last:.2f}x")


if __name__ == "__main__":
    main()
