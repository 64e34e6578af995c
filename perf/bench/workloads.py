"""Benchmark workloads: plain, deterministic generators of request specs, shared by `baton bench`
and the simulator.

A workload yields sessions; a session yields its turns one at a time through
`next_turn(previous_answer)`, so a multi-turn prompt can contain the answer the server really
gave. Single-turn workloads are sessions of one turn. Everything is token-level and depends only
on the seed and the options: the same seed gives the same prompts (and, with greedy decoding,
the same answers). `replay()` runs a workload with `stand_in_answer`s instead of a server, which
is the request sequence the simulator and the oracle cache see.

Token ids come from a `TokenSpace`: a range of the vocabulary, minus the tokenizer's special
tokens when a tokenizer is given, so that a random id never ends or restructures a prompt.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from perf.bench.agent_workload import AgentWorkload
from perf.bench.specs import (
    OneShot,
    RequestSpec,
    Session,
    TokenSpace,
    Workload,
    stand_in_answer,
)
from perf.bench.specs import around as _around
from perf.bench.specs import rng_for as _rng

__all__ = [
    "WORKLOADS",
    "AgentWorkload",
    "AgenticWorkload",
    "LongPromptWorkload",
    "OneShot",
    "PrefixRepetitionWorkload",
    "RandomWorkload",
    "RequestSpec",
    "Session",
    "SharedPrefixWorkload",
    "ShortPromptWorkload",
    "TokenSpace",
    "TraceWorkload",
    "Workload",
    "make_workload",
    "replay",
    "stand_in_answer",
]


# ---- single-turn workloads -------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RandomWorkload:
    """Independent random prompts: no two share a block."""

    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0

    def sessions(self, tokens: TokenSpace, seed: int) -> Iterator[Session]:
        for i in itertools.count():
            rng = _rng(seed, "random", i)
            n = _around(rng, self.input_len, self.range_ratio)
            prompt = tuple(tokens.draw(rng, n))
            yield OneShot(RequestSpec(f"r{i}", 0, prompt, self.output_len))


@dataclass(frozen=True, slots=True)
class PrefixRepetitionWorkload:
    """K shared prefixes x random suffixes. Each round of K requests uses every prefix once in
    a shuffled order, so any K consecutive requests share exactly K prefixes."""

    num_prefixes: int = 8
    prefix_len: int = 2048
    suffix_len: int = 256
    output_len: int = 128

    def sessions(self, tokens: TokenSpace, seed: int) -> Iterator[Session]:
        prefixes = [
            tuple(tokens.draw(_rng(seed, "prefix", k), self.prefix_len))
            for k in range(self.num_prefixes)
        ]
        i = 0
        for rnd in itertools.count():
            order = list(range(self.num_prefixes))
            _rng(seed, "round", rnd).shuffle(order)
            for k in order:
                suffix = tokens.draw(_rng(seed, "suffix", i), self.suffix_len)
                spec = RequestSpec(f"p{i}", 0, prefixes[k] + tuple(suffix), self.output_len)
                yield OneShot(replace(spec, tenant=f"prefix{k}"))
                i += 1


@dataclass(frozen=True, slots=True)
class SharedPrefixWorkload:
    """One system prompt shared by every request, then a short user turn of each request's
    own: a prefix cache's best case, the comparison with other servers' prompt caches."""

    system_len: int = 2000
    user_len: int = 64
    output_len: int = 64

    def sessions(self, tokens: TokenSpace, seed: int) -> Iterator[Session]:
        system = tuple(tokens.draw(_rng(seed, "system"), self.system_len))
        for i in itertools.count():
            user = tokens.draw(_rng(seed, "user", i), self.user_len)
            yield OneShot(RequestSpec(f"s{i}", 0, system + tuple(user), self.output_len))


@dataclass(frozen=True, slots=True)
class ShortPromptWorkload:
    """Short independent prompts (no shared prefix): the "random" workload's prompts with
    these lengths (the same seed gives the same ids)."""

    input_len: int = 256
    output_len: int = 64

    def sessions(self, tokens: TokenSpace, seed: int) -> Iterator[Session]:
        return RandomWorkload(self.input_len, self.output_len).sessions(tokens, seed)


@dataclass(frozen=True, slots=True)
class LongPromptWorkload:
    """Short interactive chats with a very long prompt every `long_every` requests (the first at
    request long_every // 2, mid-stream): the head-of-line blocking case. Defaults fit SmolLM2
    (8,192 positions); tests scale the lengths down."""

    chat_len: int = 256
    chat_output_len: int = 64
    long_min: int = 6000
    long_max: int = 8000
    long_output_len: int = 16
    long_every: int = 20

    def sessions(self, tokens: TokenSpace, seed: int) -> Iterator[Session]:
        for i in itertools.count():
            rng = _rng(seed, "long-prompt", i)
            if i % self.long_every == self.long_every // 2:
                n, out, kind = (
                    rng.randint(self.long_min, self.long_max),
                    self.long_output_len,
                    "long",
                )
            else:
                n, out, kind = _around(rng, self.chat_len, 0.5), self.chat_output_len, "chat"
            yield OneShot(RequestSpec(f"l{i}", 0, tuple(tokens.draw(rng, n)), out, kind=kind))


# ---- agentic multi-turn ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AgenticWorkload:
    """Many tenants, each with a long system prompt + tool schemas shared by its sessions;
    each session's prompt grows turn by turn (previous prompt + previous answer + new user
    turn) with short answers: the traffic prefix caching is for."""

    num_tenants: int = 8
    system_len: int = 1500  # the tenant's system prompt
    tools_len: int = 1500  # the tenant's tool schemas, after the system prompt
    user_len: int = 128  # mean tokens of a user turn (tool results, questions)
    min_turns: int = 2
    max_turns: int = 6
    output_len: int = 64

    def sessions(self, tokens: TokenSpace, seed: int) -> Iterator[Session]:
        prefixes: dict[int, tuple[int, ...]] = {}
        for i in itertools.count():
            rng = _rng(seed, "session", i)
            tenant = rng.randrange(self.num_tenants)
            if tenant not in prefixes:
                trng = _rng(seed, "tenant", tenant)
                system = tokens.draw(trng, self.system_len)
                prefixes[tenant] = tuple(system + tokens.draw(trng, self.tools_len))
            yield AgenticSession(self, tokens, rng, f"a{i}", f"tenant{tenant}", prefixes[tenant])


@dataclass
class AgenticSession:
    """One conversation: turn k's prompt = turn k-1's prompt + its answer + a new user turn."""

    workload: AgenticWorkload
    tokens: TokenSpace
    rng: random.Random
    session: str
    tenant: str
    prompt: tuple[int, ...]  # the shared prefix, then the history so far
    turn: int = 0
    num_turns: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_turns = self.rng.randint(self.workload.min_turns, self.workload.max_turns)

    def next_turn(self, previous_answer: Sequence[int] | None) -> RequestSpec | None:
        if self.turn >= self.num_turns:
            return None
        if self.turn > 0:
            if previous_answer is None:
                raise ValueError(f"session {self.session}: turn {self.turn} needs the answer")
            self.prompt += tuple(previous_answer)
        user = self.tokens.draw(self.rng, _around(self.rng, self.workload.user_len, 0.5))
        self.prompt += tuple(user)
        spec = RequestSpec(
            self.session,
            self.turn,
            self.prompt,
            self.workload.output_len,
            kind="turn",
            tenant=self.tenant,
        )
        self.turn += 1
        return spec


# ---- trace replay ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TraceWorkload:
    """Replays a JSONL trace in the Mooncake / aiperf format: one request per line with
    `timestamp` (ms), `input_length`, `output_length` and `hash_ids` (ids of the prompt's
    blocks of `block_len` tokens; 512 in Mooncake's traces). Block tokens depend only on
    (seed, hash id), so equal hash ids give equal token blocks; the prompt is those blocks cut
    to input_length, padded with request-unique tokens where the blocks are too few.

    Lines with a `session_id` are the turns of one conversation (aiperf's multi-turn rows, as
    `aiperf synthesize agentic-code` writes them): the first turn arrives at its `timestamp`,
    turn k is sent `delay` ms after turn k-1's answer, and its prompt is turn k-1's prompt, the
    answer the server gave, then the line's own tokens (input_length counts only those). Each
    conversation is sent with its session_id (and retention_seconds when set); it ends early
    where the next turn would pass max_context positions (0: no bound)."""

    path: str = ""
    block_len: int = 512
    time_scale: float = 1.0  # arrival times and delays are multiplied by this
    max_context: int = 0  # a conversation stops before a turn would pass this many positions
    retention_seconds: float = 0.0  # sent with each conversation's turns (0: not sent)

    def rows(self) -> list[dict]:
        if not self.path:
            raise ValueError("the trace workload needs path=FILE (a JSONL trace)")
        text = Path(self.path).read_text()
        return [json.loads(s) for s in text.splitlines() if s.strip()]

    def has_conversations(self) -> bool:
        """Whether any line is a conversation's turn (the simulator's hashed fast path
        replays single requests only; conversations need the answers' tokens)."""
        return any("session_id" in row for row in self.rows())

    def sessions(self, tokens: TokenSpace, seed: int) -> Iterator[Session]:
        lines = self.rows()
        start = min((r["timestamp"] for r in lines if "timestamp" in r), default=0)
        # (first line, its lines): one-shot lines alone, a conversation's lines together
        groups: dict[object, list[tuple[int, dict]]] = {}
        for i, row in enumerate(lines):
            groups.setdefault(row.get("session_id", ("line", i)), []).append((i, row))

        def arrival(row: dict) -> float | None:
            if "timestamp" not in row:
                return None  # the driver's arrival process decides
            return (row["timestamp"] - start) / 1000 * self.time_scale

        ordered = sorted(
            groups.values(), key=lambda g: (arrival(g[0][1]) is None, arrival(g[0][1]) or 0.0)
        )
        for group in ordered:
            first, row = group[0]
            if "session_id" in row:
                yield TraceSession(self, tokens, seed, f"t{first}", group, arrival(row))
                continue
            prompt = self.prompt_of(row, tokens, seed, first)
            spec = RequestSpec(f"t{first}", 0, prompt, int(row["output_length"]), kind="trace")
            yield OneShot(replace(spec, arrival_s=arrival(row)))

    def prompt_of(self, row: dict, tokens: TokenSpace, seed: int, index: int) -> tuple[int, ...]:
        ids: list[int] = []
        for h in row.get("hash_ids", ()):
            ids += tokens.draw(_rng(seed, "block", h), self.block_len)
        n = int(row["input_length"])
        if len(ids) < n:
            ids += tokens.draw(_rng(seed, "pad", index), n - len(ids))
        return tuple(ids[:n])


@dataclass
class TraceSession:
    """One conversation of a trace: `lines` are its (line index, line) in file order."""

    workload: TraceWorkload
    tokens: TokenSpace
    seed: int
    session: str
    lines: list[tuple[int, dict]]
    arrival_s: float | None
    turn: int = 0
    prompt: tuple[int, ...] = ()
    num_turns: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_turns = len(self.lines)

    def next_turn(self, previous_answer: Sequence[int] | None) -> RequestSpec | None:
        w = self.workload
        if self.turn >= self.num_turns:
            return None
        index, row = self.lines[self.turn]
        think, history = 0.0, self.prompt
        if self.turn > 0:
            if previous_answer is None:
                raise ValueError(f"session {self.session}: turn {self.turn} needs the answer")
            history += tuple(previous_answer)
            think = float(row.get("delay", 0.0)) / 1000 * w.time_scale
        new = w.prompt_of(row, self.tokens, self.seed, index)
        max_tokens = int(row["output_length"])
        if w.max_context and len(history) + len(new) + max_tokens > w.max_context:
            self.num_turns = self.turn  # the context is full: the conversation is done
            return None
        self.prompt = history + new
        spec = RequestSpec(
            self.session,
            self.turn,
            self.prompt,
            max_tokens,
            kind="trace",
            arrival_s=self.arrival_s if self.turn == 0 else None,
            think_s=think,
            session_id=str(row["session_id"]),
            retention_seconds=w.retention_seconds or None,
        )
        self.turn += 1
        return spec


WORKLOADS: dict[str, type] = {
    "agent": AgentWorkload,
    "agentic": AgenticWorkload,
    "prefix-repetition": PrefixRepetitionWorkload,
    "random": RandomWorkload,
    "shared-prefix": SharedPrefixWorkload,
    "short-prompt": ShortPromptWorkload,
    "long-prompt": LongPromptWorkload,
    "trace": TraceWorkload,
}


def make_workload(name: str, options: dict[str, str] | None = None) -> Workload:
    """The named workload with `options` (strings, e.g. from `--option key=value`) converted to
    the types of its fields' defaults."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; one of {', '.join(WORKLOADS)}")
    cls = WORKLOADS[name]
    defaults: dict[str, Any] = {f.name: f.default for f in fields(cls)}
    values = {}
    for key, text in (options or {}).items():
        if key not in defaults:
            raise ValueError(f"workload {name} has no option {key!r}; it has {', '.join(defaults)}")
        values[key] = type(defaults[key])(text)
    return cls(**values)


def replay(workload: Workload, tokens: TokenSpace, seed: int, n: int) -> list[RequestSpec]:
    """The first n requests of a workload answered by `stand_in_answer`, sessions run one after
    another: the request sequence a simulator or an oracle cache sees."""
    out: list[RequestSpec] = []
    for session in workload.sessions(tokens, seed):
        answer = None
        while len(out) < n and (spec := session.next_turn(answer)) is not None:
            out.append(spec)
            answer = stand_in_answer(spec, tokens, seed)
        if len(out) >= n:
            break
    return out
