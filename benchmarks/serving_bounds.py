"""How much concurrency can raise served throughput on this CPU, from the arithmetic of the
steps a workload needs, one run:

    python -m benchmarks.serving_bounds [--model smollm2-135m-instruct] [--threads 2]
        [--streams 4] [--output-len 64] [--rounds 3]

For each workload of `baton bench` meant for peers (shared-prefix: 2,000 cached tokens + 64
new a request; short-prompt: 256 new tokens), one engine measures the steps a closed-loop
client of S streams causes: a request's prefill (its first token) and decode steps of 1 and of
S rows at that context (the S rows share the cached prompt where the workload does). It counts
each step's floating-point work from the model's shape (products: 2 x weights per row, the
output projection for rows that sample; attention: 4 x head_dim x keys per query head), times
PyTorch's float32 matrix product (MKL / oneDNN) on the model's product shapes at 256 rows, and
measures the CPU's peak float32 rate (fma_peak.c: chains of fused multiply-adds on registers,
--threads threads); the reference rate is the fastest of those and the products of the
measured prefills, in practice the peak: no step does its multiply-adds faster.

Per request of --output-len tokens, one stream costs a prefill and output-len - 1 one-row
steps. S streams cost, per S requests, S prefill steps that each carry the other S - 1
streams' decode rows (each such row adds one more row's work to the step), and
output-len - 1 - (S - 1) S-row decode steps for the remaining tokens. Printed: the tokens/s
ratio of S streams to one from the measured steps, and the highest it could be if the S
streams' steps did all their extra work at the reference rate (one stream as measured): the
prefills at that rate, and each further row of a step, beside a prefill or in an S-row step,
one row's products and attention at that rate. With the peak as the reference that is a
ceiling: a ratio target above it cannot hold on this machine without a slower one-stream
figure; the served ratio adds the token path and
the HTTP door on top.

The same two figures for the disaggregated shape, a prefill worker and a decode worker each
with --threads threads (`baton profile serving --shapes disaggregated --threads 1` serves
it): there a stream's round is its prefill on the prefill worker, then its decode steps, one
row at one stream and S rows at S; the S streams' prefills overlap the others' decode steps
and set the round only where the prefill worker is the busier (disaggregated_ratio).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from pathlib import Path

import torch

from benchmarks.model_flops import Shape, prompt_keys
from engine import LLM, SamplingParams
from engine.model.fused_decode import PARTS
from engine.model.loader import read_hf_config
from engine.model_resolver import resolve_model
from engine.native import load_native

MODEL_ALIAS = "smollm2-135m-instruct"
VOCAB_DRAW = 40_000  # prompt tokens are drawn from [100, min(VOCAB_DRAW, vocab))


def reference_rate(shape: Shape, threads: int, rows: int = 256, repeats: int = 200) -> float:
    """FLOP/s of PyTorch's float32 products on the model's shapes at `rows` rows (the best)."""
    torch.set_num_threads(threads)
    best = 0.0
    for k, n in shape.products():
        x, w = torch.randn(rows, k), torch.randn(n, k)
        for _ in range(5):
            torch.mm(x, w.t())
        start = time.perf_counter()
        for _ in range(repeats):
            torch.mm(x, w.t())
        best = max(best, 2.0 * rows * k * n * repeats / (time.perf_counter() - start))
    return best


def peak_rate(threads: int, repeats: int = 5) -> float | None:
    """FLOP/s of `threads` threads running only fused multiply-adds on registers (fma_peak.c;
    the best of `repeats`), or None where the C source cannot be built here."""
    lib = load_native(Path(__file__).with_name("fma_peak.c"))
    if lib is None:
        return None
    run = lib.baton_fma_peak
    run.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int]
    run.argtypes += [ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_float)]
    best = 0.0
    for wide in (0, 1):
        for _ in range(repeats):
            flops, sink = ctypes.c_double(), ctypes.c_float()
            if run(threads, 2_000_000, wide, ctypes.byref(flops), ctypes.byref(sink)) != 0:
                return None
            best = max(best, flops.value)
    return best


class Steps:
    """Times steps of one engine: prefills and decode steps of chosen rows and context."""

    def __init__(self, model: str, threads: int, seed: int = 0, **engine_options) -> None:
        options = dict(dtype="float32", skip_tokenizer_init=True, num_threads=threads)
        self.engine = LLM(model, **options, **engine_options).engine
        self.shape = Shape.of(read_hf_config(self.engine.model_dir))
        self.draw_below = min(VOCAB_DRAW, self.shape.vocab)
        self.g = torch.Generator().manual_seed(seed)
        self.count = 0

    def tokens(self, n: int) -> list[int]:
        return torch.randint(100, self.draw_below, (n,), generator=self.g).tolist()

    def add(self, prompt: list[int], max_tokens: int) -> str:
        self.count += 1
        rid = f"r{self.count}"
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.add_request(rid, prompt, params)
        return rid

    def finish(self) -> None:
        while self.engine.has_unfinished():
            self.engine.step()

    def prefill_all(self) -> None:
        """Step until every request added so far has its prompt computed (decodes only left)."""
        sched = self.engine.scheduler
        while sched.waiting or any(r.num_tokens - r.num_computed_tokens > 1 for r in sched.running):
            self.engine.step()

    def fused_timings(self) -> list[float] | None:
        """The fused step's part timers so far (seconds each), or None without them."""
        fused = self.engine.runner.fused
        return list(fused.timings) if fused is not None and fused.timings is not None else None

    def parts_since(self, before: list[float] | None, per: int = 1) -> dict[str, float]:
        """Each fused part's seconds since `before` (fused_timings), over `per`; empty without
        the fused step."""
        now = self.fused_timings()
        if before is None or now is None:
            return {}
        return {p: (a - b) / per for p, a, b in zip(PARTS, now, before, strict=True)}

    def prefill(self, prefix: list[int], new: int) -> tuple[float, dict[str, float]]:
        """Seconds to a request's first token (its prompt's steps), and the fused parts' share."""
        before = self.fused_timings()
        self.add(prefix + self.tokens(new), 1)
        start = time.perf_counter()
        self.finish()
        seconds = time.perf_counter() - start
        return seconds, self.parts_since(before)

    def decode(self, prefix: list[int], new: int, rows: int, steps: int) -> tuple[float, dict]:
        """Median seconds of a decode step of `rows` requests, each prefix + `new` of its own,
        and the fused step's parts in seconds a step (mean; empty without the fused step)."""
        for _ in range(rows):
            self.add(prefix + self.tokens(new), steps + 2)
        self.prefill_all()
        before = self.fused_timings()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            self.engine.step()
            times.append(time.perf_counter() - start)
        parts = self.parts_since(before, steps)
        self.finish()
        return statistics.median(times), parts


