"""Scheduler: continuous batching with chunked prefill under token and block budgets.

Each step: running requests first (decodes, then unfinished prefills, in admission order),
then waiting requests in arrival order. A request gets min(remaining, chunk_size, budget)
tokens; decodes get one. Once a step carries prompt tokens, another prompt's chunk gets at most
what is left of prefill_batch_tokens: where a step of that many rows is already compute-bound,
batching more prompts would only hold back the first tokens of the earlier ones, and prompts
that arrive together (a closed-loop client's streams) would stay in lock-step. While requests
decode, waiting prompts start only after decode_steps_between_prompts decode-only steps since
the last step with prompt tokens: prompts prefilled back to back give their streams first
tokens one step apart, so streams of equal answer lengths finish a short decode step apart and
their next prompts queue behind each other's prefill every round; a decode step between the
prompts spaces the next round's arrivals by about a prefill. With a ChunkBudget
(itl_target_ms) a prefill chunk instead gets what the budget grants within min(remaining,
budget): chunk_size no longer applies. When blocks run out the newest running
request is preempted (blocks freed, requeued at the front for recompute).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.chunk_budget import ChunkBudget, StepPlan
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from engine.kv_tier.connector import TierConnector

# prefill_batch_tokens on CPU unless set (benchmarks/prefill_batching.py)
CPU_PREFILL_BATCH_TOKENS = 32
# decode_steps_between_prompts on CPU unless set (docs/serving.md: prompts that arrive together)
CPU_DECODE_STEPS_BETWEEN_PROMPTS = 1


def prefill_batch_tokens_for(configured: int | None, on_cpu: bool) -> int | None:
    """The configured limit, else the device's: on CPU a step of a few dozen rows is
    compute-bound already; elsewhere none."""
    if configured is not None:
        return configured
    return CPU_PREFILL_BATCH_TOKENS if on_cpu else None


def decode_steps_between_prompts_for(configured: int | None, on_cpu: bool) -> int:
    """The configured spacing, else the device's: on CPU a prompt's step is several decode
    steps long; elsewhere 0."""
    if configured is not None:
        return configured
    return CPU_DECODE_STEPS_BETWEEN_PROMPTS if on_cpu else 0


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Budgets of one step."""

    max_num_batched_tokens: int
    chunk_size: int
    max_num_seqs: int
    prefill_batch_tokens: int | None = None  # None: prompts batch up to the token budget
    # while requests decode, a waiting prompt starts only after this many decode-only steps
    # since the last step that carried prompt tokens (0: at once)
    decode_steps_between_prompts: int = 0


@dataclass(slots=True)
class SchedulerOutput:
    """What runs this step: requests in row order with their token counts."""

    requests: list[Request] = field(default_factory=list)
    num_tokens: dict[str, int] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)
    plan: StepPlan | None = None  # the predicted shape of this step (with a ChunkBudget)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens.values())

    def is_empty(self) -> bool:
        return not self.requests


