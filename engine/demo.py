"""`make demo`: the offline engine on the default model over prompts sharing a long prefix.

Prints each answer, how many prompt tokens came from the prefix cache, TTFT and tokens/s.
"""

from __future__ import annotations

import argparse
import time

import torch

from engine import LLM, SamplingParams

SYSTEM = (
    "You are Baton's support assistant. You answer questions about running large language "
    "models in production: batching, KV caches, prefix caching, chunked prefill, "
    "disaggregated prefill and decode, GPUs, memory bandwidth and latency. Answer in one or "
    "two short sentences, plainly, without lists. If you do not know, say so. "
) * 3
QUESTIONS = [
    "What is a KV cache?",
    "Why does prefix caching help agents?",
    "What does chunked prefill change?",
    "Why separate prefill and decode?",
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"loading {args.model} ...", flush=True)
    start = time.perf_counter()
    llm = LLM(args.model)
    print(f"loaded in {time.perf_counter() - start:.1f}s from {llm.engine.model_dir}")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    convs = [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS
    ]
    # The first request fills the prefix cache; the rest run as one continuous batch.
    for batch in (convs[:1], convs[1:]):
        start = time.perf_counter()
        outs = llm.chat(batch, params)
        wall = time.perf_counter() - start
        for conv, out in zip(batch, outs, strict=True):
            print(f"\nQ: {conv[-1]['content']}\nA: {out.text.strip()}")
            print(
                f"   prompt {len(out.prompt_token_ids)} tokens, cached "
                f"{out.num_cached_tokens}, TTFT {out.ttft * 1000:.0f} ms, "
                f"{len(out.token_ids)} tokens, finish={out.finish_reason}"
            )
        total = sum(len(o.token_ids) for o in outs)
        print(f"-- batch of {len(batch)}: {total} tokens in {wall:.2f}s ({total / wall:.1f} tok/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
