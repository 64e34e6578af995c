"""Step-time profile of one engine: measure steps over a small grid, fit engine/step_model.py.

    baton profile [--model smollm2-135m-instruct] [--threads 1] [--repeats 3]
                    [--quick] [--out FILE]
    baton profile --refit engine/profiles/<key>.json [--out FILE]
    baton profile serving [...]   (a running cluster's steps by phase: perf/serving/command.py)

Drives LLMEngine steps directly with crafted requests: a grid point is a step of D decode
rows at context L plus (unless P = 0) one prefill chunk of P tokens after C cached tokens;
further decode batches are measured alone (decode-only steps: where the matrix products
change regime with the row count).
Decoding requests share a cached prompt prefix and a prefill request's first C tokens are a
cached prefix too, so reaching a point costs one block of setup, not a prefill of L or C.
Every point runs --repeats times (rounds over the whole grid, so a drift of a shared
machine's speed hits all points alike) and keeps its median. The fit is checked on every
4th point held out (mean/max relative error printed), then refitted on all points and
written with the points to <model>-<dtype>-<device>[-<threads>t].json in the user's profile
directory ($BATON_PROFILE_DIR, default ~/.cache/baton/profiles), where engines look before
the profiles shipped in engine/profiles/; never into the installed package. A
request_overhead_ms calibrated into the profile it replaces (the user's, else the shipped one)
is kept. --refit fits a profile again from its stored points, measuring nothing (for a change
of the model's features), and writes it to the user's directory under the same name.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine import LLMEngine, SamplingParams
from engine.step_model import StepShape, fit_with_holdout, profile_path, user_profile_dir

BLOCK = 16
GREEDY_ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
DECODING = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)


@dataclass(frozen=True)
class Grid:
    """Prefill chunk sizes P, their cached contexts C, and decode batches (D rows, context L)."""

    prefill: tuple[int, ...]
    context: tuple[int, ...]
    decodes: tuple[tuple[int, int], ...]  # (D, L); (0, 0) = no decodes
    decode_only: tuple[tuple[int, int], ...] = ()  # (D, L) measured without prefill only

    @property
    def max_decodes(self) -> int:
        return max(d for d, _ in self.decodes + self.decode_only)


FULL = Grid(
    (32, 128, 512, 1024),
    (0, 1536, 4096, 6144),
    ((0, 0), (1, 256), (4, 256), (8, 256), (8, 1024), (24, 256)),
    ((2, 256), (6, 256), (12, 256), (16, 256), (32, 256), (48, 256)),
)
QUICK = Grid((8, 32), (0, 64), ((0, 0), (2, 16), (4, 48)), ((1, 16), (12, 16)))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Prompts:
    """Random token ids that never repeat (so nothing is cached but the prefixes we build)."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.vocab = vocab
        self.g = torch.Generator().manual_seed(seed)

    def __call__(self, n: int) -> list[int]:
        return torch.randint(3, self.vocab, (n,), generator=self.g).tolist()