def disaggregated_ratio(
    streams: int, n: int, single_prefill: float, one: float, prefill: float, many: float
) -> float:
    """S streams' tokens/s over one stream's where a prefill worker prefills and a decode
    worker decodes. A stream's round is its prefill, then n decode steps: one stream's steps of
    one row (after prefills of single_prefill seconds), S streams' of S rows (steps of `many`
    seconds, prefills of `prefill`). The S streams wait for no other stream's prefill unless
    the prefill worker's S prefills take longer than that round; then they set it."""
    single = single_prefill + n * one
    return streams * single / max(prefill + n * many, streams * prefill)


def step_parts(parts: dict[str, float]) -> str:
    """A decode step's products, attention and logits in ms (the fused step's own timers)."""
    if not parts:
        return ""
    products = sum(seconds for part, seconds in parts.items() if "product" in part)
    attention = parts.get("rope + KV write + attention", 0.0)
    logits = parts.get("output projection (logits)", 0.0)
    ms = [f"{1e3 * seconds:.1f}" for seconds in (products, attention, logits)]
    return f"; products {ms[0]}, attention {ms[1]}, logits {ms[2]} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=MODEL_ALIAS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    shape = Shape.of(read_hf_config(resolve_model(args.model)))
    torch_rate = reference_rate(shape, args.threads)  # before the engine's threads exist
    peak = peak_rate(args.threads)
    ref = max(torch_rate, peak or 0.0)
    steps = Steps(args.model, args.threads)
    print(f"{args.model}, {args.threads} threads, {args.streams} streams, {args.output_len} tokens")
    print(f"PyTorch float32 products at 256 rows, best shape: {torch_rate / 1e9:.0f} GFLOP/s")
    if peak is not None:
        print(f"peak float32 rate (fused multiply-adds only): {peak / 1e9:.0f} GFLOP/s")
    system = steps.tokens(2000)
    steps.add(system, 1)
    steps.finish()  # the shared system prompt, cached from here on
    workloads = {"shared-prefix": (system, 64), "short-prompt": ([], 256)}
    S, n = args.streams, args.output_len - 1
    for name, (prefix, new) in workloads.items():
        prefill, parts = min(
            (steps.prefill(prefix, new) for _ in range(args.rounds)), key=lambda run: run[0]
        )
        one, one_parts = min(
            (steps.decode(prefix, new, 1, 16) for _ in range(args.rounds)), key=lambda run: run[0]
        )
        many, many_parts = min(
            (steps.decode(prefix, new, S, 16) for _ in range(args.rounds)), key=lambda run: run[0]
        )
        cached, keys = len(prefix), len(prefix) + new + args.output_len // 2
        # the fused step (its parts timed) runs the last layer's tail for the sampled row only
        pruned = bool(parts)
        flops_prefill = shape.prefill_flops(cached, new, pruned)
        flops_row = shape.decode_row_flops(keys)
        products = sum(seconds for part, seconds in parts.items() if "product" in part)
        attention = parts.get("rope + KV write + attention", 0.0)
        rates, rate = "", ref
        if products > 0 and attention > 0:
            product_rate = shape.prefill_products(new, pruned) / products
            attention_rate = shape.attention_flops(prompt_keys(cached, new)) / attention
            rates = f" (products {product_rate / 1e9:.0f}, attention {attention_rate / 1e9:.0f})"
            rate = max(ref, product_rate)  # the reference: the fastest float32 rate
        print(f"\n{name}: {cached} cached + {new} new tokens, answers of {args.output_len}")
        print(
            f"  prefill          {1e3 * prefill:7.1f} ms, {flops_prefill / 1e9:5.2f} GFLOP,"
            f" {flops_prefill / prefill / 1e9:.0f} GFLOP/s{rates}"
        )
        print(
            f"  decode, 1 row    {1e3 * one:7.1f} ms (the answer's first 16 tokens)"
            f"{step_parts(one_parts)}"
        )
        print(
            f"  decode, {S} rows   {1e3 * many:7.1f} ms: {many / one:.2f}x one row"
            f"{step_parts(many_parts)}"
        )
        print(f"    a row's work at ~{keys} keys {flops_row / 1e9:.2f} GFLOP")
        single = prefill + n * one
        rider, rider_bound = (many - one) / max(S - 1, 1), flops_row / rate  # one more row
        rest = max(n - (S - 1), 0)  # tokens not decoded inside the S prefill steps
        measured = S * single / (S * (prefill + (S - 1) * rider) + rest * many)
        fastest_prefill = flops_prefill / rate + (S - 1) * rider_bound
        bound = S * single / (S * fastest_prefill + rest * (one + (S - 1) * rider_bound))
        print(f"  tokens/s, {S} streams vs 1: {measured:.2f}x from these steps,")
        print(
            f"    at most {bound:.2f}x with all their extra work at {rate / 1e9:.0f} GFLOP/s"
            " (the fastest float32 rate: the peak, PyTorch's products or these prefills')"
        )
        split = disaggregated_ratio(S, n, prefill, one, prefill, many)
        split_bound = disaggregated_ratio(
            S, n, prefill, one, flops_prefill / rate, one + (S - 1) * rider_bound
        )
        print(
            f"  disaggregated (a prefill and a decode worker of {args.threads} threads each):"
            f" {split:.2f}x from these steps, at most {split_bound:.2f}x"
        )


if __name__ == "__main__":
    main()
