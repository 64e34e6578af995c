"""Dynamic chunking: prefill tokens per step chosen so the predicted step time stays within a
limit, the step-time model corrected online. Two kinds of limit:

- ChunkBudget: a target in seconds (engine option itl_target_ms), less the recent gaps
  between steps (below);
- DecodeStretchBudget (engine option decode_stretch): a step that carries
  prefill beside running decodes may take at most `stretch` times the same step without the
  prefill, so a prompt arriving stretches the running streams' inter-token time by at most
  that factor on any hardware; chunk_size still bounds every chunk, and a step with no
  decodes takes chunk_size tokens, as without a budget.

Each step the scheduler opens a StepPlan, adds its decode rows, then asks for each prefill
chunk in turn: a chunk gets the most tokens whose predicted step (decodes, earlier chunks and
this one) stays within the target, and the first chunk of a step at least `min_tokens` so a
prompt always advances. The correction is measured / predicted seconds over steps that had
prefill tokens (the steps the budget shapes): its EWMA, or where that is lower, the
TAIL_QUANTILE of the last RECENT_STEPS ratios, so that steps slower than usual (a shared
CPU, a cache miss) stay within the target too: the target bounds the tail of the step
times, not their mean.

A decode's inter-token time is its step plus the engine loop's work between two steps
(outputs handed to their streams, requests added): the engine reports those gaps, and steps
are planned within the target less the TAIL_QUANTILE of the recent ones (at most
MAX_GAP_SHARE of the target).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from engine.step_model import StepModel, StepShape

logger = logging.getLogger(__name__)

RATIO_LIMITS = (0.1, 10.0)  # one measured step moves the ratio at most by this factor
TOLERANCE = 1e-9  # relative slack when comparing a prediction with the target
RECENT_STEPS = 20  # ratios the tail is taken over
TAIL_QUANTILE = 0.9  # the ratio planned with: this quantile of the recent ones (or the EWMA)
MIN_TAIL_STEPS = 5  # before this many ratios (or gaps), the EWMA alone (no gap)
MAX_GAP_SHARE = 0.5  # the gaps between steps take at most this share of the target
OVERRUN_LOG_EVERY_S = 60.0  # a target the floor cannot keep is logged at most this often


class ChunkBudget:
    """Holds the model, the target and the online correction ratio across steps."""

    def __init__(
        self,
        model: StepModel,
        target_s: float,
        min_tokens: int,
        alpha: float = 0.25,
        on_floor_overrun: Callable[[], None] | None = None,
    ) -> None:
        """on_floor_overrun: called for every floor overrun (the engine's metric)."""
        if target_s <= 0 or min_tokens < 1 or not 0 < alpha <= 1:
            raise ValueError("need target_s > 0, min_tokens >= 1 and 0 < alpha <= 1")
        self.model = model
        self.target_s = target_s
        self.min_tokens = min_tokens
        self.alpha = alpha
        self.ratio = 1.0  # EWMA of measured / predicted seconds
        self.recent: deque[float] = deque(maxlen=RECENT_STEPS)  # the last ratios
        self.gaps: deque[float] = deque(maxlen=RECENT_STEPS)  # the last gaps between steps
        self.floor_overruns = 0  # steps whose floor chunk alone was predicted over the target
        self._overrun_logged_at: float | None = None
        self._on_floor_overrun = on_floor_overrun

    def planning_ratio(self) -> float:
        """The correction plans use: the EWMA, or the recent ratios' tail where higher."""
        return max(self.ratio, _tail(self.recent, default=self.ratio))

    def step_limit_s(self) -> float:
        """Seconds a step may be predicted to take: the target less the gaps' tail."""
        gap = min(_tail(self.gaps, default=0.0), MAX_GAP_SHARE * self.target_s)
        return self.target_s - gap

    def predict(self, shape: StepShape) -> float:
        """Corrected predicted seconds of a step of this shape."""
        return self.planning_ratio() * self.model.predict(shape)

    def limit_for(self, decodes: StepShape) -> float | None:
        """Seconds a step with these decode rows (and prefill chunks to come) may be predicted
        to take; None: no time limit, chunks of chunk_size."""
        return self.step_limit_s()

    def cap(self, want: int) -> int:
        """The most tokens a chunk may get whatever the limit."""
        return want

    def floor_overrun(self, context: int, n: int, predicted_s: float) -> None:
        """A step took the floor chunk although predicted over the target: the target cannot
        hold beside a prompt at this context on this hardware; counted, logged now and then."""
        self.floor_overruns += 1
        if self._on_floor_overrun is not None:
            self._on_floor_overrun()
        self._log_floor_overrun(context, n, predicted_s)

    def _log_floor_overrun(self, context: int, n: int, predicted_s: float) -> None:
        now = time.monotonic()
        if self._overrun_logged_at is None or now - self._overrun_logged_at >= OVERRUN_LOG_EVERY_S:
            self._overrun_logged_at = now
            logger.warning(
                "itl_target_ms %.0f cannot hold: a step with the smallest chunk (%d tokens "
                "after %d cached) is predicted at %.0f ms (%d such steps so far)",
                self.target_s * 1000,
                n,
                context,
                predicted_s * 1000,
                self.floor_overruns,
            )

    def plan(self) -> StepPlan:
        """An empty plan for the next step."""
        return StepPlan(self)

    def observe(self, shape: StepShape, seconds: float, gap_s: float | None = None) -> None:
        """Correct the model by a step that ran: only steps with prefill tokens count.
        gap_s: seconds from the previous step's end to this one's start when the engine went
        straight on (what its decodes waited beyond the step), else None."""
        if gap_s is not None and gap_s >= 0:
            self.gaps.append(gap_s)
        predicted = self.model.predict(shape)
        if shape.prefill_tokens == 0 or predicted <= 0 or seconds <= 0:
            return
        low, high = RATIO_LIMITS
        ratio = min(max(seconds / predicted, self.ratio * low), self.ratio * high)
        self.ratio += self.alpha * (ratio - self.ratio)
        self.recent.append(ratio)


class DecodeStretchBudget(ChunkBudget):
    """A step with prefill chunks beside decodes is held within `stretch` times the predicted
    decode-only step (the floor chunk aside); chunks are at most chunk_size tokens."""

    def __init__(
        self,
        model: StepModel,
        stretch: float,
        min_tokens: int,
        chunk_size: int,
        alpha: float = 0.25,
        on_floor_overrun: Callable[[], None] | None = None,
    ) -> None:
        if stretch <= 1 or chunk_size < 1:
            raise ValueError("need stretch > 1 and chunk_size >= 1")
        super().__init__(model, 1.0, min_tokens, alpha, on_floor_overrun)
        self.stretch = stretch
        self.chunk_size = chunk_size

    def limit_for(self, decodes: StepShape) -> float | None:
        if decodes.decodes == 0:
            return None
        return self.stretch * self.predict(decodes)

    def cap(self, want: int) -> int:
        return min(want, self.chunk_size)

    def _log_floor_overrun(self, context: int, n: int, predicted_s: float) -> None:
        pass  # expected where decode steps are short: the floor keeps a prompt moving


class StepPlan:
    """The shape of one step being scheduled, and the prefill tokens it can still take. The
    scheduler adds the step's decodes before its chunks, so the limit, fixed at the first
    chunk, sees them all."""

    def __init__(self, budget: ChunkBudget) -> None:
        self.budget = budget
        self.shape = StepShape()
        self._limit: tuple[float | None] | None = None  # (limit_for(decodes),) once chunked

    def add_decode(self, context: int) -> None:
        self.shape = self.shape.with_decode(context)

    def limit_s(self) -> float | None:
        """The step's limit in seconds (None: chunk_size applies), fixed at its first call."""
        if self._limit is None:
            self._limit = (self.budget.limit_for(self.shape),)
        return self._limit[0]

    def fits(self, context: int, n: int) -> bool:
        limit = self.limit_s()
        if limit is None:
            return True
        return self.budget.predict(self.shape.with_chunk(context, n)) <= limit * (1 + TOLERANCE)

    def grant(self, context: int, want: int) -> int:
        """Tokens (<= want) for a prefill chunk after `context` computed tokens; adds them."""
        want = self.budget.cap(want)
        if want <= 0:
            return 0
        if self.limit_s() is None:
            self.shape = self.shape.with_chunk(context, want)
            return want
        lo, hi = (want, want) if self.fits(context, want) else (0, want)
        while hi - lo > 1:  # lo tokens fit (0: the empty chunk), hi do not
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.fits(context, mid) else (lo, mid)
        n = lo
        if self.shape.prefill_tokens == 0 and n < min(self.budget.min_tokens, want):
            # lo is the most that fits and predictions grow with n: the floor does not fit
            n = min(self.budget.min_tokens, want)
            predicted = self.budget.predict(self.shape.with_chunk(context, n))
            self.budget.floor_overrun(context, n, predicted)
        if n > 0:
            self.shape = self.shape.with_chunk(context, n)
        return n


def _tail(values: deque[float], default: float) -> float:
    """The TAIL_QUANTILE of the values; `default` while fewer than MIN_TAIL_STEPS."""
    if len(values) < MIN_TAIL_STEPS:
        return default
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(TAIL_QUANTILE * len(ordered)))]
