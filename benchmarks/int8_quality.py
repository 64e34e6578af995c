"""What int8 activations (EngineOptions.int8_activations) cost in quality, on the real model.

    python -m benchmarks.int8_quality [--threads 2] [--prompts 24] [--new 64] [--rows 1]

Two engines on the same GGUF model (SmolLM2-135M-Instruct Q4_1 by default), the exact
float32 path and int8 activations, both CPU float32 with GGUF blocks:
  (a) greedy agreement: each fixed chat prompt (CHAT_PROMPTS, through the chat template) is
      generated alone (batch-1 decode: every decode step has one row, so the int8 engine
      uses its int8 kernels for every product), --new tokens each. Reported: the mean
      fraction of tokens identical up to the first divergence, and the fraction of prompts
      whose whole output is identical.
  (b) perplexity, teacher-forced, on benchmarks/data/int8_quality_text.txt (public-domain
      text written for this repo): the text's tokens are fed --rows at a time (default 1,
      the decode case; at most 8 so that the int8 engine's products stay int8) through the
      engine's model and paged KV cache, and every next token's log-probability is summed.
Prefill (a prompt of more than 8 tokens in one step) is float32 in both engines by design.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

from benchmarks.engine import log
from engine import LLM, SamplingParams
from engine.attention.metadata import build_metadata
from engine.model.gguf_linear import QUANT_MAX_ROWS

MODEL_ALIAS = "smollm2-135m-instruct"
TEXT = Path(__file__).with_name("data") / "int8_quality_text.txt"
CHAT_PROMPTS = (
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.",
    "How do I reverse a list in Python?",
    "Give me three tips for sleeping better.",
    "What is the difference between weather and climate?",
    "Summarize the plot of Romeo and Juliet.",
    "Why is the sky blue?",
    "Write a short email asking my manager for a day off.",
    "What are prime numbers? Give examples.",
    "Describe a cat to someone who has never seen one.",
    "How does a bicycle stay upright?",
    "List five fruits that are high in vitamin C.",
    "What is machine learning?",
    "Tell me a joke about computers.",
    "How many continents are there, and what are they?",
    "What should I pack for a weekend camping trip?",
    "Explain what a black hole is to a child.",
    "Translate 'good morning' into Spanish and French.",
    "What is the boiling point of water at sea level?",
    "Write a limerick about a dog who loves to dig.",
    "How do vaccines work?",
    "What causes the seasons on Earth?",
    "Suggest a name for a small bakery.",
    "What is the Pythagorean theorem?",
    "Give me a simple recipe for pancakes.",
    "Why do leaves change color in autumn?",
    "What is the largest planet in our solar system?",
    "How can I improve my handwriting?",
    "Explain the rules of chess in a few sentences.",
    "What is an API?",
    "Write two sentences about the history of the printing press.",
)


def agreement(exact: LLM, int8: LLM, prompts: list[list[int]], new: int) -> tuple[float, float]:
    """(mean fraction of tokens identical up to the first divergence, fraction of prompts
    whose `new` tokens are all identical), generating one prompt at a time."""
    greedy = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    prefix_fractions, identical = [], 0
    for i, prompt in enumerate(prompts):
        a = exact.generate([prompt], greedy)[0].token_ids
        b = int8.generate([prompt], greedy)[0].token_ids
        same = next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), new)
        prefix_fractions.append(same / new)
        identical += same == new
        log(f"prompt {i + 1}/{len(prompts)}: {same}/{new} tokens identical")
    return sum(prefix_fractions) / len(prompts), identical / len(prompts)


@torch.inference_mode()
def perplexity(llm: LLM, tokens: list[int], rows: int) -> float:
    """exp(mean negative log-likelihood of tokens[1:]), each predicted from all tokens before
    it: the tokens go through the engine's model `rows` at a time, their KV in the engine's
    paged cache (blocks 0.. of an otherwise idle engine; prefix caching must be off)."""
    runner = llm.engine.runner
    model, bs = runner.model, runner.block_size
    blocks = list(range(math.ceil(len(tokens) / bs)))
    if len(blocks) > runner.num_blocks:
        raise SystemExit(f"{len(tokens)} tokens need {len(blocks)} KV blocks")
    nll = 0.0
    for start in range(0, len(tokens) - 1, rows):
        n = min(rows, len(tokens) - 1 - start)
        meta = build_metadata([n], [start + n], [blocks], bs, runner.device)
        ids = torch.tensor(tokens[start : start + n], dtype=torch.long)
        pos = torch.arange(start, start + n, dtype=torch.long)
        hidden = model(ids, pos, runner.kv_caches, meta, runner.backend, None)  # [n, E]
        logp = torch.log_softmax(model.compute_logits(hidden).float(), dim=-1)
        target = torch.tensor(tokens[start + 1 : start + n + 1])
        nll -= float(logp[torch.arange(n), target].sum())
    return math.exp(nll / (len(tokens) - 1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=MODEL_ALIAS)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", type=int, default=24, help=f"<= {len(CHAT_PROMPTS)}")
    p.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    p.add_argument("--rows", type=int, default=1, help="perplexity rows per step (<= 8)")
    args = p.parse_args(argv)
    if not 1 <= args.rows <= QUANT_MAX_ROWS:
        raise SystemExit(f"--rows must be 1..{QUANT_MAX_ROWS} (above, both paths are float32)")
    torch.set_num_threads(args.threads)
    opts = dict(dtype="float32", enable_prefix_caching=False)
    engines = {
        "exact": LLM(args.model, **opts),
        "int8": LLM(args.model, int8_activations=True, **opts),
    }
    chats = [
        engines["exact"].chat_token_ids([{"role": "user", "content": text}])
        for text in CHAT_PROMPTS[: args.prompts]
    ]
    start = time.perf_counter()
    prefix, whole = agreement(engines["exact"], engines["int8"], chats, args.new)
    text_tokens = engines["exact"].encode(TEXT.read_text())
    ppl = {}
    for name, llm in engines.items():
        log(f"perplexity, {name}: {len(text_tokens)} tokens, {args.rows} row(s) per step")
        ppl[name] = perplexity(llm, text_tokens, args.rows)
    print(f"model {args.model}, {args.threads} threads, {time.perf_counter() - start:.0f} s")
    print(f"{'measure':58} {'value':>10}")
    print(f"{'greedy: tokens identical up to first divergence (mean)':58} {prefix:10.3f}")
    print(
        f"{f'greedy: prompts fully identical ({len(chats)} x {args.new} tokens)':58} {whole:10.3f}"
    )
    for name in engines:
        label = f"perplexity, {name} ({len(text_tokens)} tokens, {args.rows} row/step)"
        print(f"{label:58} {ppl[name]:10.3f}")
    print(f"{'perplexity ratio int8 / exact':58} {ppl['int8'] / ppl['exact']:10.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
