"""Retention: a request's hint that its session comes back, so the blocks of its prompt and
output should outlast other cached blocks for a while.

A request with retention (session_id, seconds) frees its blocks tagged with the session; the
block pool (engine/block_pool.py) evicts tagged blocks of a live session only when no other
evictable block is left, until `seconds` after the session's last request finished. Then they
are ordinary cached blocks again, in least-recently-freed order (and go to a KV tier like any
other when finally evicted). The engine bounds `seconds` by its max_retention_seconds option.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.errors import InvalidRequestError

MAX_SESSION_ID_CHARS = 256


@dataclass(frozen=True, slots=True)
class Retention:
    """Keep the blocks of session `session_id` for `seconds` after its last request ended."""

    session_id: str
    seconds: float

    def __post_init__(self) -> None:
        if (
            not isinstance(self.session_id, str)
            or not 0 < len(self.session_id) <= MAX_SESSION_ID_CHARS
        ):
            raise InvalidRequestError(
                f"session_id={self.session_id!r} is invalid: a string of 1 to "
                f"{MAX_SESSION_ID_CHARS} characters"
            )
        s = self.seconds
        if isinstance(s, bool) or not isinstance(s, int | float) or not math.isfinite(s) or s <= 0:
            raise InvalidRequestError(f"retention_seconds={s!r} is invalid: a number > 0")

    @classmethod
    def of(cls, session_id: str | None, retention_seconds: float | None) -> Retention | None:
        """The retention a request's fields ask for: None without retention_seconds (a
        session_id alone asks for nothing here); retention_seconds needs a session_id."""
        if retention_seconds is None:
            return None
        if session_id is None:
            raise InvalidRequestError(
                "retention_seconds needs a session_id (the blocks are kept for a session)"
            )
        return cls(session_id, retention_seconds)

    def check(self, max_seconds: float) -> None:
        """InvalidRequestError naming both fields when seconds is past the engine's bound."""
        if self.seconds > max_seconds:
            raise InvalidRequestError(
                f"retention_seconds={self.seconds:g} is invalid: at most "
                f"max_retention_seconds={max_seconds:g}"
            )
