"""Choices (sampling n > 1): how the n sequences of one request are named and tracked.

Choice 0 is the request itself; the others fork off it once its prefill samples their
first tokens (LLMEngine._fork), each with its own seed (engine.sampler.choice_seed).
"""

from __future__ import annotations

from dataclasses import dataclass, field


def choice_id(request_id: str, index: int) -> str:
    """The engine's id of choice `index` of request_id (the request id itself for 0)."""
    return request_id if index == 0 else f"{request_id}#{index}"


def is_choice_of(engine_id: str, groups: dict[str, ChoiceGroup]) -> bool:
    """Whether engine_id names a choice (forked or still to fork) of a request in groups."""
    if engine_id in groups:
        return True
    request_id, _, index = engine_id.rpartition("#")
    group = groups.get(request_id)
    return group is not None and index.isdigit() and 0 < int(index) < group.n


@dataclass(slots=True)
class ChoiceGroup:
    """The choices of one request with n > 1 that have not finished yet."""

    n: int
    unfinished: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.unfinished = set(range(self.n))

    def finish(self, index: int) -> bool:
        """Choice `index` ended; True once every choice has."""
        self.unfinished.discard(index)
        return not self.unfinished
