"""Step-time model: predicted seconds of one engine step from its shape, fitted from measured
steps (`baton profile`, perf/profiler.py) and stored as a profile JSON; pure Python (numpy only
to fit). Profiles are looked up by key: the user's ($BATON_PROFILE_DIR, default
~/.cache/baton/profiles, where `baton profile` writes) before the ones shipped in
engine/profiles/.

A step's shape is what its cost depends on: prefill tokens and chunks, the query-key pairs of
prefill attention, the cached keys each chunk reads, decode rows and the keys they read. The
model is linear in those features (a constant, per-token and per-row costs, and attention terms
in context):

    seconds = const + prefill_tokens * a + prefill_chunks * b + prefill_attention * c
              + decodes * d + decode_context * e + prefill_context * f
              + small_rows * g + multi_row * h + large_step * i

small_rows, multi_row and large_step are the three regimes of a CPU engine's matrix products
on a GGUF checkpoint (not stored, derived from the step's rows R = prefill tokens + decode
rows): one row is bound by reading the quantized weights; up to SMALL_STEP_ROWS rows multiply
straight from the quantized blocks, at a cost per row (small_rows = min(R, SMALL_STEP_ROWS);
multi_row = 1 from two rows); above that the weights are rebuilt into float32 panels (the
fused step) or streamed as dense float32 (the per-operation path) (large_step = 1). Linear in
decode rows alone, the 1-thread SmolLM2 profile was 20% high at one decode row and 29% low at
eight.

The prefill_context term is the part of a chunk's attention that goes with its cached
context and not with its query count (gathering the cached keys, and attention over few
queries using the hardware worse than over many): on CPU, 32 tokens after 4,096 cached ones
cost 2.8x the same 32 after none, while the pair term alone fitted them at 2.1x; small chunks
late in a long prompt are the steps dynamic chunking has to size right.

Coefficients are fitted by least squares on relative error and kept non-negative, so that a
prediction never falls as a step grows (the chunk budget searches on that).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

FEATURES = (
    "const",
    "prefill_tokens",
    "prefill_chunks",
    "prefill_attention",
    "decodes",
    "decode_context",
    "prefill_context",
    "small_rows",
    "multi_row",
    "large_step",
)
# The rows up to which the matrix products take the small-step path: QUANT_MAX_ROWS of
# engine/model/gguf_linear.py (tests/engine/test_step_model.py checks they agree).
SMALL_STEP_ROWS = 8
SHIPPED_PROFILES_DIR = Path(__file__).resolve().parent / "profiles"  # package data
PROFILE_DIR_ENV = "BATON_PROFILE_DIR"
log = logging.getLogger(__name__)
FORM = "seconds = sum(coefficient * feature) over " + ", ".join(FEATURES)


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one step computes: prefill chunks and decode rows, summed over the batch."""

    prefill_tokens: int = 0
    prefill_chunks: int = 0
    prefill_attention: int = 0  # query-key pairs of prefill rows: sum n * c + n (n + 1) / 2
    decodes: int = 0
    decode_context: int = 0  # keys the decode rows attend to (their contexts, new token included)
    prefill_context: int = 0  # cached keys the prefill chunks attend to (their contexts, summed)

    def with_chunk(self, context: int, n: int) -> StepShape:
        """This shape plus a prefill chunk of n tokens after `context` computed tokens."""
        return replace(
            self,
            prefill_tokens=self.prefill_tokens + n,
            prefill_chunks=self.prefill_chunks + 1,
            prefill_attention=self.prefill_attention + n * context + n * (n + 1) // 2,
            prefill_context=self.prefill_context + context,
        )

    def with_decode(self, context: int) -> StepShape:
        """This shape plus one decode row after `context` computed tokens."""
        return replace(
            self, decodes=self.decodes + 1, decode_context=self.decode_context + context + 1
        )

    def features(self) -> tuple[float, ...]:
        rows = self.prefill_tokens + self.decodes
        return (
            1.0,
            self.prefill_tokens,
            self.prefill_chunks,
            self.prefill_attention,
            self.decodes,
            self.decode_context,
            self.prefill_context,
            min(rows, SMALL_STEP_ROWS),
            1.0 if rows > 1 else 0.0,
            1.0 if rows > SMALL_STEP_ROWS else 0.0,
        )

    @classmethod
    def of(cls, decode_contexts=(), chunks=()) -> StepShape:
        """The shape of decode rows at these contexts and (context, n) prefill chunks."""
        shape = cls()
        for context in decode_contexts:
            shape = shape.with_decode(context)
        for context, n in chunks:
            shape = shape.with_chunk(context, n)
        return shape