class Profiler:
    """One engine and the crafted requests that put its steps on grid points."""

    def __init__(self, engine: LLMEngine, grid: Grid) -> None:
        self.engine = engine
        self.grid = grid
        self.prompts = Prompts(engine.runner.model.args.vocab_size)
        self.context_prefix = self.prompts(max(grid.context))
        self._ids = 0
        if self.context_prefix:
            self._run_to_end(self._add(self.context_prefix + self.prompts(1), GREEDY_ONE))
        self.decoders: list[str] = []

    def _add(self, prompt: list[int], params: SamplingParams) -> str:
        self._ids += 1
        rid = f"r{self._ids}"
        self.engine.add_request(rid, prompt, params)
        return rid

    def _run_to_end(self, rid: str) -> None:
        while rid in self.engine.scheduler.requests:
            self.engine.step()

    def start_decodes(self, count: int, context: int) -> None:
        """Abort the decoding requests, start `count` at about `context` tokens."""
        for rid in self.decoders:
            self.engine.abort(rid)
        self.engine.step()  # collects the aborted outputs
        self.decoders = []
        if count == 0:
            return
        prefix = self.prompts(context)
        self._run_to_end(self._add(prefix + self.prompts(1), GREEDY_ONE))  # cache the prefix
        self.decoders = [self._add(prefix + self.prompts(1), DECODING) for _ in range(count)]
        while any(
            r.num_tokens - r.num_computed_tokens > 1
            for r in map(self.engine.scheduler.requests.__getitem__, self.decoders)
        ):
            self.engine.step()

    def measure(self, prefill: int, context: int) -> tuple[StepShape, float]:
        """One step at this point: the decoders plus (if prefill) a fresh chunk; its seconds."""
        requests = self.engine.scheduler.requests
        decode_contexts = [requests[rid].num_computed_tokens for rid in self.decoders]
        expected = dict.fromkeys(self.decoders, 1)
        chunks = []
        if prefill:
            rid = self._add(self.context_prefix[:context] + self.prompts(prefill), GREEDY_ONE)
            expected[rid] = prefill
            chunks = [(context, prefill)]
        start = time.perf_counter()
        result = self.engine.step()
        seconds = time.perf_counter() - start
        if result.scheduled != expected:
            raise RuntimeError(f"step ran {result.scheduled}, not the grid point {expected}")
        return StepShape.of(decode_contexts, chunks), seconds

    def points(self, decodes: int, context: int) -> list[tuple[int, int]]:
        """(P, C) points of a decode batch: every chunk at every context, plus decodes only
        (a decode_only batch: decodes only)."""
        if (decodes, context) in self.grid.decode_only:
            return [(0, 0)]
        pts = [(p, c) for p in self.grid.prefill for c in self.grid.context]
        return pts + ([(0, 0)] if decodes else [])


