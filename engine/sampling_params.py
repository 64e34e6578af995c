"""SamplingParams: how one request's tokens are chosen and when it stops."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling settings; validated on construction.

    temperature == 0 means greedy. With `seed` set, the token drawn at each position
    depends only on (seed, position, logits), never on the batch the request runs in.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token (0: sampled only)
    include_stop_str_in_output: bool = False
    # A migrated request's continuation: the last this-many prompt tokens are its own earlier
    # output. They count towards max_tokens and prime the detokenizer (text and stop strings
    # continue across the move); the sampling position is the token's absolute index either way.
    num_prior_output_tokens: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, value: object, allowed: str) -> InvalidRequestError:
            return InvalidRequestError(f"sampling.{name}={value!r} is invalid: {allowed}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", self.max_tokens, "must be an integer >= 1")
        if not (self.temperature >= 0.0):
            raise bad("temperature", self.temperature, "must be >= 0 (0 means greedy)")
        if not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", self.top_k, "must be 0/-1 (disabled) or a positive integer")
        if not (0.0 <= self.min_p <= 1.0):
            raise bad("min_p", self.min_p, "must be in [0, 1]")
        if self.logprobs is not None and (self.logprobs < 0 or self.logprobs > 20):
            raise bad("logprobs", self.logprobs, "must be between 0 and 20")
        if any(not s for s in self.stop):
            raise bad("stop", self.stop, "stop strings must be non-empty")
        if not isinstance(self.num_prior_output_tokens, int) or not (
            0 <= self.num_prior_output_tokens < self.max_tokens
        ):
            raise bad(
                "num_prior_output_tokens",
                self.num_prior_output_tokens,
                "must be an integer in [0, max_tokens)",
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "token ids must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
