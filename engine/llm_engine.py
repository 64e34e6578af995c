"""LLMEngine: add requests, step, stream outputs; one process, one model, paged KV."""

from __future__ import annotations

import random
import time

import torch

from engine.block_exchange import BlockExchangeHooks
from engine.block_pool import BlockPool, KVEvent
from engine.choices import ChoiceGroup, choice_id, is_choice_of
from engine.chunk_budget import ChunkBudget, DecodeStretchBudget
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.disaggregation import REMOTE_TIER_WAIT_S, DisaggregationHooks, HeldBlocks
from engine.errors import CapacityError, GrammarRejected, InvalidRequestError, PromptTooLongError
from engine.grammar import GrammarManager
from engine.kv_cache_manager import KVCacheManager
from engine.kv_tier.connector import TierConnector, open_engine_tier
from engine.kv_tier.metrics import TierCollector
from engine.metrics import EngineMetrics
from engine.model_runner import BatchRow, ModelRunner, PromptLogprobsSpan
from engine.outputs import RequestOutput, StepResult
from engine.request import Request, RequestStatus
from engine.request_outputs import RequestOutputs, finished_last
from engine.retention import Retention
from engine.sampler import SampleRequest, choice_seed
from engine.sampling_params import SamplingParams
from engine.scheduler import (
    Scheduler,
    SchedulerConfig,
    decode_steps_between_prompts_for,
    prefill_batch_tokens_for,
)
from engine.step_model import find_step_model, profile_key
from engine.step_phases import StepPhases, TokenTimes
from engine.tokenizer import eos_token_ids, load_tokenizer

TIER_IDLE_WAIT_S = 0.01  # a step with nothing to run waits this long for a KV tier load
GRAMMAR_WAIT_S = 0.005  # an empty step waits this long for a compiling grammar


