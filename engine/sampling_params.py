"""SamplingParams: how one request's tokens are chosen and when it stops."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError
from engine.structured_output import StructuredOutput

MAX_LOGPROBS = 20  # most top-n alternatives per token (logprobs, prompt_logprobs)
MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling settings; validated on construction.

    temperature == 0 means greedy. With `seed` set, the token drawn at each position
    depends only on (seed, choice index, position, logits), never on the batch the request
    runs in. Penalties, logit_bias and min_tokens change the logits before temperature,
    top-k, top-p and min-p (and before the argmax of greedy); logprobs are always the model's
    raw log-softmax.
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
    # They count as generated tokens for presence/frequency penalties, min_tokens and the
    # structured-output matcher, so the continuation goes on exactly as the uninterrupted run.
    num_prior_output_tokens: int = 0
    # OpenAI semantics, over the generated tokens: logits[t] -= presence * (count[t] > 0)
    # + frequency * count[t].
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Hugging Face semantics, over prompt + generated tokens: a seen token's logit is divided
    # by it when positive, multiplied by it when negative.
    repetition_penalty: float = 1.0
    # (token id, bias added to its logit), sorted by id; a dict {id or "id": bias} is accepted.
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens
    prompt_logprobs: int | None = None  # top-n per prompt token (the first has none)
    n: int = 1  # choices generated from one prefill (the engine bounds it: option max_n)
    structured_output: StructuredOutput | None = None  # a dict of its fields is accepted

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if self.structured_output is not None:
            object.__setattr__(
                self, "structured_output", StructuredOutput.of(self.structured_output)
            )
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, value: object, allowed: str) -> InvalidRequestError:
            return InvalidRequestError(f"sampling.{name}={value!r} is invalid: {allowed}")

        def integer(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        def number(value: object) -> bool:
            return isinstance(value, int | float) and not isinstance(value, bool)

        if not integer(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", self.max_tokens, "must be an integer >= 1")
        if not (self.temperature >= 0.0):
            raise bad("temperature", self.temperature, "must be >= 0 (0 means greedy)")
        if not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", self.top_k, "must be 0/-1 (disabled) or a positive integer")
        if not (0.0 <= self.min_p <= 1.0):
            raise bad("min_p", self.min_p, "must be in [0, 1]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not integer(value) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, value, f"must be an integer between 0 and {MAX_LOGPROBS}")
        if any(not s for s in self.stop):
            raise bad("stop", self.stop, "stop strings must be non-empty")
        if not integer(self.num_prior_output_tokens) or not (
            0 <= self.num_prior_output_tokens < self.max_tokens
        ):
            raise bad(
                "num_prior_output_tokens",
                self.num_prior_output_tokens,
                "must be an integer in [0, max_tokens)",
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "token ids must be >= 0")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not number(value) or not -2.0 <= value <= 2.0:
                raise bad(name, value, "must be a number in [-2, 2]")
        rep = self.repetition_penalty
        if not number(rep) or not (0.0 < rep < math.inf):
            raise bad("repetition_penalty", rep, "must be a number > 0 (1 means none)")
        if not integer(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", self.min_tokens, "must be an integer in [0, max_tokens]")
        if not integer(self.n) or self.n < 1:
            raise bad("n", self.n, "must be an integer >= 1")
        if self.n > 1 and self.num_prior_output_tokens:
            raise bad(
                "n",
                self.n,
                "must be 1 with num_prior_output_tokens (continue each choice as its own "
                "request, seeded with engine.sampler.choice_seed(seed, index))",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether any penalty changes the logits."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def validate_vocab(self, vocab_size: int) -> None:
        """Raise InvalidRequestError unless every token id this names is < vocab_size."""
        bad_ids = [t for t, _ in self.logit_bias if t >= vocab_size]
        if bad_ids:
            raise InvalidRequestError(
                f"sampling.logit_bias names token ids outside the vocabulary "
                f"[0, {vocab_size}): {bad_ids[:5]}"
            )


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """{id or "id": bias} or [(id, bias), ...] -> ((id, bias), ...) sorted by id, checked."""
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, list | tuple) and all(
        isinstance(p, list | tuple) and len(p) == 2 for p in value
    ):
        items = [tuple(p) for p in value]
    else:
        raise InvalidRequestError(
            f"sampling.logit_bias must map token ids to biases, got {type(value).__name__}"
        )
    out: dict[int, float] = {}
    for key, bias in items:
        try:
            token = int(key) if not isinstance(key, bool | float) else None
        except (TypeError, ValueError):
            token = None
        if token is None or token < 0:
            raise InvalidRequestError(f"sampling.logit_bias key {key!r} is not a token id")
        if (
            isinstance(bias, bool)
            or not isinstance(bias, int | float)
            or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS
        ):
            raise InvalidRequestError(
                f"sampling.logit_bias[{key!r}]={bias!r} is invalid: must be a number in "
                f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
            )
        out[token] = float(bias)
    return tuple(sorted(out.items()))
