"""grpc.health.v1 for the gRPC door, answered from Router.readiness() (router/readiness.py).

Check reads the router's readiness at the call: SERVING while a new request can be served,
NOT_SERVING otherwise, for the overall server ("") and for baton.v1.Inference. A Watch stream
gets the status at once and again whenever it changes (looked at every WATCH_POLL_S while
the stream is open). Health stays open without an API key (router/security.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from grpc_health.v1 import health, health_pb2

from router.router import Router

WATCH_POLL_S = 1.0  # how often an open Watch stream looks at the router's readiness


class RouterHealth(health.aio.HealthServicer):
    """The health service of `services` (names; "" is the whole server) over `router`."""

    def __init__(self, router: Router, services: Sequence[str]) -> None:
        super().__init__()
        self.router = router
        self.services = tuple(services)

    async def refresh(self) -> None:
        """Set every service's status from the router's readiness now."""
        serving = self.router.readiness().serving
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in self.services:
            await self.set(service, status)

    async def Check(self, request, context):  # noqa: N802 - gRPC method name
        await self.refresh()
        return await super().Check(request, context)

    async def Watch(self, request, context):  # noqa: N802 - gRPC method name
        await self.refresh()
        poll = asyncio.create_task(self._poll())
        try:
            await super().Watch(request, context)
        finally:
            poll.cancel()

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(WATCH_POLL_S)
            await self.refresh()
