"""Engine benchmark: Baton vs Hugging Face transformers on the same checkpoint, one run.

    python -m benchmarks.engine [--model smollm2-135m-instruct] [--threads 2] [--json FILE]
    python -m benchmarks.engine --ceiling-only [--rounds 3] [--cpu-clock --threads 1]

Prints throughput (32 x 128-token prompts, 64 new tokens), batch-1 decode tokens/s,
prefill tokens/s at 2,000 tokens, and the TTFT of a 7,000-token prompt cold versus with
5,000 tokens cached (against the ideal: the cold TTFT times the uncached share of compute).

--ceiling-only skips HF and the other figures: it times Baton's throughput run against the
same run's dense matrix products alone (gemm_floor_s) for --rounds rounds and prints the ratio
of each, the quick check of how close the engine runs to the ceiling. With --cpu-clock (one
thread only) both are timed in the thread's CPU time instead of wall time, so that other load
on a shared machine, which only takes the core away, does not count.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from benchmarks.model_flops import Shape, prompt_keys
from engine import LLM, SamplingParams


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def prompts_of(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab, (length,), generator=g).tolist() for _ in range(n)]


clock = time.perf_counter  # --cpu-clock: time.thread_time


def timed(fn) -> float:
    start = clock()
    fn()
    return clock() - start


# ---- the two engines, behind the same three timings ----------------------------------------
class HFRunner:
    """transformers' generate: static batches, greedy, a fixed number of new tokens."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoModelForCausalLM

        self.hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self._generate(prompts_of(2, 16, self.hf.config.vocab_size, 0), 4)  # warm-up

    @torch.inference_mode()
    def _generate(self, batch: list[list[int]], new: int) -> None:
        ids = torch.tensor(batch)
        self.hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )

    def batch_s(self, batch: list[list[int]], new: int) -> float:
        return timed(lambda: self._generate(batch, new))

    def decode_s(self, prompt: list[int], new: int) -> float:
        """Seconds for new - 1 tokens after the first (prefill + 1 token subtracted)."""
        return self.batch_s([prompt], new) - self.batch_s([prompt], 1)

    def prefill_s(self, prompt: list[int]) -> float:
        return self.batch_s([prompt], 1)


