"""LLMEngine's hooks for disaggregation (mixed into LLMEngine; they use its scheduler, KV
cache manager and outputs).

Prefill side: a prefill_only request finishes after its first token(s) with its blocks held
(HeldBlocks) until the transfer is acknowledged. Decode side: blocks are reserved for a
prompt whose KV arrives from a prefill engine; once it has, the first token(s) the prefill
engine sampled join the running batch (n > 1: the choices fork off here), with the logprobs
and prompt logprobs the prefill engine computed.

With a KV tier the decode side's own prefix is its device hits followed by its tier hits: the
tier blocks load while the prefill engine computes, and only the blocks after them are sent.
A tier block that fails to load leaves a gap: the request then computes its prompt from the
gap on (the first token stays the prefill engine's), so its tokens are the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from engine.errors import InvalidRequestError, NoFreeBlocksError
from engine.request import Request, RequestStatus
from engine.retention import Retention
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.block_pool import BlockPool
    from engine.config import EngineConfig
    from engine.grammar import GrammarManager
    from engine.kv_cache_manager import KVCacheManager
    from engine.metrics import EngineMetrics
    from engine.outputs import RequestOutput
    from engine.scheduler import Scheduler

# How long complete_remote waits for a tier load still running when the remote KV arrived
# (loads from host memory or a local disk take far less than a prefill and its transfer);
# past it the load is stopped and the blocks it did not bring are computed.
REMOTE_TIER_WAIT_S = 5.0


class HeldBlocks(NamedTuple):
    """A prefilled request's blocks, held for its transfer until release_held()."""

    since: float  # monotonic time its prefill ended
    block_ids: tuple[int, ...]  # fixed while held
    retention: Retention | None = None  # the request's: applies when they are released


