"""LeaseTable: time-limited claims on the blocks of in-flight transfers, one per request id."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


class LeaseError(KeyError):
    """A lease operation does not fit the table (double grant, unknown or expired lease)."""

    def __str__(self) -> str:
        # KeyError repr()s its argument; these messages are meant to be read as text.
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True, slots=True)
class Lease:
    """A claim by `owner` on request `request_id`'s blocks, valid while clock() < expires_at."""

    request_id: str
    owner: str
    expires_at: float


class LeaseTable:
    """Leases keyed by request id; the clock is injectable so expiry is exact in tests.

    A lease granted at time t for s seconds is live on [t, t + s) and expired from t + s on.
    `expired()` removes what it returns, so each lapsed lease is reported exactly once and the
    caller frees its blocks exactly once. Thread-safe.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def __contains__(self, request_id: object) -> bool:
        with self._lock:
            return request_id in self._leases

    def get(self, request_id: str) -> Lease | None:
        """The lease held for request_id, or None if there is none (expired ones included)."""
        with self._lock:
            return self._leases.get(request_id)

    def grant(self, request_id: str, owner: str, seconds: float) -> Lease:
        """Start a lease; LeaseError if request_id already holds one (release it first)."""
        _check_seconds(seconds)
        with self._lock:
            if request_id in self._leases:
                held = self._leases[request_id]
                raise LeaseError(
                    f"request {request_id!r} already holds a lease (owner "
                    f"{held.owner!r}); release it before granting again"
                )
            lease = Lease(request_id, owner, self._clock() + seconds)
            self._leases[request_id] = lease
            return lease

    def renew(self, request_id: str, seconds: float) -> Lease:
        """Move a live lease's expiry to now + seconds; LeaseError if unknown or already lapsed."""
        _check_seconds(seconds)
        with self._lock:
            now = self._clock()
            held = self._leases.get(request_id)
            if held is None:
                raise LeaseError(f"request {request_id!r} holds no lease to renew")
            if held.expires_at <= now:
                # Its blocks may be reclaimed by the next expired() call: renewing would race it.
                raise LeaseError(
                    f"lease of request {request_id!r} lapsed at {held.expires_at} "
                    f"(now {now}); it can no longer be renewed"
                )
            lease = Lease(request_id, held.owner, now + seconds)
            self._leases[request_id] = lease
            return lease

    def release(self, request_id: str) -> Lease | None:
        """End a lease and return it; None if none is held (never granted, released, expired)."""
        with self._lock:
            return self._leases.pop(request_id, None)

    def revoke_owner(self, owner: str) -> list[Lease]:
        """End every lease of `owner` (a peer that left); returned sorted by expiry, request id."""
        with self._lock:
            gone = [lease for lease in self._leases.values() if lease.owner == owner]
            for lease in gone:
                del self._leases[lease.request_id]
        return sorted(gone, key=lambda lease: (lease.expires_at, lease.request_id))

    def expired(self, now: float | None = None) -> list[Lease]:
        """Remove and return leases with expires_at <= now (default: clock()), oldest first."""
        with self._lock:
            now = self._clock() if now is None else now
            gone = [lease for lease in self._leases.values() if lease.expires_at <= now]
            for lease in gone:
                del self._leases[lease.request_id]
        return sorted(gone, key=lambda lease: (lease.expires_at, lease.request_id))


def _check_seconds(seconds: float) -> None:
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise TypeError(f"lease seconds must be a number, got {type(seconds).__name__}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"lease seconds must be finite and > 0, got {seconds}")
