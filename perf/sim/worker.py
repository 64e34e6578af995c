"""A simulated worker: the real BlockPool (prefix cache, LRU eviction, KV events) and the
scheduler's budgets (engine/scheduler.py: decodes, then running prefills, then waiting prompts
in order; chunk_size, or a ChunkBudget for itl_target_ms or decode_stretch; max_num_batched_tokens,
prefill_batch_tokens, decode_steps_between_prompts, max_num_seqs), with each step's duration
predicted by the step profile.

Differences from the engine, kept on purpose (simpler, and no effect without memory pressure):
a job reserves all its blocks when admitted (prompt + max_tokens for a decoding job, the
prompt for a prefill-only one), so nothing is preempted; a job that does not fit waits.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.block_pool import BlockPool
from engine.chunk_budget import ChunkBudget, DecodeStretchBudget
from engine.scheduler import decode_steps_between_prompts_for, prefill_batch_tokens_for
from engine.step_model import StepModel, StepShape
from perf.sim.events import EventLoop
from perf.sim.request import DECODE, PREFILL, Job
from router.policy import DecodeLoad


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """The engine options the simulation reads (names as in engine/options.py)."""

    block_size: int = 16
    num_kv_blocks: int = 2048
    chunk_size: int = 1024
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    prefill_batch_tokens: int | None = None  # None: the engine's default for the profile's device
    decode_steps_between_prompts: int | None = None  # None: likewise
    itl_target_ms: float | None = None
    decode_stretch: float = 0.0
    enable_prefix_caching: bool = True


def _key(h: int) -> tuple:
    """The BlockPool hash key of a simulated block: prompts carry hashes, not tokens."""
    return (h, (), ())


class SimWorker:
    """One engine; `cluster` gets prefilled(worker, job) and finished(worker, job) calls."""

    def __init__(
        self, worker_id: str, config: WorkerConfig, model: StepModel, loop: EventLoop, cluster
    ) -> None:
        self.worker_id = worker_id
        self.config = config
        self.model = model
        self.loop = loop
        self.cluster = cluster
        self.pool = BlockPool(config.num_kv_blocks, config.enable_prefix_caching)
        on_cpu = model.key.get("device", "cpu") == "cpu"
        self.prefill_batch_tokens = prefill_batch_tokens_for(config.prefill_batch_tokens, on_cpu)
        self.spacing = decode_steps_between_prompts_for(config.decode_steps_between_prompts, on_cpu)
        self.decode_only_steps = self.spacing  # engine/scheduler.py's count, as it starts
        self.budget: ChunkBudget | None = None
        if config.itl_target_ms:
            self.budget = ChunkBudget(model, config.itl_target_ms / 1000.0, config.block_size)
        elif config.decode_stretch:
            self.budget = DecodeStretchBudget(
                model, config.decode_stretch, config.block_size, config.chunk_size
            )
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self.busy = False
        self.steps = 0
        self.busy_s = 0.0  # simulated seconds of its steps
        self.reserved = 0  # DECODE jobs holding blocks here, waiting for their KV
        self._load: DecodeLoad | None = None
        self._between_steps: list = []  # calls the engine loop runs when the step ends

    @property
    def num_requests(self) -> int:
        """Requests the engine tracks (as its stats report them): reserved ones included."""
        return len(self.waiting) + len(self.running) + self.reserved

    def decode_load(self, pending: int) -> DecodeLoad:
        """The router's view of this worker (its stats: free blocks, requests), reused while
        they are unchanged."""
        free, requests = len(self.pool._free), self.num_requests + pending
        cached = self._load
        if cached is None or cached.free_blocks != free or cached.running_requests != requests:
            cached = self._load = DecodeLoad(
                self.worker_id, free, requests, total_blocks=self.pool.num_blocks
            )
        return cached

    # ---- jobs --------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """A prompt to prefill here (PREFILL or FULL)."""
        self.waiting.append(job)
        self._kick()

    def reserve(self, job: Job) -> bool:
        """A DECODE job's blocks: its own cached prefix plus new ones; False if they do not fit
        now (nothing taken)."""
        if not self._take_blocks(job):
            return False
        self.reserved += 1
        self._publish()
        return True

    def activate(self, job: Job) -> None:
        """The job's prompt KV is here: register its blocks and join the batch as a decode."""
        self.reserved -= 1
        job.num_computed = job.request.prompt_tokens
        self._store(job)
        self._publish()
        self.running.append(job)
        self._kick()

    def between_steps(self, call) -> None:
        """Run call() now if idle, else when the current step ends (as EngineLoop.run does:
        a remote request joins, and its first token leaves, between two steps)."""
        if self.busy:
            self._between_steps.append(call)
        else:
            call()

    def release(self, job: Job) -> None:
        """Free a job's blocks, tail first (the head, most shareable, is evicted last)."""
        self.pool.free(job.blocks[::-1])
        job.blocks = []

    # ---- blocks ------------------------------------------------------------------------
    def _take_blocks(self, job: Job) -> bool:
        bs, r = self.config.block_size, job.request
        hits = []
        if self.config.enable_prefix_caching:
            for h in r.hashes[: (r.prompt_tokens - 1) // bs]:
                block = self.pool.lookup(h, _key(h))
                if block is None:
                    break
                hits.append(block)
        total = r.prompt_tokens + (0 if job.mode == PREFILL else r.max_tokens)
        need = -(-total // bs) - len(hits)
        free_after_touch = self.pool.num_free_blocks - sum(b.ref_cnt == 0 for b in hits)
        if need > free_after_touch:
            return False
        self.pool.touch(hits)
        job.blocks = hits + self.pool.allocate(need)
        job.hit_blocks = job.stored = len(hits)
        job.num_computed = len(hits) * bs
        return True

    def _store(self, job: Job) -> None:
        """Register the job's newly computed full prompt blocks in the prefix cache."""
        r, bs = job.request, self.config.block_size
        upto = min(len(r.hashes), job.num_computed // bs)
        for i in range(job.stored, upto):
            h = r.hashes[i]
            self.pool.cache_block(job.blocks[i], h, _key(h))
        job.stored = max(job.stored, upto)

    def _publish(self) -> None:
        events = self.pool.take_events()
        if events:
            self.cluster.index.apply(self.worker_id, events)

    # ---- steps -------------------------------------------------------------------------
    def _kick(self) -> None:
        if not self.busy and (self.running or self.waiting):
            self._set_busy(True)
            self.loop.at(self.loop.now, self._step)

    def _step(self) -> None:
        c = self.config
        plan = self.budget.plan() if self.budget else None
        budget = c.max_num_batched_tokens
        rows: list[tuple[Job, int]] = []
        # StepShape's fields in order: prefill tokens, chunks, attention pairs, decodes, decode
        # context, prefill context
        shape = [0, 0, 0, 0, 0, 0]
        decodes = [j for j in self.running if j.num_tokens - j.num_computed == 1]
        prefills = [j for j in self.running if j.num_tokens - j.num_computed > 1]
        prompt_tokens = 0
        for job in decodes:
            n = self._chunk(job, budget, plan, shape, running=True)
            if n > 0:
                budget -= n
                rows.append((job, n))
        for job in prefills:
            n = self._chunk(job, min(budget, self._prompt_room(prompt_tokens)), plan, shape, True)
            if n > 0:
                budget -= n
                prompt_tokens += n
                rows.append((job, n))
        spaced = not decodes or self.decode_only_steps >= self.spacing
        while spaced and self.waiting and budget > 0 and len(self.running) < c.max_num_seqs:
            job = self.waiting[0]
            room = min(budget, self._prompt_room(prompt_tokens))
            if room <= 0 or not self._take_blocks(job):
                break
            n = self._chunk(job, room, plan, shape, running=False)
            if n <= 0:  # keep the blocks' accounting exact
                self.release(job)
                break
            if job.mode != DECODE:
                job.request.cached_tokens = job.hit_blocks * c.block_size
            self.waiting.popleft()
            self.running.append(job)
            rows.append((job, n))
            budget -= n
            prompt_tokens += n
        self._publish()
        if prompt_tokens:
            self.decode_only_steps = 0
        elif rows:
            self.decode_only_steps += 1
        if not rows:  # everything waits for blocks: idle until some are freed
            self._set_busy(False)
            return
        if plan is not None:
            seconds = self.model.predict(plan.shape)
        else:
            seconds = self.model.predict(StepShape(*shape))
        seconds *= self.cluster.slowdown()
        if plan is not None and self.budget is not None:  # corrected by each step's time
            self.budget.observe(plan.shape, seconds)
        self.steps += 1
        self.busy_s += seconds
        self.loop.at(self.loop.now + seconds, self._step_done, rows)

    def _prompt_room(self, prompt_tokens: int) -> int:
        """engine/scheduler.py's Scheduler._prompt_room."""
        if self.prefill_batch_tokens is None or prompt_tokens == 0:
            return self.config.max_num_batched_tokens
        return max(0, self.prefill_batch_tokens - prompt_tokens)

    def _set_busy(self, busy: bool) -> None:
        """Mark this worker computing (a step in flight or about to start) or idle; the
        cluster counts busy workers for its shared-core slowdown."""
        if busy != self.busy:
            self.busy = busy
            self.cluster.busy_workers += 1 if busy else -1

    def _chunk(self, job: Job, budget: int, plan, shape: list[int], running: bool) -> int:
        """engine/scheduler.py's Scheduler._chunk (a running job with one token left is a
        decode row), adding the row to the step's shape."""
        remaining = job.num_tokens - job.num_computed
        if remaining == 1 and running:
            if budget < 1:
                return 0
            if plan is not None:
                plan.add_decode(job.num_computed)
            shape[3] += 1
            shape[4] += job.num_computed + 1
            return 1
        if plan is not None:
            return plan.grant(job.num_computed, min(remaining, budget))
        n = min(remaining, self.config.chunk_size, budget)
        if n > 0:
            shape[0] += n
            shape[1] += 1
            shape[2] += n * job.num_computed + n * (n + 1) // 2
            shape[5] += job.num_computed
        return n

    def _step_done(self, rows: list[tuple[Job, int]]) -> None:
        now = self.loop.now
        for job, n in rows:
            job.num_computed += n
            if job.stored < len(job.request.hashes):
                self._store(job)
            if job.num_computed < job.num_tokens:
                continue
            r = job.request
            if job.mode == PREFILL:  # first token sampled; blocks kept until the KV is sent
                self.running.remove(job)
                self.cluster.prefilled(self, job)
                continue
            job.output += 1
            job.num_tokens += 1
            r.chunks.append((now, 1))
            if job.output >= r.max_tokens:
                self.running.remove(job)
                self.release(job)
                self.cluster.finished(self, job)
        self._publish()
        self._set_busy(False)
        calls, self._between_steps = self._between_steps, []
        for call in calls:
            call()
        self._kick()