class DisaggregationHooks:
    """The prefill-side and decode-side methods of LLMEngine."""

    if TYPE_CHECKING:  # what they use of LLMEngine (and of RequestOutputs)
        config: EngineConfig
        pool: BlockPool
        kv: KVCacheManager
        scheduler: Scheduler
        metrics: EngineMetrics
        _held: dict[str, HeldBlocks]
        _pending: dict[str, RequestOutput]
        _grammar: GrammarManager | None
        remote_tier_wait_s: float

        def _check_retention(self, retention: Retention | None) -> None: ...
        @property
        def grammar(self) -> GrammarManager: ...
        def _new_request(
            self,
            request_id: str,
            prompt_token_ids: list[int],
            params: SamplingParams | None,
            cache_salt: str | None,
            arrival_time: float | None,
            seed: int | None,
            prefill_only: bool,
        ) -> Request: ...
        def _forget(self, request_id: str) -> None: ...

        # RequestOutputs._sampled(req, tokens, logprobs, now)
        _sampled: Callable[
            [Request, list[int], list[TokenLogprobs | None], float], list[RequestOutput]
        ]

        def _finish(
            self, req: Request, status: RequestStatus, tokens: Sequence[int] = (), text: str = ""
        ) -> list[RequestOutput]: ...
        @staticmethod
        def _put(outputs: dict[str, RequestOutput], outs: list[RequestOutput]) -> None: ...

    # ---- the prefill side ------------------------------------------------------------------
    def held_block_ids(self, request_id: str) -> list[int]:
        """Block ids a prefilled request holds for its transfer. Safe from any thread (one
        dict lookup of ids fixed when its prefill ended): the sender need not wait for the
        step in flight, which on a busy prefill worker is a whole prefill step."""
        held = self._held.get(request_id)
        if held is None:
            raise KeyError(f"request {request_id!r} holds no blocks")
        return list(held.block_ids)

    def release_held(self, request_id: str) -> bool:
        """Free a prefilled request's blocks (they stay in the prefix cache, retained for
        its session if it asked)."""
        held = self._held.pop(request_id, None)
        if held is None:
            return False
        self.kv.free_table(request_id, held.retention)
        return True

    def held_since(self, request_id: str) -> float | None:
        """Monotonic time a prefilled request's blocks were put on hold (its prefill ended),
        or None if it holds none."""
        held = self._held.get(request_id)
        return None if held is None else held.since

    def held_requests(self) -> dict[str, float]:
        """Prefilled request id -> monotonic time its blocks were put on hold."""
        return {rid: held.since for rid, held in self._held.items()}

    # ---- the decode side -------------------------------------------------------------------
    def reserve_remote(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int | None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        retention: Retention | None = None,
    ) -> tuple[list[int], int]:
        """Reserve blocks for a prompt whose KV will arrive from a prefill engine.

        Reuses this engine's own cached prefix: device hits, then KV tier hits (loaded into
        their blocks meanwhile). Returns (block ids of the whole prompt, number of leading
        blocks already present or loading); the rest must be received.
        Raises NoFreeBlocksError when the blocks are not free now.
        """
        self._check_retention(retention)
        req = self._new_request(
            request_id, prompt_token_ids, params, cache_salt, arrival_time, seed, False
        )
        req.retention = retention
        req.prompt_logprobs = None  # the prefill engine computes them (complete_remote)
        hits = self.kv.get_computed_blocks(req)
        tier = self.scheduler.tier
        n_tier = tier.num_hits(self.kv, req, len(hits)) if tier is not None else 0
        req.num_computed_tokens = len(hits) * self.config.block_size
        if not self.kv.allocate_slots(req, req.num_tokens - req.num_computed_tokens, hits):
            self._forget(request_id)
            raise NoFreeBlocksError(
                f"not enough free KV blocks for {req.num_tokens} tokens "
                f"({self.pool.num_free_blocks} free)"
            )
        if n_tier and tier is not None:
            tier.start_remote(self.kv, req, len(hits), n_tier)
        num_present = len(hits) + n_tier
        req.num_cached_tokens = num_present * self.config.block_size
        self.scheduler.add_remote(req)
        if params.structured_output is not None:  # compiles while the KV is on its way
            self.grammar.submit(request_id, params.structured_output)
        self.metrics.prefix_cache(req.num_prompt_tokens, req.num_cached_tokens)
        return self.kv.block_ids(request_id), num_present

    def num_tier_blocks(self, request_id: str) -> int:
        """Of a reservation's present blocks, how many are loading from the KV tier."""
        tier = self.scheduler.tier
        return 0 if tier is None else tier.num_remote_blocks(request_id)

    def complete_remote(
        self,
        request_id: str,
        first_tokens: int | Sequence[int],
        logprobs: Sequence[TokenLogprobs | None] | None = None,
        prompt_logprobs: list[TokenLogprobs | None] | None = None,
    ) -> None:
        """The prompt KV has been written into this engine's cache: start decoding.

        first_tokens: what the prefill engine sampled, one per choice (a bare int: n == 1);
        logprobs aligned with them; prompt_logprobs go on choice 0's first output.
        """
        req = self._remote(request_id)
        tokens = [int(first_tokens)] if isinstance(first_tokens, int) else list(first_tokens)
        if len(tokens) != req.params.n:
            raise InvalidRequestError(
                f"{len(tokens)} first tokens for a request with n={req.params.n} choices"
            )
        req.num_computed_tokens = self._remote_kv_tokens(req)
        self.kv.cache_blocks(req, req.num_computed_tokens)
        grammar = self._grammar
        if (
            grammar is not None
            and grammar.is_constrained(request_id)
            and not grammar.is_ready(request_id)
        ):
            self.scheduler.hold(req)  # runs once its grammar compiled and replayed the tokens
        else:
            self.scheduler.activate_remote(req)
        now = time.monotonic()
        req.scheduled_time = now  # joins the batch now; its queue and prefill were elsewhere
        outs = self._sampled(req, tokens, list(logprobs or [None] * len(tokens)), now)
        outs[0].prompt_logprobs = prompt_logprobs
        self._put(self._pending, outs)

    def _remote_kv_tokens(self, req: Request) -> int:
        """Leading prompt tokens whose KV is in place now that the remote KV arrived: all of
        them, unless the request's tier load brought fewer blocks than it was asked for (then
        those up to the first block it did not bring)."""
        tier = self.scheduler.tier
        taken = tier.take_remote(req, self.remote_tier_wait_s) if tier is not None else None
        if taken is None or taken[0] == taken[1]:
            return req.num_tokens
        present = req.num_computed_tokens + taken[0] * self.config.block_size
        req.num_cached_tokens = present
        return present

    def fail_remote(self, request_id: str, error: str) -> None:
        """The KV never arrived: free the reservation and report the error."""
        req = self._remote(request_id)
        req.error = error
        self._put(self._pending, self._finish(req, RequestStatus.FINISHED_ERROR))

    def _remote(self, request_id: str) -> Request:
        req = self.scheduler.requests.get(request_id)
        if req is None or req.status != RequestStatus.WAITING_FOR_REMOTE_KV:
            raise KeyError(f"request {request_id!r} is not waiting for remote KV")
        return req
