"""Where one engine step's wall time goes: a lap timer the engine step and the model runner
share, and the record of when each sampled token's step ended.

StepPhases is a lap timer: begin() at the step's start, then lap(phase) at each boundary adds
the time since the previous boundary to that phase, so the phases of a step add up to its wall
time exactly (engine/metrics.py exports them as baton:engine_step_phase_seconds{phase}).
The fused decode step's own part timers (engine/model/fused_decode.PARTS, thread 0 inside
the C call) are moved out of "forward" into the phase each part belongs to.

Phases:
  schedule   grammar starts, pending outputs, the scheduler's batch, first-scheduled metrics
  inputs     the batch rows (sample requests, block tables), input tensors, attention metadata
  forward    the model forward; on the fused path only what its C parts leave (the call's
             marshalling); the per-operation path does not split its forward
  matmul     fused path: the qkv, attention-output, gate/up (+ SwiGLU) and down products
  attention  fused path: RoPE, the KV write and the attention over the paged cache
  norms      fused path: RMS norms, residual adds, block sums (and barrier waits: part times
             are thread 0's, so they include its waits for the other threads)
  logits     the output projection (fused or not) and prompt-logprob logits
  sample     the sampler (logits processors, draw) and the logprobs
  grammar    structured outputs' token bitmask fills (before the step's forward)
  outputs    after the forward: scheduler update, appending tokens, detokenization, stop
             checks, finishing requests
  kv         KV bookkeeping after the step: KV events, running/waiting/KV-usage gauges
"""

from __future__ import annotations

import time
from collections import deque

from engine.model.fused_decode import PARTS

PHASES = (
    "schedule",
    "inputs",
    "forward",
    "matmul",
    "attention",
    "norms",
    "logits",
    "sample",
    "grammar",
    "outputs",
    "kv",
)
# The phase of each fused C part, in PARTS order.
FUSED_PART_PHASES = ("norms", "matmul", "attention", "matmul", "matmul", "matmul", "logits")
assert len(FUSED_PART_PHASES) == len(PARTS)
TOKEN_TIMES_KEPT = 100_000  # a token-time record keeps at most this many tokens (the newest)


class StepPhases:
    """Seconds per phase of the current step (PHASES), by laps; one per engine."""

    __slots__ = ("seconds", "_last")

    def __init__(self) -> None:
        self.begin()

    def begin(self, now: float | None = None) -> None:
        """Start a step at `now` (a perf_counter value): every phase back to 0."""
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._last = time.perf_counter() if now is None else now

    def lap(self, phase: str) -> float:
        """Add the time since the previous lap (or begin) to `phase`; returns now."""
        now = time.perf_counter()
        self.seconds[phase] += now - self._last
        self._last = now
        return now

    def move(self, src: str, dst: str, seconds: float) -> None:
        """Count `seconds` of what src measured as dst's (a part timed inside src's span)."""
        self.seconds[src] -= seconds
        self.seconds[dst] += seconds


class TokenTimes:
    """When the step that sampled each token ended: (request id, output index, monotonic
    seconds) per token, the newest TOKEN_TIMES_KEPT kept. time.monotonic is one clock for
    every process of a host (CLOCK_MONOTONIC), so a client there can subtract it from the
    time it received the token."""

    def __init__(self, kept: int = TOKEN_TIMES_KEPT) -> None:
        self.tokens: deque[tuple[str, int, float]] = deque(maxlen=kept)
        self._step: list[tuple[str, int]] = []

    def sampled(self, request_id: str, index: int) -> None:
        """Token `index` (0: the first output token) of request_id was sampled this step."""
        self._step.append((request_id, index))

    def step_ended(self, at: float) -> None:
        """The step that sampled the tokens since the last call ended at `at` (monotonic)."""
        self.tokens.extend((rid, index, at) for rid, index in self._step)
        self._step.clear()

    def take(self) -> list[tuple[str, int, float]]:
        """Every kept token's (request id, output index, step end), oldest first; clears."""
        out = list(self.tokens)
        self.tokens.clear()
        return out