class LLMEngine(DisaggregationHooks, BlockExchangeHooks, RequestOutputs):
    """The engine step loop: schedule, run the model, process outputs.

    Outputs are keyed by the choice's engine id (engine.choices.choice_id: the request id
    when n == 1); RequestOutput.request_id is always the request's own id.
    """

    def __init__(self, model: str | None = None, **options) -> None:
        from engine.model_resolver import resolve_model

        self.config = EngineConfig.from_options(model, **options)
        self.model_dir = resolve_model(self.config.model)
        from engine.model.loader import read_hf_config

        hf_config = read_hf_config(self.model_dir)
        model_max = int(hf_config.get("max_position_embeddings", 2048))
        # Sliding-window attention is not implemented: within the window it equals full
        # attention, so the context is capped at the window.
        window = (
            hf_config.get("sliding_window")
            if (hf_config.get("model_type") == "mistral" or hf_config.get("use_sliding_window"))
            else None
        )
        if window:
            model_max = min(model_max, int(window))
        self.max_model_len = self.config.max_model_len or model_max
        if self.max_model_len > model_max:
            raise InvalidRequestError(
                f"max_model_len={self.max_model_len} exceeds this model's limit of {model_max} "
                f"tokens (max_position_embeddings{' / sliding_window' if window else ''})"
            )
        self.tokenizer = None if self.config.skip_tokenizer_init else load_tokenizer(self.model_dir)
        self.eos_token_ids = eos_token_ids(self.model_dir, hf_config, self.tokenizer)
        self.runner = ModelRunner(self.config, self.model_dir, self.max_model_len)
        # A KV tier below the cache (engine/kv_tier), or None: evicted blocks are offered to it
        self.kv_tier = open_engine_tier(self.config, self.model_dir, self.runner)
        tier = TierConnector(self.kv_tier, self.runner.kv_caches) if self.kv_tier else None
        self.pool = BlockPool(
            self.runner.num_blocks,
            self.config.enable_prefix_caching,
            on_evict=tier.on_evict if tier else None,
        )
        self.kv = KVCacheManager(self.pool, self.config.block_size, self.config.hash_seed)
        self.metrics = EngineMetrics()  # this engine's own registry (engine/metrics.py)
        # The step's lap timer, shared with the runner (engine/step_phases.py)
        self.phases = self.runner.phases = StepPhases()
        self.token_times: TokenTimes | None = None  # set: each token's step end is recorded
        if self.kv_tier is not None:
            self.metrics.registry.register(TierCollector(self.kv_tier))
        on_cpu = self.runner.device.type == "cpu"
        self.scheduler = Scheduler(
            SchedulerConfig(
                self.config.max_num_batched_tokens,
                self.config.chunk_size,
                self.config.max_num_seqs,
                prefill_batch_tokens_for(self.config.prefill_batch_tokens, on_cpu),
                decode_steps_between_prompts_for(self.config.decode_steps_between_prompts, on_cpu),
            ),
            self.kv,
            self._chunk_budget(),
            tier,
        )
        self._rng = random.Random(self.config.seed)
        self._seeds: dict[str, int] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._pending: dict[str, RequestOutput] = {}  # outputs produced outside step()
        self._groups: dict[str, ChoiceGroup] = {}  # request id -> its choices (n > 1)
        # prefilled request id -> its hold (prefill role); the prefill worker's sender thread
        # reads the block ids without waiting for a step to end
        self._held: dict[str, HeldBlocks] = {}
        # exchange id -> its token run: blocks pinned for a pull (engine/block_exchange.py)
        self._exchanges: dict[str, Request] = {}
        self._went_on_from: float | None = None  # end of the last step, if work was left
        # decode side: the longest complete_remote waits for a tier load still running
        self.remote_tier_wait_s = REMOTE_TIER_WAIT_S
        self._grammar: GrammarManager | None = None  # made at the first structured request

    @property
    def grammar(self) -> GrammarManager:
        """Structured outputs' compiler and matchers (one TokenizerInfo per engine)."""
        if self._grammar is None:
            self._grammar = GrammarManager(
                self.tokenizer, self.runner.model.args.vocab_size, self.eos_token_ids
            )
        return self._grammar

    def _constrained(self, request_id: str) -> bool:
        return self._grammar is not None and self._grammar.is_constrained(request_id)

    def _chunk_budget(self) -> ChunkBudget | None:
        """Dynamic chunking's budget (engine/chunk_budget.py): itl_target_ms when set, else
        decode_stretch; None when both are off (fixed chunk_size)."""
        c = self.config
        if c.itl_target_ms is None and not c.decode_stretch:
            return None
        try:
            model = find_step_model(c.step_profile, self.step_profile_key())
        except (OSError, ValueError) as exc:
            raise InvalidRequestError(f"step_profile: {exc}") from exc
        if c.itl_target_ms is None:
            return DecodeStretchBudget(
                model,
                c.decode_stretch,
                c.block_size,
                c.chunk_size,
                on_floor_overrun=self.metrics.floor_steps.inc,
            )
        return ChunkBudget(
            model,
            c.itl_target_ms / 1000,
            c.block_size,
            on_floor_overrun=self.metrics.floor_steps.inc,
        )

    def step_profile_key(self) -> str:
        """Name of this engine's shipped step profile: model, dtype, device, CPU threads."""
        device = self.runner.device
        cpu = device.type == "cpu"
        return profile_key(
            self.config.model,
            str(self.runner.dtype).removeprefix("torch."),
            "cpu" if cpu else torch.cuda.get_device_name(device),
            torch.get_num_threads() if cpu else None,
        )

    # ---- requests ------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        seed: int | None = None,
        prefill_only: bool = False,
        retention: Retention | None = None,
    ) -> Request:
        """Queue a tokenized prompt; raises InvalidRequestError/CapacityError on bad input.

        seed overrides the sampling seed (a request moved between engines keeps its seed).
        prefill_only: finish after the first token and hold the blocks until release_held();
        with n > 1 its n first tokens are sampled (one output per choice).
        retention: once it finished, its blocks are kept for its session (engine/retention.py).
        """
        self._check_retention(retention)
        req = self._new_request(
            request_id, prompt_token_ids, params, cache_salt, arrival_time, seed, prefill_only
        )
        req.retention = retention
        if req.params.structured_output is not None:
            self.grammar.submit(request_id, req.params.structured_output)
            self.scheduler.hold(req)  # schedulable once its grammar is compiled
        else:
            self.scheduler.add(req)
        return req

    def _new_request(
        self, request_id, prompt_token_ids, params, cache_salt, arrival_time, seed, prefill_only
    ) -> Request:
        params = params or SamplingParams()
        ids = [choice_id(request_id, i) for i in range(params.n)]
        if any(
            rid in self.scheduler.requests
            or rid in self._pending
            or rid in self._held
            or is_choice_of(rid, self._groups)
            for rid in ids
        ):
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise InvalidRequestError("prompt is empty")
        vocab = self.runner.model.args.vocab_size
        bad = [t for t in prompt_token_ids if not (0 <= int(t) < vocab)]
        if bad:
            raise InvalidRequestError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        params.validate_vocab(vocab)
        if params.structured_output is not None and self.tokenizer is None:
            raise InvalidRequestError(
                "structured_output needs the model's tokenizer, but this engine was started "
                "with skip_tokenizer_init=True"
            )
        max_n = min(self.config.max_n, self.config.max_num_seqs)
        if params.n > max_n:
            raise InvalidRequestError(
                f"sampling.n={params.n} is invalid: this engine allows at most {max_n} choices "
                "per request (engine options max_n, max_num_seqs)"
            )
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {n} tokens; max_model_len is "
                f"{self.max_model_len} (need room for one new token)"
            )
        if params.num_prior_output_tokens >= n:
            raise InvalidRequestError(
                f"num_prior_output_tokens={params.num_prior_output_tokens} must be less than "
                f"the prompt's {n} tokens (they are its tail)"
            )
        need = -(-(n + 1) // self.config.block_size)
        if need > self.pool.num_blocks:
            raise CapacityError(
                f"prompt needs {need} KV blocks; this engine has only {self.pool.num_blocks}"
            )
        req = Request(
            request_id,
            [int(t) for t in prompt_token_ids],
            params,
            arrival_time=arrival_time,
            cache_salt=cache_salt,
            prefill_only=prefill_only,
        )
        if seed is None:
            seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        self._seeds[request_id] = seed
        self._detok[request_id] = detok = self._detokenizer(params)
        if params.num_prior_output_tokens:
            detok.prime(req.prompt_token_ids[n - params.num_prior_output_tokens :])
        if params.n > 1:
            self._groups[request_id] = ChoiceGroup(params.n)
        return req

    def _check_retention(self, retention: Retention | None) -> None:
        """InvalidRequestError unless a request's retention is within max_retention_seconds."""
        if retention is not None:
            retention.check(self.config.max_retention_seconds)

    def _detokenizer(self, params: SamplingParams) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(
            self.tokenizer, params.stop, params.include_stop_str_in_output
        )

    def seed_of(self, request_id: str) -> int:
        """The effective sampling seed of a live request (to continue it elsewhere); choice
        i > 0 draws with choice_seed(seed, i)."""
        return self._seeds[request_id]

    def _forget(self, request_id: str) -> None:
        """Drop a request that never ran (its reservation failed)."""
        self._seeds.pop(request_id, None)
        self._detok.pop(request_id, None)
        self._groups.pop(request_id, None)
        if self._grammar is not None:
            self._grammar.remove(request_id)
        self.kv.free_table(request_id)

    @property
    def kv_caches(self):
        """Per-layer KV tensors [2, num_blocks, block_size, num_kv_heads, head_dim]."""
        return self.runner.kv_caches

    def abort(self, request_id: str) -> bool:
        """Finish a request now (every choice) and free its blocks; False if it is unknown
        or done."""
        group = self._groups.get(request_id)
        indices = sorted(group.unfinished) if group else [0]
        live = [
            self.scheduler.requests[rid]
            for rid in (choice_id(request_id, i) for i in indices)
            if rid in self.scheduler.requests
        ]
        if not live:
            return self.release_held(request_id)
        for req in live:
            self._put(self._pending, self._finish(req, RequestStatus.FINISHED_ABORTED))
        return True

    def fail_all(self, error: str) -> None:
        """Finish every request with `error` (outputs queued for the next step/take_pending)."""
        for req in list(self.scheduler.requests.values()):
            req.error = error
            self._put(self._pending, self._finish(req, RequestStatus.FINISHED_ERROR))
        for rid in list(self._held):
            self.release_held(rid)

    def take_pending(self) -> dict[str, RequestOutput]:
        """Outputs produced outside step() (aborts, failures, remote completions)."""
        pending, self._pending = self._pending, {}
        return finished_last(pending)

    def has_unfinished(self) -> bool:
        return (
            self.scheduler.has_unfinished()
            or bool(self._pending)
            or (self._grammar is not None and self._grammar.has_compiling())
        )

    def num_unfinished(self) -> int:
        return len(self.scheduler.requests)

    def check_integrity(self) -> None:
        """Raise AssertionError if the block accounting is inconsistent."""
        self.pool.check_integrity()
        stray = (
            set(self.kv.table_ids())
            - set(self.scheduler.requests)
            - set(self._held)
            - set(self._exchanges)
        )
        if stray:
            raise AssertionError(f"block tables of unknown requests: {sorted(stray)[:5]}")
        in_tables: dict[int, int] = {}
        for rid in self.kv.table_ids():
            for b in self.kv.block_ids(rid):
                in_tables[b] = in_tables.get(b, 0) + 1
        for block in self.pool.blocks:
            if block.ref_cnt != in_tables.get(block.block_id, 0):
                raise AssertionError(
                    f"block {block.block_id}: ref_cnt {block.ref_cnt} but "
                    f"{in_tables.get(block.block_id, 0)} live references"
                )

    def take_kv_events(self) -> list[KVEvent]:
        """KV events since the last call: the device cache's, then the KV tier's (each
        medium's in order; a block can be stored in the tier after leaving the device)."""
        events = self.pool.take_events()
        if self.scheduler.tier is not None:
            events.extend(self.scheduler.tier.take_events())
        return events

    def close(self) -> None:
        """Release what outlives the steps: the KV tier (a persistent one first gets every
        block the device caches, so a restart finds them; then its queued writes finish, its
        threads stop and a disk tier's directory is unlocked). A no-op without a tier."""
        if self.kv_tier is None:
            return
        if self.kv_tier.persistent:
            self.scheduler.require_tier().persist(self.pool)
        self.kv_tier.close()

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> StepResult:
        """Schedule one batch, run it, and return what each request gained."""
        step_start = time.perf_counter()
        phases = self.phases
        phases.begin(step_start)
        self._start_grammars()
        result = StepResult(outputs=self.take_pending())
        batch = self.scheduler.schedule()
        if batch.is_empty() and self._grammar is not None:
            self._grammar.wait(GRAMMAR_WAIT_S)  # nothing else to run: no busy loop meanwhile
        result.scheduled = dict(batch.num_tokens)
        result.preempted = list(batch.preempted)
        now = time.monotonic()
        for req in batch.requests:
            if req.scheduled_time is None:
                req.scheduled_time = now
                self.metrics.scheduled(req, now)
        phases.lap("schedule")
        if not batch.is_empty():
            rows = [self._row(req, batch.num_tokens[req.request_id]) for req in batch.requests]
            out = self.runner.execute(rows)  # laps inputs, forward, logits, sample
            if self.scheduler.budget is not None and self.runner.device.type == "cuda":
                torch.cuda.synchronize(self.runner.device)  # a partial prefill returns unsynced
            for i, entries in out.prompt_logprobs.items():
                kept = batch.requests[i].prompt_logprobs
                if kept is None:  # only a row with a span (needs_prompt_logprobs) gets entries
                    raise RuntimeError(f"{batch.requests[i]!r}: prompt logprobs it never asked for")
                kept.extend(entries)
            self.scheduler.update_after_step(batch)
            now = time.monotonic()
            k = 0  # the step's samples, rows in order (a forking prefill has n)
            for req, row in zip(batch.requests, rows, strict=True):
                m = len(row.samples)
                if m:
                    first = req.first_token_time is None
                    for j in range(m):
                        self.metrics.sampled(req, first and j == 0, now)
                    outs = self._sampled(req, out.tokens[k : k + m], out.logprobs[k : k + m], now)
                    self._put(result.outputs, outs)
                    k += m
                    if self.token_times is not None:  # the row's own token (forks aside)
                        self.token_times.sampled(req.request_id, req.num_output_tokens - 1)
            result.outputs = finished_last(result.outputs)
            phases.lap("outputs")
        elif self.scheduler.tier is not None:
            self.scheduler.tier.wait_any(TIER_IDLE_WAIT_S)  # only loads left: do not spin
        result.kv_events = self.take_kv_events()
        self.record_state(len(batch.preempted))
        end = phases.lap("kv")  # the phases add up to end - step_start
        if self.token_times is not None:
            self.token_times.step_ended(time.monotonic())
        if not batch.is_empty():  # the whole step, scheduling and outputs too: what ITL sees
            gap = None if self._went_on_from is None else step_start - self._went_on_from
            self.scheduler.observe(batch, end - step_start, gap)
            self.metrics.stepped(end - step_start, phases.seconds, gap)
        # With requests left the caller steps again at once: the time until then is a gap
        # every running decode waits too (the engine loop's dispatch and calls).
        self._went_on_from = end if self.has_unfinished() else None
        return result

    def record_state(self, preempted: int = 0) -> None:
        """Set the running/waiting/KV-usage gauges from the scheduler's state now (after each
        step, and on the loop's idle ticks) and count `preempted` preemptions."""
        running = len(self.scheduler.running)
        waiting = len(self.scheduler.requests) - running  # queued, preempted, remote KV
        self.metrics.state(running, waiting, self.pool.usage(), preempted)

    def _start_grammars(self) -> None:
        """Requests whose grammar compiled since the last step: their matcher replays the
        tokens generated so far (elsewhere, before a move), then they may run."""
        if self._grammar is None:
            return
        for rid, error in self._grammar.take_compiled():
            req = self.scheduler.requests.get(rid)
            if req is None:
                self._grammar.remove(rid)
                continue
            if error is None and req.status != RequestStatus.WAITING_FOR_GRAMMAR:
                continue  # waiting for its KV: it runs once that arrives
            status = None
            try:
                if error is None and self._grammar.sync(rid, req.generated_token_ids):
                    status = RequestStatus.FINISHED_STOPPED
            except GrammarRejected as exc:
                error = str(exc)
            if error is not None:
                req.error, status = error, RequestStatus.FINISHED_ERROR
            if status is None:
                self.scheduler.release(req)
            else:
                self._put(self._pending, self._finish(req, status))

    def _row(self, req: Request, n: int) -> BatchRow:
        samples: tuple[SampleRequest, ...] = ()
        if req.num_computed_tokens + n == req.num_tokens:
            first = self._sample_request(req)
            seed = self._seeds[req.request_id]
            samples = (first,) + tuple(  # the choices that fork off at this sample
                SampleRequest(
                    first.params,
                    choice_seed(seed, req.params.n - req.num_pending_forks + i),
                    first.position,
                    first.token_ids,
                    first.num_output_tokens,
                    first.min_tokens_mask,
                    first.bitmask,
                )
                for i in range(req.num_pending_forks)
            )
        span = None
        if req.needs_prompt_logprobs:
            kept, top_n = req.prompt_logprobs, req.params.prompt_logprobs
            if kept is None or top_n is None:  # both set whenever it needs prompt logprobs
                raise RuntimeError(f"{req!r}: needs prompt logprobs but has no list for them")
            lo = len(kept)
            if lo < req.num_computed_tokens + 1:
                raise RuntimeError(f"{req!r}: prompt logprobs from {lo} are missing")
            hi = min(req.num_computed_tokens + n, req.num_prompt_tokens - 1) + 1
            if lo < hi:
                span = PromptLogprobsSpan(lo, hi, top_n)
        return BatchRow(
            req.token_ids,
            req.num_computed_tokens,
            n,
            self.kv.block_ids(req.request_id),
            samples,
            span,
        )

    def _sample_request(self, req: Request) -> SampleRequest:
        """What the sampler needs of req's next token (its logits processors' inputs)."""
        p = req.params
        generated = req.num_output_tokens + p.num_prior_output_tokens
        mask: frozenset[int] = frozenset()
        if generated < p.min_tokens:
            mask = frozenset(p.stop_token_ids) | (
                frozenset() if p.ignore_eos else frozenset(self.eos_token_ids)
            )
        bitmask = None
        grammar = self._grammar
        if grammar is not None and grammar.is_constrained(req.request_id):
            self.phases.lap("inputs")
            bitmask = grammar.bitmask(req.request_id, req.generated_token_ids)
            self.phases.lap("grammar")
        return SampleRequest(
            p,
            self._seeds[req.request_id],
            req.num_tokens,
            token_ids=tuple(req.token_ids) if p.has_penalties else (),
            num_output_tokens=generated,
            min_tokens_mask=mask,
            bitmask=bitmask,
        )
