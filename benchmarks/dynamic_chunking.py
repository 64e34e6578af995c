"""Dynamic chunking vs fixed chunk sizes, offline on one engine: 8 requests decode while a
long prompt arrives; how long are the steps while it prefills, and how soon is its first token.

    python -m benchmarks.dynamic_chunking [--model smollm2-135m-instruct] [--threads 1]
        [--prompt-len 2048] [--chunks 256 512 1024 2048] [--targets-ms 250 500 1000]
        [--stretches 2 3]

One engine serves every configuration (its scheduler's chunk size or ChunkBudget swapped
between runs, prefix caching off, fresh prompts each run). A run starts 8 decoding requests,
then adds the long prompt and steps until its first token: the step times of those steps
(p50 / p99 / max; every decoding request waits that long for its next token) and the prompt's
TTFT are printed. A target run (itl_target_ms) and a stretch run (decode_stretch)
start from the shipped step profile (engine.step_model) with a fresh online correction; the
final correction ratio is printed.
"""

from __future__ import annotations

import argparse
import time

import torch

from engine import LLMEngine, SamplingParams
from engine.chunk_budget import ChunkBudget, DecodeStretchBudget
from engine.scheduler import SchedulerConfig
from engine.step_model import find_step_model
from perf.stats import percentile

DECODERS = 8


def run(engine: LLMEngine, prompt_len: int, gen: torch.Generator) -> dict:
    """8 decodes, then the long prompt: step times until its first token, and its TTFT."""
    vocab = engine.runner.model.args.vocab_size
    decoding = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    decoders = [f"d{i}" for i in range(DECODERS)]
    for rid in decoders:
        engine.add_request(rid, torch.randint(3, vocab, (64,), generator=gen).tolist(), decoding)
    while set(engine.step().scheduled.values()) != {1}:
        pass
    long = torch.randint(3, vocab, (prompt_len,), generator=gen).tolist()
    engine.add_request("long", long, SamplingParams(max_tokens=1, temperature=0.0))
    start = time.perf_counter()
    steps, chunks = [], []
    while "long" in engine.scheduler.requests:
        t = time.perf_counter()
        result = engine.step()
        steps.append(time.perf_counter() - t)
        chunks.append(result.scheduled.get("long", 0))
    ttft = time.perf_counter() - start
    for rid in decoders:
        engine.abort(rid)
    engine.step()
    return {"steps": steps, "chunks": chunks, "ttft": ttft}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--chunks", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--targets-ms", type=float, nargs="+", default=[250, 500, 1000])
    parser.add_argument("--stretches", type=float, nargs="+", default=[2.0, 3.0])
    args = parser.parse_args(argv)

    max_tokens = max(args.chunks + [args.prompt_len]) + DECODERS
    engine = LLMEngine(
        args.model,
        num_threads=args.threads,
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        max_num_batched_tokens=max_tokens,
        chunk_size=max(args.chunks),
        num_kv_blocks=-(-(args.prompt_len + DECODERS * 2048) // 16),
    )
    model = find_step_model(None, engine.step_profile_key())
    print(f"engine {engine.step_profile_key()}; step profile: {model.note or model.key}")
    gen = torch.Generator().manual_seed(0)
    run(engine, 256, gen)  # warm-up
    configs = [("chunk", c) for c in args.chunks] + [("target", t) for t in args.targets_ms]
    configs += [("stretch", x) for x in args.stretches]
    print(
        f"{DECODERS} decoding + one {args.prompt_len}-token prompt; steps while it prefills\n"
        f"{'config':>16} {'steps':>5} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} "
        f"{'TTFT s':>7}  chunks"
    )
    for kind, value in configs:
        engine.scheduler.budget = None
        chunk = int(value) if kind == "chunk" else max(args.chunks)
        engine.scheduler.config = SchedulerConfig(max_tokens, chunk, 128)
        if kind == "target":
            engine.scheduler.budget = ChunkBudget(model, value / 1000, engine.config.block_size)
        elif kind == "stretch":
            engine.scheduler.budget = DecodeStretchBudget(
                model, value, engine.config.block_size, chunk
            )
        r = run(engine, args.prompt_len, gen)
        ms = [s * 1000 for s in r["steps"]]
        label = {
            "chunk": f"chunk_size {value}",
            "target": f"target {value:g} ms",
            "stretch": f"stretch {value:g}x",
        }[kind]
        shown = ",".join(map(str, r["chunks"][:12])) + (",..." if len(r["chunks"]) > 12 else "")
        budget = engine.scheduler.budget
        extra = f"  ratio {budget.ratio:.2f}" if budget is not None else ""
        print(
            f"{label:>16} {len(ms):5d} {percentile(ms, 50):8.0f} {percentile(ms, 99):8.0f} "
            f"{max(ms):8.0f} {r['ttft']:7.2f}  {shown}{extra}",
            flush=True,
        )


if __name__ == "__main__":
    main()
