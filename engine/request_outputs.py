"""How sampled tokens become outputs (mixed into LLMEngine; it uses the engine's scheduler,
KV cache manager, runner, detokenizers, seeds and grammar matchers).

A token is appended to its choice, detokenized and checked: stop strings and tokens, EOS,
the grammar's end, max_tokens and max_model_len. A request with n choices forks the n - 1
others off choice 0 at its first sample. Each choice ends on its own (its output carries the
finish_reason); the request's last output, once every choice ended, has finished=True.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.choices import choice_id
from engine.disaggregation import HeldBlocks
from engine.errors import GrammarRejected
from engine.outputs import RequestOutput
from engine.request import FINISH_REASONS, Request, RequestStatus
from engine.sampler import TokenLogprobs, choice_seed

if TYPE_CHECKING:
    from engine.choices import ChoiceGroup
    from engine.detokenizer import IncrementalDetokenizer
    from engine.grammar import GrammarManager
    from engine.kv_cache_manager import KVCacheManager
    from engine.metrics import EngineMetrics
    from engine.model_runner import ModelRunner
    from engine.sampling_params import SamplingParams
    from engine.scheduler import Scheduler


class RequestOutputs:
    """Appending tokens, finishing choices and forking them, for LLMEngine."""

    if TYPE_CHECKING:  # what they use of LLMEngine
        kv: KVCacheManager
        runner: ModelRunner
        scheduler: Scheduler
        metrics: EngineMetrics
        eos_token_ids: set[int]
        max_model_len: int
        _seeds: dict[str, int]
        _detok: dict[str, IncrementalDetokenizer]
        _groups: dict[str, ChoiceGroup]
        _held: dict[str, HeldBlocks]
        _grammar: GrammarManager | None

        def _constrained(self, request_id: str) -> bool: ...
        def _detokenizer(self, params: SamplingParams) -> IncrementalDetokenizer: ...

    def _sampled(
        self,
        req: Request,
        tokens: list[int],
        logprobs: list[TokenLogprobs | None],
        now: float,
    ) -> list[RequestOutput]:
        """req drew `tokens`: its own next token, then (its first sample, n > 1) the first
        tokens of the choices that fork off it. Returns the outputs they make."""
        outs: list[RequestOutput] = []
        start = req.params.n - req.num_pending_forks
        forks = list(zip(range(start, req.params.n), tokens[1:], logprobs[1:], strict=True))
        req.num_pending_forks = 0
        for index, token, lp in forks:  # before req's own token, which may finish and free it
            if req.prefill_only:  # a prefill engine only hands the first tokens on
                out = RequestOutput(
                    req.parent_id,
                    [token],
                    "",
                    req.num_cached_tokens or 0,
                    finish_reason=FINISH_REASONS[RequestStatus.FINISHED_PREFILLED],
                    logprobs=[lp] if lp else None,
                    index=index,
                )
                self._choice_ended(out)
                outs.append(out)
            else:
                outs += self._append_token(self._fork(req, index), token, lp, now)
        return self._append_token(req, tokens[0], logprobs[0], now) + outs

    def _fork(self, parent: Request, index: int) -> Request:
        """Choice `index` of parent's request, forked off parent's computed prompt: its KV
        blocks shared (the partial last one copied), its own seed, detokenizer and matcher."""
        cid = choice_id(parent.parent_id, index)
        child = Request(
            cid,
            parent.prompt_token_ids,
            parent.params,
            arrival_time=parent.arrival_time,
            cache_salt=parent.cache_salt,
        )
        child.parent_id, child.index, child.num_pending_forks = parent.parent_id, index, 0
        child.retention = parent.retention
        child.prompt_logprobs = None  # choice 0 carries them
        child.scheduled_time = parent.scheduled_time
        child.first_token_time = parent.first_token_time
        child.num_cached_tokens = parent.num_cached_tokens
        child.block_hashes = list(parent.block_hashes)
        self._seeds[cid] = choice_seed(self._seeds[parent.request_id], index)
        self._detok[cid] = self._detokenizer(parent.params)
        grammar = self._grammar if self._constrained(parent.request_id) else None
        if grammar is not None:
            grammar.fork(parent.request_id, cid)
        copies = self.kv.fork(parent.request_id, cid, parent.num_computed_tokens)
        if copies is not None:
            self.runner.copy_blocks(copies)
            child.num_computed_tokens = parent.num_computed_tokens
        if grammar is not None and not grammar.is_ready(cid):
            self.scheduler.hold(child)  # replays its first token once the grammar compiled
        elif copies is None:  # no block free for its copy of the partial block: recompute
            self.scheduler.add(child)
        else:
            self.scheduler.add_forked(child)
        return child

    def _append_token(
        self, req: Request, token: int, logprob: TokenLogprobs | None, now: float
    ) -> list[RequestOutput]:
        """req gained `token`: its output, and whether that ends it (stop, length, the
        grammar's end, prefilled)."""
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
            ids = tuple(self.kv.block_ids(req.request_id))
            self._held[req.request_id] = HeldBlocks(now, ids, req.retention)
        prompt_logprobs = None
        if req.prompt_logprobs is not None and not req.needs_prompt_logprobs:
            prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, None
        if status is None:
            outs = [
                RequestOutput(
                    req.parent_id,
                    [token],
                    text,
                    req.num_cached_tokens or 0,
                    logprobs=[logprob] if logprob else None,
                    index=req.index,
                )
            ]
        else:
            if status == RequestStatus.FINISHED_STOPPED:
                req.stop_reason = stop_str if stop_str is not None else token
            outs = self._finish(req, status, [token], text)
            outs[0].logprobs = [logprob] if logprob else None
            self.metrics.finished(req, now)
        outs[0].prompt_logprobs = prompt_logprobs
        return outs

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

    def _finish(
        self, req: Request, status: RequestStatus, tokens: Sequence[int] = (), text: str = ""
    ) -> list[RequestOutput]:
        """End req (one choice) with `status`: its last output, then those of the choices
        that never forked off it (they end the same way). A prefilled request keeps its
        blocks (held for the transfer)."""
        self.scheduler.finish(req, status, free_blocks=status != RequestStatus.FINISHED_PREFILLED)
        self._seeds.pop(req.request_id, None)
        self._detok.pop(req.request_id, None)
        if self._grammar is not None:
            self._grammar.remove(req.request_id)
        reason = FINISH_REASONS[req.status]
        outs = [
            RequestOutput(
                req.parent_id,
                list(tokens),
                text,
                req.num_cached_tokens or 0,
                finish_reason=reason,
                stop_reason=req.stop_reason,
                error=req.error,
                index=req.index,
            )
        ]
        first_unforked = req.params.n - req.num_pending_forks
        outs += [
            RequestOutput(
                req.parent_id,
                [],
                "",
                req.num_cached_tokens or 0,
                finish_reason=reason,
                error=req.error,
                index=i,
            )
            for i in range(first_unforked, req.params.n)
        ]
        req.num_pending_forks = 0
        for out in outs:
            self._choice_ended(out)
        return outs

    def _choice_ended(self, out: RequestOutput) -> None:
        """out ends its choice: it is the request's last output once every choice ended."""
        group = self._groups.get(out.request_id)
        out.finished = group is None or group.finish(out.index)
        if group is not None and out.finished:
            del self._groups[out.request_id]

    @staticmethod
    def _put(outputs: dict[str, RequestOutput], outs: list[RequestOutput]) -> None:
        """Add outputs to a step's (or the pending) outputs, merging a choice's later ones."""
        for out in outs:
            key = choice_id(out.request_id, out.index)
            earlier = outputs.get(key)
            outputs[key] = earlier.merged(out) if earlier else out


def finished_last(outputs: dict[str, RequestOutput]) -> dict[str, RequestOutput]:
    """The same outputs, a request's last one (finished) after its other choices' (a
    reader stops at the finished one)."""
    return dict(sorted(outputs.items(), key=lambda item: item[1].finished))
