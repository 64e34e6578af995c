"""Admission: a bound on the requests waiting at the router, shared by both front doors.

A request is pending from the moment a front door accepts it until its first output (or its
end, whichever comes first). Past `max_pending` pending requests a new one is refused at
once (HTTP 429 / gRPC RESOURCE_EXHAUSTED) instead of queueing without bound behind the
router's wait for workers and free KV blocks.
"""

from __future__ import annotations

import threading

from router.errors import AdmissionRefused


class Admission:
    """Counts pending requests; refuses new ones past max_pending (None: no bound)."""

    def __init__(self, max_pending: int | None = None) -> None:
        if max_pending is not None and max_pending < 1:
            raise ValueError(f"max_pending_requests={max_pending} must be >= 1 (or unset)")
        self.max_pending = max_pending
        self.pending = 0
        self.num_refused = 0  # read by the metrics module
        self._lock = threading.Lock()

    def admit(self) -> Ticket:
        """A ticket for one new pending request; raises AdmissionRefused when full."""
        with self._lock:
            if self.max_pending is not None and self.pending >= self.max_pending:
                self.num_refused += 1
                raise AdmissionRefused(
                    f"{self.pending} requests are already waiting at the router "
                    f"(max_pending_requests={self.max_pending}); retry later"
                )
            self.pending += 1
        return Ticket(self)

    def _release(self) -> None:
        with self._lock:
            self.pending -= 1


class Ticket:
    """One admitted request's place in the pending count; release() is idempotent."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._held = True

    def release(self) -> None:
        """The request streams (or ended): it no longer counts as pending."""
        if self._held:
            self._held = False
            self._admission._release()
