"""LLMEngine: add requests, step, stream outputs; one process, one model, paged KV."""

from __future__ import annotations

import random
import time
from typing import NamedTuple

import torch

from engine.block_pool import BlockPool, KVEvent
from engine.chunk_budget import ChunkBudget
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import (
    CapacityError,
    InvalidRequestError,
    NoFreeBlocksError,
    PromptTooLongError,
)
from engine.grammar import GrammarManager, GrammarRejected
from engine.kv_cache_manager import KVCacheManager
from engine.metrics import EngineMetrics
from engine.model_runner import BatchRow, ModelRunner
from engine.outputs import RequestOutput, StepResult
from engine.request import FINISH_REASONS, Request, RequestStatus
from engine.sampler import SampleRequest
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.step_model import find_step_model, profile_key
from engine.tokenizer import eos_token_ids, load_tokenizer

GRAMMAR_WAIT_S = 0.005  # an empty step waits this long for a compiling grammar


class HeldBlocks(NamedTuple):
    """A prefilled request's blocks, held for its transfer until release_held()."""

    since: float  # monotonic time its prefill ended
    block_ids: tuple[int, ...]  # fixed while held


class LLMEngine:
    """The engine step loop: schedule, run the model, process outputs."""

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
        self.pool = BlockPool(self.runner.num_blocks, self.config.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool, self.config.block_size, self.config.hash_seed)
        self.metrics = EngineMetrics()  # this engine's own registry (engine/metrics.py)
        self.scheduler = Scheduler(
            SchedulerConfig(
                self.config.max_num_batched_tokens,
                self.config.chunk_size,
                self.config.max_num_seqs,
            ),
            self.kv,
            self._chunk_budget(),
        )
        self._rng = random.Random(self.config.seed)
        self._seeds: dict[str, int] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._pending: dict[str, RequestOutput] = {}  # outputs produced outside step()
        # prefilled request id -> its hold (prefill role); the prefill worker's sender thread
        # reads the block ids without waiting for a step to end
        self._held: dict[str, HeldBlocks] = {}
        self._went_on_from: float | None = None  # end of the last step, if work was left
        self._grammar: GrammarManager | None = None  # made at the first structured request

    @property
    def grammar(self) -> GrammarManager:
        """Structured outputs' compiler and matchers (one TokenizerInfo per engine)."""
        if self._grammar is None:
            self._grammar = GrammarManager(
                self.tokenizer, self.runner.model.args.vocab_size, self.eos_token_ids
            )
        return self._grammar

    def _chunk_budget(self) -> ChunkBudget | None:
        """Dynamic chunking's budget when itl_target_ms is set (engine/chunk_budget.py)."""
        if self.config.itl_target_ms is None:
            return None
        try:
            model = find_step_model(self.config.step_profile, self.step_profile_key())
        except (OSError, ValueError) as exc:
            raise InvalidRequestError(f"step_profile: {exc}") from exc
        return ChunkBudget(
            model,
            self.config.itl_target_ms / 1000,
            self.config.block_size,
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
    ) -> Request:
        """Queue a tokenized prompt; raises InvalidRequestError/CapacityError on bad input.

        seed overrides the sampling seed (a request moved between engines keeps its seed).
        prefill_only: finish after the first token and hold the blocks until release_held().
        """
        req = self._new_request(
            request_id, prompt_token_ids, params, cache_salt, arrival_time, seed, prefill_only
        )
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
        if (
            request_id in self.scheduler.requests
            or request_id in self._pending
            or request_id in self._held
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
        if params.n > min(self.config.max_n, self.config.max_num_seqs):
            raise InvalidRequestError(
                f"sampling.n={params.n} is invalid: this engine allows at most "
                f"{min(self.config.max_n, self.config.max_num_seqs)} choices per request "
                "(engine options max_n, max_num_seqs)"
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
        detok = IncrementalDetokenizer(
            self.tokenizer, params.stop, params.include_stop_str_in_output
        )
        if params.num_prior_output_tokens:
            detok.prime(req.prompt_token_ids[n - params.num_prior_output_tokens :])
        self._detok[request_id] = detok
        return req

    def seed_of(self, request_id: str) -> int:
        """The effective sampling seed of a live request (to continue it elsewhere)."""
        return self._seeds[request_id]

    # ---- disaggregation: the prefill side --------------------------------------------------
    def held_block_ids(self, request_id: str) -> list[int]:
        """Block ids a prefilled request holds for its transfer. Safe from any thread (one
        dict lookup of ids fixed when its prefill ended): the sender need not wait for the
        step in flight, which on a busy prefill worker is a whole prefill step."""
        held = self._held.get(request_id)
        if held is None:
            raise KeyError(f"request {request_id!r} holds no blocks")
        return list(held.block_ids)

    def release_held(self, request_id: str) -> bool:
        """Free a prefilled request's blocks (they stay in the prefix cache)."""
        if self._held.pop(request_id, None) is None:
            return False
        self.kv.free_table(request_id)
        return True

    def held_since(self, request_id: str) -> float | None:
        """Monotonic time a prefilled request's blocks were put on hold (its prefill ended),
        or None if it holds none."""
        held = self._held.get(request_id)
        return None if held is None else held.since

    def held_requests(self) -> dict[str, float]:
        """Prefilled request id -> monotonic time its blocks were put on hold."""
        return {rid: held.since for rid, held in self._held.items()}

    # ---- disaggregation: the decode side ---------------------------------------------------
    def reserve_remote(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> tuple[list[int], int]:
        """Reserve blocks for a prompt whose KV will arrive from a prefill engine.

        Reuses this engine's own cached prefix. Returns (block ids of the whole prompt,
        number of leading blocks already present); the rest must be received.
        Raises NoFreeBlocksError when the blocks are not free now.
        """
        req = self._new_request(
            request_id, prompt_token_ids, params, cache_salt, arrival_time, seed, False
        )
        hits = self.kv.get_computed_blocks(req)
        req.num_computed_tokens = len(hits) * self.config.block_size
        if not self.kv.allocate_slots(req, req.num_tokens - req.num_computed_tokens, hits):
            self._forget(request_id)
            raise NoFreeBlocksError(
                f"not enough free KV blocks for {req.num_tokens} tokens "
                f"({self.pool.num_free_blocks} free)"
            )
        req.num_cached_tokens = req.num_computed_tokens
        self.scheduler.add_remote(req)
        if params.structured_output is not None:  # compiles while the KV is on its way
            self.grammar.submit(request_id, params.structured_output)
        self.metrics.prefix_cache(req.num_prompt_tokens, req.num_cached_tokens)
        return self.kv.block_ids(request_id), len(hits)

    def complete_remote(self, request_id: str, first_token: int) -> None:
        """The prompt KV has been written into this engine's cache: start decoding."""
        req = self._remote(request_id)
        req.num_computed_tokens = req.num_tokens
        self.kv.cache_blocks(req, req.num_computed_tokens)
        if self._grammar is not None and self._grammar.is_constrained(request_id):
            if self._grammar.is_ready(request_id):
                self.scheduler.activate_remote(req)
            else:  # runs once its grammar is compiled (and has replayed the first token)
                self.scheduler.hold(req)
        else:
            self.scheduler.activate_remote(req)
        now = time.monotonic()
        req.scheduled_time = now  # joins the batch now; its queue and prefill were elsewhere
        self._pending[request_id] = self._append_token(req, int(first_token), None, now)

    def fail_remote(self, request_id: str, error: str) -> None:
        """The KV never arrived: free the reservation and report the error."""
        req = self._remote(request_id)
        req.error = error
        self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
        self._pending[request_id] = self._final_output(req, [], "")

    def _remote(self, request_id: str) -> Request:
        req = self.scheduler.requests.get(request_id)
        if req is None or req.status != RequestStatus.WAITING_FOR_REMOTE_KV:
            raise KeyError(f"request {request_id!r} is not waiting for remote KV")
        return req

    def _forget(self, request_id: str) -> None:
        self._seeds.pop(request_id, None)
        self._detok.pop(request_id, None)
        if self._grammar is not None:
            self._grammar.remove(request_id)
        self.kv.free_table(request_id)

    @property
    def kv_caches(self):
        """Per-layer KV tensors [2, num_blocks, block_size, num_kv_heads, head_dim]."""
        return self.runner.kv_caches

    def abort(self, request_id: str) -> bool:
        """Finish a request now and free its blocks; False if it is unknown or done."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return self.release_held(request_id)
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        self._pending[request_id] = self._final_output(req, [], "")
        return True

    def fail_all(self, error: str) -> None:
        """Finish every request with `error` (outputs queued for the next step/take_pending)."""
        for req in list(self.scheduler.requests.values()):
            req.error = error
            self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
            self._pending[req.request_id] = self._final_output(req, [], "")
        for rid in list(self._held):
            self.release_held(rid)

    def take_pending(self) -> dict[str, RequestOutput]:
        """Outputs produced outside step() (aborts, failures, remote completions)."""
        pending, self._pending = self._pending, {}
        return pending

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
        stray = set(self.kv.table_ids()) - set(self.scheduler.requests) - set(self._held)
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
        return self.pool.take_events()

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> StepResult:
        """Schedule one batch, run it, and return what each request gained."""
        step_start = time.perf_counter()
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
        if not batch.is_empty():
            rows = [self._row(req, batch.num_tokens[req.request_id]) for req in batch.requests]
            tokens, logprobs = self.runner.execute(rows)
            if self.scheduler.budget is not None and self.runner.device.type == "cuda":
                torch.cuda.synchronize(self.runner.device)  # a partial prefill returns unsynced
            sampled = self.scheduler.update_after_step(batch)
            now = time.monotonic()
            for req, token, lp in zip(sampled, tokens, logprobs, strict=True):
                self.metrics.sampled(req, req.first_token_time is None, now)
                out = self._append_token(req, token, lp, now)
                earlier = result.outputs.get(req.request_id)
                result.outputs[req.request_id] = earlier.merged(out) if earlier else out
        result.kv_events = self.pool.take_events()
        self.record_state(len(batch.preempted))
        end = time.perf_counter()
        if not batch.is_empty():  # the whole step, scheduling and outputs too: what ITL sees
            gap = None if self._went_on_from is None else step_start - self._went_on_from
            self.scheduler.observe(batch, end - step_start, gap)
            self.metrics.stepped(end - step_start)
        # With requests left the caller steps again at once: the time until then is a gap
        # every running decode waits too (the engine loop's dispatch and calls).
        self._went_on_from = end if self.has_unfinished() else None
        return result

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
                continue
            self.scheduler.finish(req, status)
            self._pending[rid] = self._final_output(req, [], "")

    def record_state(self, preempted: int = 0) -> None:
        """Set the running/waiting/KV-usage gauges from the scheduler's state now (after each
        step, and on the loop's idle ticks) and count `preempted` preemptions."""
        running = len(self.scheduler.running)
        waiting = len(self.scheduler.requests) - running  # queued, preempted, remote KV
        self.metrics.state(running, waiting, self.pool.usage(), preempted)

    def _row(self, req: Request, n: int) -> BatchRow:
        samples = req.num_computed_tokens + n == req.num_tokens
        sample = self._sample_request(req) if samples else None
        return BatchRow(
            req.token_ids, req.num_computed_tokens, n, self.kv.block_ids(req.request_id), sample
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
        if self._grammar is not None and self._grammar.is_constrained(req.request_id):
            bitmask = self._grammar.bitmask(req.request_id, req.generated_token_ids)
        return SampleRequest(
            p,
            self._seeds[req.request_id],
            req.num_tokens,
            token_ids=tuple(req.token_ids) if p.has_penalties else (),
            num_output_tokens=generated,
            min_tokens_mask=mask,
            bitmask=bitmask,
        )

    def _append_token(self, req: Request, token: int, logprob, now: float) -> RequestOutput:
        req.token_ids.append(token)
        if req.first_token_time is None:
            req.first_token_time = now
        text, stop_str = self._detok[req.request_id].add([token])
        status = self._stop_status(req, token, stop_str)
        if self._grammar is not None and self._grammar.is_ready(req.request_id):
            try:  # the grammar ending (its stop token accepted) stops the request
                if self._grammar.sync(req.request_id, req.generated_token_ids):
                    status = RequestStatus.FINISHED_STOPPED
            except GrammarRejected as exc:
                req.error, status = str(exc), RequestStatus.FINISHED_ERROR
        if req.prefill_only:
            status = RequestStatus.FINISHED_PREFILLED
            self._held[req.request_id] = HeldBlocks(now, tuple(self.kv.block_ids(req.request_id)))
        if status is None:
            return RequestOutput(
                req.request_id,
                [token],
                text,
                req.num_cached_tokens or 0,
                logprobs=[logprob] if logprob else None,
            )
        if status == RequestStatus.FINISHED_STOPPED:
            req.stop_reason = stop_str if stop_str is not None else token
        self.scheduler.finish(req, status, free_blocks=not req.prefill_only)
        self.metrics.finished(req, now)
        out = self._final_output(req, [token], text)
        out.logprobs = [logprob] if logprob else None
        return out

    def _stop_status(self, req: Request, token: int, stop_str: str | None) -> RequestStatus | None:
        p = req.params
        if stop_str is not None or token in p.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if not p.ignore_eos and token in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if (
            req.num_output_tokens + p.num_prior_output_tokens >= p.max_tokens
            or req.num_tokens >= self.max_model_len
        ):
            return RequestStatus.FINISHED_LENGTH
        return None

    def _final_output(self, req: Request, tokens: list[int], text: str) -> RequestOutput:
        self._seeds.pop(req.request_id, None)
        self._detok.pop(req.request_id, None)
        if self._grammar is not None:
            self._grammar.remove(req.request_id)
        return RequestOutput(
            req.request_id,
            tokens,
            text,
            req.num_cached_tokens or 0,
            finished=True,
            finish_reason=FINISH_REASONS[req.status],
            stop_reason=req.stop_reason,
            error=req.error,
        )
