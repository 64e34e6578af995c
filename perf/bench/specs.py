"""What a benchmark workload is made of: request specs, the token space prompts are drawn from,
sessions (a conversation's turns, one at a time) and the reproducible random streams every
workload draws from (perf/bench/workloads.py, perf/bench/agent_workload.py)."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of a workload. arrival_s (seconds from the start) is set only where the
    workload owns time (trace replay); otherwise the driver's arrival process decides.
    think_s: the driver waits this long after the previous turn's answer before sending
    this turn (an agent's tool call or a user's reading time). session_id /
    retention_seconds: the router's session fields (router/sessions.py), None without."""

    session: str  # unique per run; the request id is f"{session}-{turn}"
    turn: int
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    kind: str = "chat"  # chat | turn | long | trace: lets reports mark e.g. long prompts
    tenant: str = ""
    cache_salt: str | None = None
    arrival_s: float | None = None
    think_s: float = 0.0
    session_id: str | None = None
    retention_seconds: float | None = None

    @property
    def request_id(self) -> str:
        return f"{self.session}-{self.turn}"


@dataclass(frozen=True, slots=True)
class TokenSpace:
    """Ids drawn uniformly from [low, high) minus `exclude` (special tokens)."""

    low: int = 100
    high: int = 49152  # SmolLM2's vocabulary
    exclude: frozenset[int] = frozenset()

    @classmethod
    def from_tokenizer(cls, tokenizer, low: int = 100) -> TokenSpace:
        """The tokenizer's vocabulary above `low`, without its special tokens."""
        special = frozenset(getattr(tokenizer, "all_special_ids", ()) or ())
        return cls(low=low, high=len(tokenizer), exclude=special)

    def draw(self, rng: random.Random, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            t = rng.randrange(self.low, self.high)
            if t not in self.exclude:
                out.append(t)
        return out


def rng_for(seed: int, *key: object) -> random.Random:
    """An independent, reproducible stream per (seed, key): str seeds hash with SHA-512."""
    return random.Random(":".join(map(str, (seed, *key))))


def around(rng: random.Random, mean: int, range_ratio: float) -> int:
    """A length uniform in [mean * (1 - r), mean * (1 + r)] (vLLM's range ratio), at least 1."""
    lo, hi = int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))
    return max(1, rng.randint(lo, max(lo, hi)))


def stand_in_answer(spec: RequestSpec, tokens: TokenSpace, seed: int = 0) -> list[int]:
    """A deterministic answer of exactly max_tokens tokens, for runs without a server."""
    return tokens.draw(rng_for(seed, "answer", spec.request_id), spec.max_tokens)


class Session(Protocol):
    """A sequence of turns; next_turn(answer to the previous turn, None at first) returns the
    next request, or None when the session is over. A multi-turn session also has `num_turns`
    (the driver claims that many requests of its budget when the session starts)."""

    def next_turn(self, previous_answer: Sequence[int] | None) -> RequestSpec | None: ...


_Spec = TypeVar("_Spec")  # RequestSpec; the simulator's trace sessions carry HashedSpecs


class OneShot(Generic[_Spec]):
    """A session of one request."""

    def __init__(self, spec: _Spec) -> None:
        self._spec: _Spec | None = spec

    def next_turn(self, previous_answer: Sequence[int] | None) -> _Spec | None:
        spec, self._spec = self._spec, None
        return spec


class Workload(Protocol):
    """Options as dataclass fields; sessions() is a deterministic (possibly endless) stream."""

    __dataclass_fields__: ClassVar[dict[str, Any]]  # a dataclass: asdict() gives its options

    def sessions(self, tokens: TokenSpace, seed: int) -> Iterator[Session]: ...