def profile(engine: LLMEngine, grid: Grid, repeats: int) -> list[dict]:
    """Median seconds per grid point, with the shape of its median run."""
    profiler = Profiler(engine, grid)
    rows = []
    for count, context in grid.decodes + grid.decode_only:
        log(f"decodes: {count} at context {context}")
        profiler.start_decodes(count, context)
        profiler.measure(min(grid.prefill), 0)  # warm-up, not recorded
        runs: dict[tuple[int, int], list[tuple[StepShape, float]]] = {}
        for _ in range(repeats):
            for point in profiler.points(count, context):
                runs.setdefault(point, []).append(profiler.measure(*point))
        for (p, c), samples in runs.items():
            samples.sort(key=lambda s: s[1])
            shape, _ = samples[len(samples) // 2]
            seconds = statistics.median(s for _, s in samples)
            rows.append(
                {"decodes": count, "decode_len": context, "prefill": p, "context": c}
                | {"shape": asdict(shape), "seconds": seconds}
            )
            log(f"  P={p:5d} C={c:5d}  {seconds * 1000:9.1f} ms")
    return rows


def report(model, rows: list[dict], samples: list[tuple[StepShape, float]]) -> None:
    """Every point measured against the model, the coefficients and the held-out error."""
    print(
        f"{'decodes':>8} {'L':>5} {'P':>5} {'C':>5} {'measured ms':>12} {'model ms':>9} {'err':>6}"
    )
    for r, (shape, seconds) in zip(rows, samples, strict=True):
        predicted = model.predict(shape)
        print(
            f"{r['decodes']:8d} {r['decode_len']:5d} {r['prefill']:5d} {r['context']:5d} "
            f"{seconds * 1000:12.1f} {predicted * 1000:9.1f} {abs(predicted / seconds - 1):6.1%}"
        )
    print("coefficients (seconds per unit):")
    for name, value in model.coefficients.items():
        print(f"  {name:18s} {value:.3e}")
    e = model.error
    print(
        f"held-out error ({e['held_out']} points, fitted without them): mean "
        f"{e['mean_rel']:.1%}, max {e['max_rel']:.1%}; on all points refitted: mean "
        f"{e['fit_mean_rel']:.1%}"
    )


def samples_of(rows: list[dict]) -> list[tuple[StepShape, float]]:
    return [(StepShape(**r["shape"]), r["seconds"]) for r in rows]


def write(out: Path, model, extra: dict, replaces: Path | None = None) -> None:
    """The profile JSON: the model, then `extra` (grid, repeats, points); a calibrated control
    path (request_overhead_ms, benchmarks/sim_calibration.py) in `out`, else in the profile it
    `replaces`, is kept."""
    data = model.to_json() | extra
    for source in (out, replaces):
        if source is not None and source.is_file():
            overhead = json.loads(source.read_text()).get("request_overhead_ms")
            if overhead is not None:
                data["request_overhead_ms"] = overhead
                log(f"kept request_overhead_ms {overhead} of {source}")
                break
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {out}")


def refit(path: Path, out: Path) -> int:
    """Fit the profile at `path` again from its stored points (after the model's features
    changed) and write it to `out`."""
    data = json.loads(path.read_text())
    rows = data["points"]
    samples = samples_of(rows)
    model = fit_with_holdout(samples, key=data["key"], note=data.get("note", ""))
    report(model, rows, samples)
    write(out, model, {k: data[k] for k in ("grid", "repeats", "points") if k in data}, path)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serving"]:  # where a serving step's time goes (perf/serving)
        from perf.serving.command import main as serving_main

        return serving_main(argv[1:])
    parser = argparse.ArgumentParser(prog="baton profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a tiny grid (tests)")
    parser.add_argument(
        "--out",
        help="profile path (default: <key>.json, with --refit the profile's file name, in "
        "$BATON_PROFILE_DIR, else ~/.cache/baton/profiles)",
    )
    parser.add_argument("--note", default="", help="kept in the profile (how it was measured)")
    parser.add_argument(
        "--refit",
        metavar="PROFILE",
        help="measure nothing: fit this profile again from its stored points",
    )
    args = parser.parse_args(argv)
    if args.refit:
        source = Path(args.refit)
        return refit(source, Path(args.out) if args.out else user_profile_dir() / source.name)

    grid = QUICK if args.quick else FULL
    engine = LLMEngine(
        args.model,
        dtype=args.dtype,
        device=args.device,
        num_threads=args.threads,
        skip_tokenizer_init=True,
        block_size=BLOCK,
        chunk_size=max(grid.prefill),
        max_num_batched_tokens=max(grid.prefill) + grid.max_decodes,
        prefill_batch_tokens=max(grid.prefill) + grid.max_decodes,
        decode_steps_between_prompts=0,  # a grid point's prompt joins its decodes at once
        num_kv_blocks=1200,
        decode_stretch=0,  # the grid's steps exactly as crafted, no step budget
    )
    key = engine.step_profile_key()
    log(f"profiling {key}: grid {grid}, {args.repeats} repeats")
    start = time.perf_counter()
    rows = profile(engine, grid, args.repeats)
    samples = samples_of(rows)
    cpu = engine.runner.device.type == "cpu"
    info = {
        "model": args.model,
        "dtype": str(engine.runner.dtype).removeprefix("torch."),
        "device": "cpu" if cpu else torch.cuda.get_device_name(engine.runner.device),
        "threads": torch.get_num_threads() if cpu else None,
    }
    model = fit_with_holdout(samples, key=info, note=args.note)
    report(model, rows, samples)
    log(f"measured in {time.perf_counter() - start:.0f} s")
    out = Path(args.out) if args.out else user_profile_dir() / f"{key}.json"
    extra = {"grid": asdict(grid), "repeats": args.repeats, "points": rows}
    write(out, model, extra, replaces=profile_path(key))
    return 0


if __name__ == "__main__":
    sys.exit(main())
