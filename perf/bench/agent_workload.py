"""The multi-turn agent workload: many concurrent agent sessions whose contexts outgrow the KV
cache, the traffic a KV tier, session retention and decode -> prefill pulls are for.

Every session starts with the same system prompt and tool schemas, then its own task. Each
turn the model answers (a tool call, output_len tokens) and, after the tool ran (think_s), the
tool's output comes back: turn k's prompt is turn k-1's prompt + its answer + the tool output
(hundreds to thousands of tokens). Every request carries its session's session_id and
retention_seconds, so the router can send a turn back to the workers holding its context.

Sizing: with live_context_x > 0 and kv_tokens (one worker's KV cache, in tokens), live_sessions()
is how many sessions run at once so that their distinct live context (the shared prefix once,
then each session's own history at its mid-point) is about live_context_x x kv_tokens; the
driver runs that many at once when no --max-concurrency is given. Without kv_tokens, `baton
bench` over gRPC takes the largest decode worker's KV blocks from ClusterStatus.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from perf.bench.specs import RequestSpec, Session, TokenSpace, around, rng_for


@dataclass(frozen=True, slots=True)
class AgentWorkload:
    """Agent sessions over one shared system prompt + tool schemas (see the module docstring).
    Defaults fit SmolLM2 (8,192 positions): a session ends before its next prompt and answer
    would pass max_context."""

    system_len: int = 1000  # the system prompt every session shares
    tools_len: int = 1000  # the tool schemas, after the system prompt
    task_len: int = 200  # the session's own task
    tool_output_len: int = 600  # mean tokens of a tool's output
    tool_output_range: float = 0.75  # tool outputs are uniform in mean x [1 - r, 1 + r]
    output_len: int = 100  # each answer (a tool call)
    min_turns: int = 4
    max_turns: int = 10
    think_s: float = 2.0  # mean tool time between turns (uniform in [0, 2 x think_s])
    retention_seconds: float = 60.0  # asked of the workers (0: session_id only)
    live_context_x: float = 0.0  # live context / kv_tokens (0: the driver decides concurrency)
    kv_tokens: int = 0  # one worker's KV cache in tokens (with live_context_x)
    max_context: int = 8192

    def __post_init__(self) -> None:
        if not 1 <= self.min_turns <= self.max_turns:
            raise ValueError(f"need 1 <= min_turns <= max_turns, got {self.min_turns}..")
        if self.kv_tokens < 0 or self.live_context_x < 0:
            raise ValueError("kv_tokens and live_context_x must be >= 0")
        if self.shared_len + self.task_len + self.output_len >= self.max_context:
            raise ValueError(f"the first turn alone passes max_context={self.max_context}")

    @property
    def shared_len(self) -> int:
        return self.system_len + self.tools_len

    def mean_turns(self) -> float:
        """Turns of an average session, capped by max_context."""
        grow = self.output_len + self.tool_output_len
        room = (self.max_context - self.shared_len - self.task_len - self.output_len) // grow
        return min((self.min_turns + self.max_turns) / 2, room + 1)

    def mean_own_context(self) -> float:
        """A session's own tokens (task and history, its answers' KV included) at the
        mid-point of an average session."""
        grow = self.output_len + self.tool_output_len
        return self.task_len + grow * (self.mean_turns() - 1) / 2 + self.output_len

    def live_sessions(self) -> int | None:
        """Sessions to run at once for live_context_x (None: not sized)."""
        if self.live_context_x <= 0:
            return None
        if self.kv_tokens < 1:
            raise ValueError(
                "live_context_x needs kv_tokens (one worker's KV cache in tokens; `baton "
                "bench` over gRPC reads it from the cluster)"
            )
        own = self.live_context_x * self.kv_tokens - self.shared_len
        return max(1, math.ceil(own / self.mean_own_context()))

    def sessions(self, tokens: TokenSpace, seed: int) -> Iterator[Session]:
        shared_rng = rng_for(seed, "agent-shared")
        shared = tuple(tokens.draw(shared_rng, self.shared_len))
        for i in itertools.count():
            yield AgentSession(self, tokens, rng_for(seed, "agent", i), f"g{i}", shared)


@dataclass
class AgentSession:
    """One agent's conversation: turn k = turn k-1's prompt + its answer + a tool output."""

    workload: AgentWorkload
    tokens: TokenSpace
    rng: random.Random
    session: str
    prompt: tuple[int, ...]  # the shared prefix, then the history so far
    turn: int = 0
    num_turns: int = field(init=False)

    tool_lens: list[int] = field(init=False)  # tool_lens[k - 1]: turn k's tool output

    def __post_init__(self) -> None:
        w = self.workload
        self.num_turns = self.rng.randint(w.min_turns, w.max_turns)
        self.prompt += tuple(self.tokens.draw(self.rng, w.task_len))
        # The tool outputs are drawn now, so num_turns is the turns that fit max_context with
        # answers of output_len (the driver claims num_turns of --num-requests at the start)
        self.tool_lens, positions = [], len(self.prompt) + w.output_len
        for turn in range(1, self.num_turns):
            tool = around(self.rng, w.tool_output_len, w.tool_output_range)
            positions += tool + w.output_len
            if positions > w.max_context:
                self.num_turns = turn
                break
            self.tool_lens.append(tool)

    def next_turn(self, previous_answer: Sequence[int] | None) -> RequestSpec | None:
        w = self.workload
        if self.turn >= self.num_turns:
            return None
        think = 0.0
        if self.turn > 0:
            if previous_answer is None:
                raise ValueError(f"session {self.session}: turn {self.turn} needs the answer")
            # fits max_context: answers are at most output_len tokens (see __post_init__)
            tool = self.tool_lens[self.turn - 1]
            self.prompt += tuple(previous_answer) + tuple(self.tokens.draw(self.rng, tool))
            think = self.rng.uniform(0.0, 2 * w.think_s)
        spec = RequestSpec(
            self.session,
            self.turn,
            self.prompt,
            w.output_len,
            kind="agent",
            think_s=think,
            session_id=self.session,
            retention_seconds=w.retention_seconds or None,
        )
        self.turn += 1
        return spec
