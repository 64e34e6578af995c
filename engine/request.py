"""Request: one sequence's state as it moves through the scheduler."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from engine.block_hash import BlockHash
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.retention import Retention
    from engine.sampler import TokenLogprobs


class RequestStatus(enum.IntEnum):
    """Ordered: everything above RUNNING is finished."""

    WAITING = 0
    WAITING_FOR_REMOTE_KV = 1
    WAITING_FOR_TIER_KV = 2  # its prefix blocks are loading from the KV tier (engine/kv_tier)
    WAITING_FOR_GRAMMAR = 3  # its structured-output grammar is compiling: not schedulable yet
    PREEMPTED = 4
    RUNNING = 5
    FINISHED_STOPPED = 6
    FINISHED_LENGTH = 7
    FINISHED_ABORTED = 8
    FINISHED_ERROR = 9
    FINISHED_PREFILLED = 10  # prefill role: prompt done, first token sampled, KV held for transfer

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
    RequestStatus.FINISHED_PREFILLED: "prefilled",
}


class Request:
    """A prompt plus the tokens generated so far: one sequence (one choice of a request).

    Invariant: num_computed_tokens <= num_tokens; the KV of token i is in the cache
    exactly when i < num_computed_tokens.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        prefill_only: bool = False,
        retention: Retention | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + output
        self.params = params
        self.cache_salt = cache_salt
        self.retention = retention  # its session's blocks outlast others once it finished
        self.prefill_only = prefill_only  # finish after the first token, keeping the blocks
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.scheduled_time: float | None = None  # first scheduled (monotonic)
        self.first_token_time: float | None = None
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens: int | None = None  # prefix-cache hit, set when first scheduled
        self.num_preemptions = 0
        self.block_hashes: list[BlockHash] = []  # hashes of full blocks of token_ids
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        # Choices (sampling n): choice `index` of the request `parent_id` (its own id for
        # choice 0). Choice 0 prefills; the other n - 1 fork off it at its first sample.
        self.parent_id = request_id
        self.index = 0
        self.num_pending_forks = params.n - 1
        # Prompt logprobs computed so far, by token index (None for the first token); None
        # when not asked for, or once handed out with the first token.
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        if params.prompt_logprobs is not None and not params.num_prior_output_tokens:
            self.prompt_logprobs = [None]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether some prompt token's logprob is still to be computed (such a request does
        not read the prefix cache for its prompt: a cached position has no logits)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(
            self.prompt_token_ids
        )

    @property
    def generated_token_ids(self) -> list[int]:
        """Every token this request generated: a migrated request's earlier output (the
        prompt's tail, params.num_prior_output_tokens) and its output here."""
        return self.token_ids[len(self.prompt_token_ids) - self.params.num_prior_output_tokens :]

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
