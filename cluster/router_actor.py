"""RouterActor: the Router and its gRPC server (grpc.aio) inside an async Ray actor.

The server runs on the actor's event loop; blocking Router calls run in threads. A task polls
the controller's health check so that restarted workers are re-paired and the router forgets
their lost caches.
"""

from __future__ import annotations

import asyncio
import logging

import ray

logger = logging.getLogger(__name__)

ROUTER_NAME = "baton-router"


@ray.remote(num_cpus=0)
class RouterActor:
    """Routes gRPC requests over the workers of one controller."""

    def __init__(self, controller, options: dict) -> None:
        self.controller = controller
        self.options = options
        self.server = None
        self.router = None
        self._watch_task = None

    async def start(self) -> int:
        """Build the Router from the controller's workers and start serving; returns the port."""
        from cluster.ray_peer import RayPeer
        from engine.model_resolver import resolve_model
        from engine.tokenizer import load_tokenizer
        from router.router import Router
        from router.server import start_server

        o = self.options
        workers = await self.controller.workers.remote()
        peers = {}
        for w in workers:
            peers[w["worker_id"]] = RayPeer(await self.controller.handle.remote(w["worker_id"]))
        roles = {w["worker_id"]: w["role"] for w in workers}
        info = await asyncio.to_thread(next(iter(peers.values())).info)
        self.router = Router({i: p for i, p in peers.items() if roles[i] == "prefill"},
                             {i: p for i, p in peers.items() if roles[i] == "decode"},
                             block_size=info["block_size"], hash_seed=info["hash_seed"],
                             policy=o["policy"], local_prefill_tokens=o["local_prefill_tokens"])
        tokenizer = None if o.get("skip_tokenizer") else await asyncio.to_thread(
            load_tokenizer, resolve_model(o["model"]))
        self.server, port = await start_server(self.router, o["host"], o["port"], tokenizer,
                                               info.get("max_model_len"))
        self._watch_task = asyncio.create_task(self._watch(o.get("health_period_s", 2.0)))
        return port

    async def _watch(self, period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                health = await self.controller.check_health.remote()
            except Exception as exc:  # noqa: BLE001 - keep serving; try again next period
                logger.warning("health check failed: %s", exc)
                continue
            self.router.update_membership(health)

    async def stop(self) -> None:
        if self._watch_task is not None:
            self._watch_task.cancel()
        if self.server is not None:
            await self.server.stop(grace=5)
            self.server = None
