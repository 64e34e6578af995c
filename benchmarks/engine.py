"""Engine benchmark: Baton vs Hugging Face transformers on the same checkpoint, one run.

    python -m benchmarks.engine [--model smollm2-135m-instruct] [--threads 2] [--json FILE]

Prints throughput (32 x 128-token prompts, 64 new tokens), batch-1 decode tokens/s,
prefill tokens/s at 2,000 tokens, and the TTFT of a 7,000-token prompt cold versus with
5,000 tokens cached (against the ideal: the cold TTFT times the uncached share of compute).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from engine import LLM, SamplingParams


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def prompts_of(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab, (length,), generator=g).tolist() for _ in range(n)]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ---- Hugging Face baseline ---------------------------------------------------------------
def hf_generate(hf, batch: list[list[int]], new: int) -> None:
    ids = torch.tensor(batch)
    hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                do_sample=False, pad_token_id=0)


def hf_figures(model_dir: str, args) -> dict:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    out = {}
    with torch.inference_mode():
        hf_generate(hf, prompts_of(2, 16, vocab, 0), 4)  # warm-up
        log("HF: throughput (static batch generate)")
        batch = prompts_of(args.num_requests, args.prompt_len, vocab, 1)
        t = timed(lambda: hf_generate(hf, batch, args.new_tokens))
        out["throughput_tok_s"] = args.num_requests * args.new_tokens / t
        log("HF: batch-1 decode")
        one = prompts_of(1, args.prompt_len, vocab, 2)
        t1 = timed(lambda: hf_generate(hf, one, 1))
        tn = timed(lambda: hf_generate(hf, one, args.decode_tokens))
        out["decode_b1_tok_s"] = (args.decode_tokens - 1) / (tn - t1)
        log("HF: prefill 2000 tokens")
        long = prompts_of(1, 2000, vocab, 3)
        out["prefill_tok_s"] = 2000 / timed(lambda: hf_generate(hf, long, 1))
    return out


# ---- Baton --------------------------------------------------------------------------------
def baton_figures(llm: LLM, args) -> dict:
    vocab = llm.engine.runner.model.args.vocab_size
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    out = {}
    llm.generate(prompts_of(2, 16, vocab, 0), greedy(4))  # warm-up
    log("Baton: throughput")
    batch = prompts_of(args.num_requests, args.prompt_len, vocab, 11)
    t = timed(lambda: llm.generate(batch, greedy(args.new_tokens)))
    out["throughput_tok_s"] = args.num_requests * args.new_tokens / t
    log("Baton: batch-1 decode")
    one = llm.generate(prompts_of(1, args.prompt_len, vocab, 12), greedy(args.decode_tokens))[0]
    out["decode_b1_tok_s"] = (args.decode_tokens - 1) / (one.latency - one.ttft)
    log("Baton: prefill 2000 tokens")
    out["prefill_tok_s"] = 2000 / llm.generate(prompts_of(1, 2000, vocab, 13), greedy(1))[0].ttft
    log(f"Baton: throughput {out['throughput_tok_s']:.1f} tok/s, decode "
        f"{out['decode_b1_tok_s']:.1f} tok/s, prefill {out['prefill_tok_s']:.1f} tok/s")
    log("Baton: TTFT 7000 tokens cold vs 5000 cached")
    prefix, tail_a, tail_b = (prompts_of(1, n, vocab, s)[0] for n, s in
                              ((5000, 14), (2000, 15), (2000, 16)))
    cold = llm.generate([prefix + tail_a], greedy(1))[0]
    warm = llm.generate([prefix + tail_b], greedy(1))[0]
    if warm.num_cached_tokens != 5000:
        raise RuntimeError(f"expected 5000 cached tokens, got {warm.num_cached_tokens}")
    share = compute_share(llm, 7000, 5000)
    out.update(ttft_cold_s=cold.ttft, ttft_cached_s=warm.ttft, uncached_compute_share=share,
               ttft_cached_ideal_s=cold.ttft * share)
    out["ttft_cached_vs_ideal"] = warm.ttft / out["ttft_cached_ideal_s"]
    return out


def compute_share(llm: LLM, total: int, cached: int) -> float:
    """FLOPs to prefill tokens [cached, total) over FLOPs to prefill [0, total)."""
    a = llm.engine.runner.model.args
    per_token = 2 * (a.hidden_size * (a.num_heads + 2 * a.num_kv_heads) * a.head_dim
                     + a.num_heads * a.head_dim * a.hidden_size
                     + 3 * a.hidden_size * a.intermediate_size) * a.num_layers
    per_pair = 4 * a.num_heads * a.head_dim * a.num_layers  # QK^T and PV, per (query, key)

    def flops(start: int) -> float:
        pairs = sum(range(start + 1, total + 1))  # query i attends i keys (causal)
        return per_token * (total - start) + per_pair * pairs

    return flops(cached) / flops(0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=2, help="torch threads for both engines")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--skip-hf", action="store_true", help="Baton figures only")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    # Block size 8 so that the 5,000-token prefix is exactly 625 full blocks.
    llm = LLM(args.model, dtype="float32", block_size=8, max_num_seqs=max(64, args.num_requests))
    ours = baton_figures(llm, args)
    theirs = {} if args.skip_hf else hf_figures(str(llm.engine.model_dir), args)
    del llm
    rows = [("throughput, 32 req x 128 in / 64 out (tok/s)", "throughput_tok_s", 2.0),
            ("batch-1 decode (tok/s)", "decode_b1_tok_s", 2.0),
            ("prefill at 2,000 tokens (tok/s)", "prefill_tok_s", 1.0)]
    print(f"{'metric':48} {'baton':>9} {'hf':>9} {'ratio':>7} {'target':>7}")
    for label, key, target in rows:
        hf = theirs.get(key)
        ratio = ours[key] / hf if hf else float("nan")
        print(f"{label:48} {ours[key]:9.1f} {hf or float('nan'):9.1f} {ratio:7.2f} "
              f"{'>=' + str(target):>7}")
    print(f"TTFT 7,000-token prompt: cold {ours['ttft_cold_s']:.2f}s, 5,000 cached "
          f"{ours['ttft_cached_s']:.2f}s, ideal {ours['ttft_cached_ideal_s']:.2f}s "
          f"(uncached share {ours['uncached_compute_share']:.3f}) -> "
          f"{ours['ttft_cached_vs_ideal']:.2f}x ideal (target <= 1.2)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"baton": ours, "hf": theirs}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