class Scheduler:
    """Decides, step by step, which requests run and how many tokens each gets."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        budget: ChunkBudget | None = None,
        tier: TierConnector | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.budget = budget
        self.tier = tier  # a KV tier below the cache: prefix hits past the device's load from it
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order; the last one is the newest
        self.requests: dict[str, Request] = {}
        # steps since the last one that carried prompt tokens (none yet: as good as forever)
        self.decode_only_steps = config.decode_steps_between_prompts

    def require_tier(self) -> TierConnector:
        """The tier, on the paths only a tier opens (a request waiting for tier KV)."""
        if self.tier is None:
            raise RuntimeError("a KV tier load in a scheduler without a KV tier")
        return self.tier

    # ---- lifecycle -----------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def add_remote(self, request: Request) -> None:
        """Track a request whose prompt KV arrives from another engine (not schedulable yet)."""
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests[request.request_id] = request

    def activate_remote(self, request: Request) -> None:
        """Its prompt KV is in place: join the running batch as a decode."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def add_forked(self, request: Request) -> None:
        """A choice forked off a running request, with its KV in place: runs as a decode."""
        self.requests[request.request_id] = request
        self.activate_remote(request)

    def hold(self, request: Request) -> None:
        """Track a request that may not run yet (its grammar is compiling)."""
        request.status = RequestStatus.WAITING_FOR_GRAMMAR
        self.requests[request.request_id] = request

    def release(self, request: Request) -> None:
        """A held request may run: one that holds its blocks already (remote KV, a fork)
        joins the running batch (a decode, or a prefill of what its blocks lack), anything
        else queues."""
        if self.kv.block_ids(request.request_id):
            self.activate_remote(request)
        else:
            request.status = RequestStatus.WAITING
            self.waiting.append(request)

    def finish(self, request: Request, status: RequestStatus, free_blocks: bool = True) -> None:
        """Mark finished and (unless the caller keeps them) free its blocks at once."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        elif self.tier is not None and request.status in (
            RequestStatus.WAITING_FOR_TIER_KV,
            RequestStatus.WAITING_FOR_REMOTE_KV,
        ):
            self.tier.cancel(request)  # returns once a load writes its blocks no more
        request.status = status
        if free_blocks:
            self.kv.free(request, finished=True)
        self.requests.pop(request.request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running) or self._num_loading() > 0

    def _num_loading(self) -> int:
        return self.tier.num_loading if self.tier is not None else 0

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(plan=self.budget.plan() if self.budget else None)
        if self.tier is not None:
            self._finish_tier_loads()
        budget = self.config.max_num_batched_tokens
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        prompt_tokens = 0  # of prefill chunks in this step
        for req, is_prompt in [(r, False) for r in decodes] + [(r, True) for r in prefills]:
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            room = min(budget, self._prompt_room(prompt_tokens)) if is_prompt else budget
            n = self._chunk(req, room, out.plan)
            if n <= 0:
                continue
            if not self._allocate_or_preempt(req, n, out):
                continue
            budget -= n
            prompt_tokens += n if is_prompt else 0
            out.requests.append(req)
            out.num_tokens[req.request_id] = n
        # Budget given back by preempted requests stays unused by running ones this step.
        budget = self.config.max_num_batched_tokens - out.total_tokens
        spaced = not decodes or self.decode_only_steps >= self.config.decode_steps_between_prompts
        if not out.preempted and spaced:
            prompt_tokens = self._admit_waiting(out, budget, prompt_tokens)
        if prompt_tokens:
            self.decode_only_steps = 0
        elif out.requests:
            self.decode_only_steps += 1
        return out

    def _prompt_room(self, prompt_tokens: int) -> int:
        """Most tokens the next prompt chunk may get in a step that already carries
        `prompt_tokens` prompt tokens."""
        limit = self.config.prefill_batch_tokens
        if limit is None or prompt_tokens == 0:
            return self.config.max_num_batched_tokens
        return max(0, limit - prompt_tokens)

    def _chunk(self, req: Request, budget: int, plan: StepPlan | None) -> int:
        """Tokens `req` gets this step (a decode: 1; a prefill: up to chunk_size, or what the
        plan grants), within the step's remaining token budget; adds them to the plan."""
        remaining = req.num_tokens - req.num_computed_tokens
        if plan is None:
            return min(remaining, self.config.chunk_size, budget)
        if remaining == 1 and req.status == RequestStatus.RUNNING:
            if budget >= 1:
                plan.add_decode(req.num_computed_tokens)
            return min(1, budget)
        return plan.grant(req.num_computed_tokens, min(remaining, budget))

    def observe(self, out: SchedulerOutput, seconds: float, gap_s: float | None = None) -> None:
        """The step `out` ran in `seconds`, `gap_s` after the previous one: corrects the
        budget's model (no-op without one)."""
        if self.budget is not None and out.plan is not None:
            self.budget.observe(out.plan.shape, seconds, gap_s)

    def _allocate_or_preempt(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        while not self.kv.allocate_slots(req, n):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv.free(req)
        if req.request_id in out.num_tokens:
            del out.num_tokens[req.request_id]
            out.requests.remove(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req.request_id)

    def _admit_waiting(self, out: SchedulerOutput, budget: int, prompt_tokens: int) -> int:
        """Admits waiting requests in arrival order while seats, budget and blocks allow;
        returns the step's prompt tokens (`prompt_tokens` and those of the admitted)."""
        # A request with n choices takes n seats: the n - 1 forks join the running batch at
        # its first sample. A request loading its prefix from the KV tier holds its seat.
        seats = (
            len(self.running) + sum(r.num_pending_forks for r in self.running) + self._num_loading()
        )
        while self.waiting and budget > 0:
            req = self.waiting[0]
            if seats + 1 + req.num_pending_forks > self.config.max_num_seqs:
                break
            # Prompt logprobs need the logits of every prompt position: no cached prefix.
            hits = [] if req.needs_prompt_logprobs else self.kv.get_computed_blocks(req)
            n_tier = (
                self.tier.num_hits(self.kv, req, len(hits))
                if self.tier and not req.needs_prompt_logprobs
                else 0
            )
            if n_tier and self._start_tier_load(req, hits, n_tier):
                seats += 1 + req.num_pending_forks
                continue  # loading; too few free blocks for its tier hits: computed as without
            req.num_computed_tokens = len(hits) * self.kv.block_size
            n = self._chunk(req, min(budget, self._prompt_room(prompt_tokens)), out.plan)
            if n <= 0 or not self.kv.allocate_slots(req, n, hits):
                req.num_computed_tokens = 0
                break
            if req.num_cached_tokens is None:
                req.num_cached_tokens = len(hits) * self.kv.block_size
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.requests.append(req)
            out.num_tokens[req.request_id] = n
            budget -= n
            prompt_tokens += n
            seats += 1 + req.num_pending_forks
        return prompt_tokens

    # ---- a KV tier below the cache (engine/kv_tier/connector.py) ----------------------------
    def _start_tier_load(self, req: Request, hits: list, n_tier: int) -> bool:
        """Take blocks for the device hits and the n_tier tier blocks after them and start
        loading the latter; req waits (WAITING_FOR_TIER_KV) until they are in place. False
        (nothing changed) when the blocks are not free."""
        req.num_computed_tokens = len(hits) * self.kv.block_size
        if not self.kv.allocate_slots(req, n_tier * self.kv.block_size, hits):
            req.num_computed_tokens = 0
            return False
        self.waiting.popleft()
        req.status = RequestStatus.WAITING_FOR_TIER_KV
        self.require_tier().start(self.kv, req, len(hits), n_tier)
        return True

    def _finish_tier_loads(self) -> None:
        """Requests whose tier blocks are in place join the running batch, their loaded
        blocks cached like computed ones (a block that failed to load is computed instead)."""
        for req, n_loaded in self.require_tier().finished():
            req.num_computed_tokens += n_loaded * self.kv.block_size
            self.kv.cache_blocks(req, req.num_computed_tokens)
            if req.num_cached_tokens is None:
                req.num_cached_tokens = req.num_computed_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)

    def update_after_step(self, out: SchedulerOutput) -> list[Request]:
        """Advance num_computed_tokens, cache newly full blocks; return rows that sample."""
        sampling = []
        for req in out.requests:
            req.num_computed_tokens += out.num_tokens[req.request_id]
            self.kv.cache_blocks(req, req.num_computed_tokens)
            if req.num_computed_tokens == req.num_tokens:
                sampling.append(req)
        return sampling
