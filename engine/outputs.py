"""What the engine hands back: per-step results and finished completions."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.block_pool import KVEvent
from engine.sampler import TokenLogprobs


@dataclass(slots=True)
class RequestOutput:
    """A request's progress in one step: the tokens one of its choices gained.

    With n > 1 each choice (`index`) has its own outputs: finish_reason is set on the output
    that ends that choice, and `finished` only on the request's last output (every choice
    done). With n == 1 the two coincide.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    num_cached_tokens: int
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    logprobs: list[TokenLogprobs] | None = None  # one per new token (raw model log-softmax)
    error: str | None = None
    index: int = 0  # the choice (0 when n == 1)
    # On the first output of choice 0 only: one entry per prompt token (None for the first).
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def merged(self, later: RequestOutput) -> RequestOutput:
        """This output followed by a later one of the same request (e.g. within one step)."""
        logprobs = (self.logprobs or []) + (later.logprobs or [])
        return RequestOutput(
            self.request_id,
            self.new_token_ids + later.new_token_ids,
            self.new_text + later.new_text,
            later.num_cached_tokens,
            later.finished,
            later.finish_reason,
            later.stop_reason,
            logprobs or None,
            later.error,
            self.index,
            self.prompt_logprobs or later.prompt_logprobs,
        )


@dataclass(slots=True)
class StepResult:
    """One engine step: tokens scheduled per request, new outputs, KV events."""

    scheduled: dict[str, int] = field(default_factory=dict)
    outputs: dict[str, RequestOutput] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)
    kv_events: list[KVEvent] = field(default_factory=list)


@dataclass(slots=True)
class CompletionOutput:
    """A finished request as the offline LLM API returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_cached_tokens: int
    ttft: float  # seconds from arrival to the first token
    latency: float  # seconds from arrival to the last token
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None
    index: int = 0  # the choice of the request (LLM.generate returns n per prompt)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