class BatonRunner:
    """Our offline engine: every request submitted at once, continuous batching."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        llm.generate(
            prompts_of(2, 16, llm.engine.runner.model.args.vocab_size, 0), self.greedy(4)
        )  # warm-up

    def batch_s(self, batch: list[list[int]], new: int) -> float:
        return timed(lambda: self.llm.generate(batch, self.greedy(new)))

    def decode_s(self, prompt: list[int], new: int) -> float:
        one = self.llm.generate([prompt], self.greedy(new))[0]
        return one.latency - one.ttft

    def prefill_s(self, prompt: list[int]) -> float:
        return self.llm.generate([prompt], self.greedy(1))[0].ttft


def compare(runners: dict[str, object], args, vocab: int) -> dict[str, dict]:
    """The three head-to-head figures. Runs alternate between the engines (Baton, then HF, in
    each round) so that drifts of this shared machine's speed hit both alike; batch-1 decode and
    prefill keep the best of --repeats rounds, the long throughput run is timed once each.
    Every round uses new prompts, so prefix caching never helps."""
    out: dict[str, dict] = {name: {} for name in runners}
    batch = prompts_of(args.num_requests, args.prompt_len, vocab, 1)
    for name, runner in runners.items():
        log(f"{name}: throughput")
        out[name]["throughput_tok_s"] = (
            args.num_requests * args.new_tokens / runner.batch_s(batch, args.new_tokens)
        )
    decode = {name: [] for name in runners}
    prefill = {name: [] for name in runners}
    for i in range(args.repeats):
        log(f"round {i + 1}/{args.repeats}: batch-1 decode, prefill at 2,000 tokens")
        one = prompts_of(1, args.prompt_len, vocab, 100 + i)[0]
        long = prompts_of(1, 2000, vocab, 200 + i)[0]
        for name, runner in runners.items():
            decode[name].append(runner.decode_s(one, args.decode_tokens))
            prefill[name].append(runner.prefill_s(long))
    for name in runners:
        out[name]["decode_b1_tok_s"] = (args.decode_tokens - 1) / min(decode[name])
        out[name]["prefill_tok_s"] = 2000 / min(prefill[name])
    return out


def cached_ttft(llm: LLM) -> dict:
    """TTFT of a 7,000-token prompt cold, then of another whose first 5,000 tokens are cached."""
    vocab = llm.engine.runner.model.args.vocab_size
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    log("Baton: TTFT 7000 tokens cold vs 5000 cached")
    prefix, tail_a, tail_b = (
        prompts_of(1, n, vocab, s)[0] for n, s in ((5000, 14), (2000, 15), (2000, 16))
    )
    cold = llm.generate([prefix + tail_a], greedy)[0]
    warm = llm.generate([prefix + tail_b], greedy)[0]
    if warm.num_cached_tokens != 5000:
        raise RuntimeError(f"expected 5000 cached tokens, got {warm.num_cached_tokens}")
    share = compute_share(llm, 7000, 5000)
    out = dict(
        ttft_cold_s=cold.ttft,
        ttft_cached_s=warm.ttft,
        uncached_compute_share=share,
        ttft_cached_ideal_s=cold.ttft * share,
    )
    out["ttft_cached_vs_ideal"] = warm.ttft / out["ttft_cached_ideal_s"]
    return out


@torch.inference_mode()
def gemm_floor_s(llm: LLM, args) -> float:
    """Seconds the throughput run spends in its dense float32 matrix products alone, timed now
    with the model's own layers: the prompts' rows in steps of max_num_batched_tokens, then
    new_tokens - 1 decode steps of num_requests rows, each with the lm_head. Attention, norms,
    sampling and scheduling are left out, so no engine can run the workload faster than this on
    this machine in float32."""
    model = llm.engine.runner.model
    linears = [lin for layer in model.layers for lin in layer.linears()]

    def step_s(rows: int, sampled: int) -> float:
        inputs = {k: torch.randn(rows, k) for k in {lin.weight.shape[1] for lin in linears}}
        start = clock()
        for lin in linears:
            lin(inputs[lin.weight.shape[1]])
        model.compute_logits(inputs[model.args.hidden_size][:sampled])
        return clock() - start

    step = llm.engine.config.max_num_batched_tokens
    prompt_rows = args.num_requests * args.prompt_len
    prefill = sum(step_s(min(step, prompt_rows - r), 0) for r in range(0, prompt_rows, step))
    decode_steps = args.new_tokens - 1
    probe = min(5, decode_steps)
    decode = sum(step_s(args.num_requests, args.num_requests) for _ in range(probe))
    return prefill + decode * decode_steps / probe


def compute_share(llm: LLM, total: int, cached: int) -> float:
    """FLOPs to prefill tokens [cached, total) over FLOPs to prefill [0, total) (products and
    causal attention; the one row of logits is left out of both)."""
    shape = Shape.of_args(llm.engine.runner.model.args)

    def flops(start: int) -> float:
        new = total - start
        return new * shape.row_flops() + shape.attention_flops(prompt_keys(start, new))

    return flops(cached) / flops(0)


def ceiling_only(llm: LLM, args) -> list[dict]:
    """Rounds of (Baton's throughput run, its dense matrix products alone), each on new
    prompts (nothing cached), printed as they come."""
    runner = BatonRunner(llm)
    vocab = llm.engine.runner.model.args.vocab_size
    rounds = []
    for i in range(args.rounds):
        batch = prompts_of(args.num_requests, args.prompt_len, vocab, 1000 + i)
        run_s = runner.batch_s(batch, args.new_tokens)
        floor_s = gemm_floor_s(llm, args)
        rounds.append(dict(run_s=run_s, gemm_floor_s=floor_s, ceiling_ratio=floor_s / run_s))
        print(
            f"round {i + 1}: throughput run {run_s:.2f}s, its matrix products alone "
            f"{floor_s:.2f}s -> {floor_s / run_s:.1%} of the ceiling",
            flush=True,
        )
    return rounds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=2, help="torch threads for both engines")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="batch-1 decode and prefill: best of this many rounds, for both engines "
        "(other load on a shared machine only ever adds time)",
    )
    p.add_argument("--skip-hf", action="store_true", help="Baton figures only")
    p.add_argument(
        "--ceiling-only",
        action="store_true",
        help="only Baton's throughput run against its matrix products alone, --rounds times",
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds of --ceiling-only")
    p.add_argument(
        "--cpu-clock",
        action="store_true",
        help="time in the thread's CPU time (needs --threads 1): other load does not count",
    )
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args(argv)
    if args.cpu_clock:
        if args.threads != 1:
            p.error("--cpu-clock needs --threads 1 (it counts the calling thread's time only)")
        global clock
        clock = time.thread_time
    torch.set_num_threads(args.threads)
    # Block size 8 so that the 5,000-token prefix is exactly 625 full blocks.
    llm = LLM(
        args.model,
        dtype="float32",
        block_size=8,
        max_num_seqs=max(64, args.num_requests),
        num_threads=args.threads,
    )
    if args.ceiling_only:
        rounds = ceiling_only(llm, args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"baton": {"ceiling_rounds": rounds}}, f, indent=2)
        return 0
    runners = {"Baton": BatonRunner(llm)}
    if not args.skip_hf:
        runners["HF"] = HFRunner(str(llm.engine.model_dir))
    figures = compare(runners, args, llm.engine.runner.model.args.vocab_size)
    ours, theirs = figures["Baton"], figures.get("HF", {})
    log("Baton: the throughput run's dense matrix products alone")
    ours["throughput_gemm_floor_s"] = gemm_floor_s(llm, args)
    ours.update(cached_ttft(llm))
    del llm, runners
    rows = [
        ("throughput, 32 req x 128 in / 64 out (tok/s)", "throughput_tok_s", 2.0),
        ("batch-1 decode (tok/s)", "decode_b1_tok_s", 2.0),
        ("prefill at 2,000 tokens (tok/s)", "prefill_tok_s", 1.0),
    ]
    print(f"{'metric':48} {'baton':>9} {'hf':>9} {'ratio':>7} {'target':>7}")
    for label, key, target in rows:
        hf = theirs.get(key)
        ratio = ours[key] / hf if hf else float("nan")
        print(
            f"{label:48} {ours[key]:9.1f} {hf or float('nan'):9.1f} {ratio:7.2f} "
            f"{'>=' + str(target):>7}"
        )
    if "throughput_tok_s" in theirs:
        hf_s = args.num_requests * args.new_tokens / theirs["throughput_tok_s"]
        floor = ours["throughput_gemm_floor_s"]
        print(
            f"throughput ceiling: the run's float32 matrix products alone take {floor:.2f}s "
            f"here, HF's whole run {hf_s:.2f}s -> no engine can beat HF by more than "
            f"{hf_s / floor:.2f}x on this machine (ours: "
            f"{ours['throughput_tok_s'] / theirs['throughput_tok_s']:.2f}x)"
        )
    print(
        f"TTFT 7,000-token prompt: cold {ours['ttft_cold_s']:.2f}s, 5,000 cached "
        f"{ours['ttft_cached_s']:.2f}s, ideal {ours['ttft_cached_ideal_s']:.2f}s "
        f"(uncached share {ours['uncached_compute_share']:.3f}) -> "
        f"{ours['ttft_cached_vs_ideal']:.2f}x ideal (target <= 1.2)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"baton": ours, "hf": theirs}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
