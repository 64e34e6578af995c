"""Requests for the engine's unit tests (block pool, KV cache manager, scheduler)."""

from __future__ import annotations

from collections.abc import Iterable

from engine.request import Request
from engine.sampling_params import SamplingParams


def make_request(
    rid: str, tokens: Iterable[int], salt: str | None = None, *, max_tokens: int = 100
) -> Request:
    """A request for the prompt `tokens` that arrived at time 0, with `salt` as its cache_salt;
    it finishes after max_tokens outputs."""
    return Request(
        rid, list(tokens), SamplingParams(max_tokens=max_tokens), arrival_time=0.0, cache_salt=salt
    )