@dataclass(frozen=True)
class StepModel:
    """Seconds of a step as a non-negative linear function of its shape's features."""

    coefficients: dict[str, float]  # feature name -> seconds per unit
    key: dict = field(default_factory=dict)  # model, dtype, device, threads it was measured on
    error: dict = field(default_factory=dict)  # mean/max relative error on held-out steps
    note: str = ""

    def predict(self, shape: StepShape) -> float:
        values = shape.features()
        return sum(
            self.coefficients.get(name, 0.0) * x for name, x in zip(FEATURES, values, strict=True)
        )

    # ---- JSON --------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "key": self.key,
            "form": FORM,
            "coefficients": self.coefficients,
            "error": self.error,
            "note": self.note,
        }

    @classmethod
    def from_json(cls, data: dict) -> StepModel:
        unknown = set(data.get("coefficients", {})) - set(FEATURES)
        if unknown or "coefficients" not in data:
            raise ValueError(f"not a step profile: coefficients {sorted(unknown)} unknown")
        coefficients = {k: float(v) for k, v in data["coefficients"].items()}
        return cls(coefficients, data.get("key", {}), data.get("error", {}), data.get("note", ""))

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> StepModel:
        return cls.from_json(json.loads(Path(path).read_text()))

    # ---- fitting -----------------------------------------------------------------------
    @classmethod
    def fit(cls, samples: list[tuple[StepShape, float]], **info) -> StepModel:
        """Least squares on relative error over (shape, measured seconds), coefficients >= 0
        (a feature whose best coefficient is negative is dropped and the rest refitted)."""
        import numpy as np

        x = np.array([s.features() for s, _ in samples], dtype=np.float64)
        t = np.array([seconds for _, seconds in samples], dtype=np.float64)
        rows = x / t[:, None]  # relative error: each row divided by its measured time
        active = [i for i in range(len(FEATURES)) if x[:, i].any()]
        while True:
            scale = np.abs(rows[:, active]).max(axis=0)
            sol, *_ = np.linalg.lstsq(rows[:, active] / scale, np.ones(len(t)), rcond=None)
            sol = sol / scale
            if (sol >= 0).all():
                break
            active.pop(int(np.argmin(sol)))
        coefficients = {name: 0.0 for name in FEATURES}
        for i, value in zip(active, sol, strict=True):
            coefficients[FEATURES[i]] = float(value)
        return cls(coefficients, **info)

    def relative_errors(self, samples: list[tuple[StepShape, float]]) -> list[float]:
        return [abs(self.predict(shape) - seconds) / seconds for shape, seconds in samples]


def fit_with_holdout(samples: list[tuple[StepShape, float]], every: int = 4, **info) -> StepModel:
    """Fit on all samples but every `every`-th, report the error on those held out, then refit
    on all samples (the returned model) keeping that held-out error."""
    held = samples[every - 1 :: every]
    train = [s for i, s in enumerate(samples) if i % every != every - 1]
    errors = StepModel.fit(train).relative_errors(held)
    model = StepModel.fit(samples, **info)
    error = {
        "held_out": len(held),
        "mean_rel": sum(errors) / len(errors),
        "max_rel": max(errors),
        "fit_mean_rel": sum(model.relative_errors(samples)) / len(samples),
    }
    return replace(model, error=error)


# ---- profiles on disk ------------------------------------------------------------------------
def profile_key(model: str, dtype: str, device: str, threads: int | None) -> str:
    """File stem of a profile: model name, dtype, device name and (CPU) torch threads."""
    name = Path(str(model).rstrip("/")).name.lower()
    name = re.sub(r"\.gguf$", "", name)
    parts = [name, dtype, device.lower()] + ([f"{threads}t"] if threads else [])
    return re.sub(r"[^a-z0-9.]+", "-", "-".join(parts)).strip("-")


# No profile for this engine: a conservative CPU-sized guess (it overestimates small steps),
# scaled online by ChunkBudget from measured steps.
FALLBACK = StepModel(
    {"const": 0.02, "prefill_tokens": 0.004, "decodes": 0.01},
    note="built-in fallback: no profile for this model/dtype/device/threads",
)


def user_profile_dir() -> Path:
    """Where `baton profile` writes profiles and find_step_model looks first:
    $BATON_PROFILE_DIR, else ~/.cache/baton/profiles."""
    return Path(os.environ.get(PROFILE_DIR_ENV) or "~/.cache/baton/profiles").expanduser()


def profile_path(key: str) -> Path | None:
    """The profile file named `key`: the user's (user_profile_dir()) if there is one, else the
    shipped one (engine/profiles/); None when neither exists."""
    for directory in (user_profile_dir(), SHIPPED_PROFILES_DIR):
        path = directory / f"{key}.json"
        if path.is_file():
            return path
    return None


def find_step_model(path: str | None, key: str) -> StepModel:
    """The profile at `path`; without one, the profile named `key` (profile_path: the user's,
    then the shipped one), else FALLBACK, with a warning logged once per key."""
    if path is not None:
        if not Path(path).is_file():
            raise FileNotFoundError(f"step_profile {path!r} does not exist")
        return StepModel.load(path)
    found = profile_path(key)
    if found is None:
        _warn_fallback(key)
        return FALLBACK
    return StepModel.load(found)


@functools.cache  # once per key and process: every engine of a worker pool asks
def _warn_fallback(key: str) -> None:
    log.warning(
        "no step-time profile %s.json in %s or %s: using the built-in fallback (corrected "
        "online from measured steps); `baton profile` measures this engine's",
        key,
        user_profile_dir(),
        SHIPPED_PROFILES_DIR,
    )
