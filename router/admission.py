"""Admission: a bound on the requests waiting at the router, shared by both front doors.

A request is pending from the moment a front door accepts it until its first output (or its
end, whichever comes first). Past `max_pending` pending requests a new one is refused at
once (HTTP 429 / gRPC RESOURCE_EXHAUSTED) instead of queueing without bound behind the
router's wait for workers and free KV blocks. The HTTP door admits in its request path; the
gRPC door through GrpcAdmissionInterceptor, so that the servicer itself is unchanged.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import grpc

from router.errors import AdmissionRefused, grpc_labels, grpc_status

if TYPE_CHECKING:
    from router.metrics import RouterMetrics


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


class GrpcAdmissionInterceptor(grpc.aio.ServerInterceptor):
    """Admits each server-streaming call of `methods` (full names, e.g.
    "/baton.v1.Inference/Generate"): pending until its first reply or its end. With
    `metrics` (router.metrics.RouterMetrics), each refusal is a request error."""

    def __init__(
        self,
        admission: Admission,
        methods: tuple[str, ...],
        metrics: RouterMetrics | None = None,
    ) -> None:
        self.admission = admission
        self.methods = methods
        self.metrics = metrics

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if (
            handler is None
            or handler_call_details.method not in self.methods
            or handler.request_streaming
            or not handler.response_streaming
        ):
            return handler
        behavior, admission, metrics = handler.unary_stream, self.admission, self.metrics

        async def admitted(request, context):
            try:
                ticket = admission.admit()
            except AdmissionRefused as exc:
                if metrics is not None:
                    metrics.request_error("grpc", *grpc_labels(exc))
                await context.abort(grpc_status(exc), str(exc))
            try:
                async for reply in behavior(request, context):
                    ticket.release()
                    yield reply
            finally:
                ticket.release()

        return grpc.unary_stream_rpc_method_handler(
            admitted,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
