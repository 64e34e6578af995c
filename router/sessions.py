"""Sessions: the requests of one conversation, named by the client's session_id, and where the
router last ran them.

A request may carry a SessionHint (OpenAI body fields `session_id`, `retention_seconds`; gRPC
GenerateRequest fields of the same names). The workers keep a session's blocks at the lowest
eviction priority for retention_seconds after its last request (engine/retention.py); the
router remembers, per session, the prefill and decode worker its last turn ran on, until the
same time (SESSION_TTL_S without retention_seconds), and credits those workers
`affinity_tokens` prompt tokens in the next turn's choice (router/policy.py: a preference, so a
busy worker still loses to an idle one). A request without a session routes as before.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from engine.errors import InvalidRequestError
from engine.retention import MAX_SESSION_ID_CHARS, Retention

SESSION_TTL_S = 600.0  # a session without retention_seconds is remembered this long
AFFINITY_TOKENS = 256  # the credit of the session's workers, in prompt tokens
MAX_SESSIONS = 100_000  # past this many, the least recently used session is forgotten


class SessionFieldError(InvalidRequestError):
    """A session field is invalid; `field` names it (session_id or retention_seconds)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class SessionHint:
    """A request's conversation: its id and how long its blocks should be kept (None: the
    workers keep nothing on purpose; the router still routes it by affinity)."""

    session_id: str
    retention_seconds: float | None = None

    def check(self, max_retention_seconds: float) -> None:
        """SessionFieldError naming the field: session_id of 1 to 256 characters,
        retention_seconds > 0 and at most max_retention_seconds."""
        if not isinstance(self.session_id, str) or not (
            0 < len(self.session_id) <= MAX_SESSION_ID_CHARS
        ):
            raise SessionFieldError(
                "session_id",
                f"session_id={self.session_id!r} is invalid: a string of 1 to "
                f"{MAX_SESSION_ID_CHARS} characters",
            )
        try:
            retention = Retention.of(self.session_id, self.retention_seconds)
            if retention is not None:
                retention.check(max_retention_seconds)
        except InvalidRequestError as exc:
            raise SessionFieldError("retention_seconds", str(exc)) from None


def session_hint(session_id: str | None, retention_seconds: float | None) -> SessionHint | None:
    """The hint of a request's two fields (None without a session); retention_seconds without
    a session_id is refused."""
    if session_id is None:
        if retention_seconds is not None:
            raise SessionFieldError(
                "retention_seconds",
                "retention_seconds needs a session_id (the blocks are kept for a session)",
            )
        return None
    return SessionHint(session_id, retention_seconds)


@dataclass(frozen=True, slots=True)
class SessionPlace:
    """Where a session's last turn ran, and until when that is worth going back to."""

    prefill: str | None  # None: its decode worker prefilled it
    decode: str
    expires: float  # on the book's clock


class SessionBook:
    """session_id -> SessionPlace, each forgotten once expired; thread-safe. `clock` is
    injectable (tests)."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        ttl_s: float = SESSION_TTL_S,
        max_sessions: int = MAX_SESSIONS,
    ) -> None:
        self._clock = clock
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._places: OrderedDict[str, SessionPlace] = OrderedDict()  # least recent first
        self._lock = threading.Lock()

    def remember(self, hint: SessionHint, prefill: str | None, decode: str) -> None:
        """The session's turn ran on these workers (call when it finished)."""
        keep = hint.retention_seconds if hint.retention_seconds is not None else self.ttl_s
        place = SessionPlace(prefill, decode, self._clock() + keep)
        with self._lock:
            self._places.pop(hint.session_id, None)
            self._places[hint.session_id] = place
            while len(self._places) > self.max_sessions:
                self._places.popitem(last=False)

    def place(self, session_id: str) -> SessionPlace | None:
        """The session's place, None when unknown or expired (then forgotten)."""
        with self._lock:
            place = self._places.get(session_id)
            if place is not None and place.expires <= self._clock():
                del self._places[session_id]
                return None
            return place

    def affinity(self, hint: SessionHint | None, tokens: int) -> dict[str, int]:
        """{worker id: credit} for the session's workers ({} without a live session)."""
        place = self.place(hint.session_id) if hint is not None else None
        if place is None or tokens <= 0:
            return {}
        return {w: tokens for w in (place.prefill, place.decode) if w is not None}

    def __len__(self) -> int:
        with self._lock:
            return len(self._places)
