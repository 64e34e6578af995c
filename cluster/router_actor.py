"""RouterActor: the Router and its gRPC server (grpc.aio) inside an async Ray actor.

The controller creates it, tells it which workers take new requests (set_workers) and asks
it which workers still run requests (active_counts) before a leaving worker is removed. The
server runs on the actor's event loop; blocking Router calls run in threads. A task polls
the controller's health check so that the router forgets restarted workers' lost caches and
skips unhealthy ones.

A dead router comes back by itself: the actor has max_restarts=-1, Ray re-runs __init__ in a
new process, and a reconstructed incarnation queues recover() on itself, which binds the ports
the first incarnation bound (asked from the controller, which recorded them; the settings may
say port 0; if the controller is down too, read from its saved state, cluster/state_store.py)
and asks the controller to publish the workers and settings again (once a second until one
answers). Until the servers listen, clients get connection refused (gRPC UNAVAILABLE), never a
hang. The actor is detached and named: it outlives a dead controller, which re-adopts it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from typing import TYPE_CHECKING

import ray

from router.settings import RouterSettings

if TYPE_CHECKING:
    import grpc

    from router.admission import Admission
    from router.http_server import HttpServer
    from router.router import Router
    from router.security import ApiKeys

logger = logging.getLogger(__name__)

ROUTER_NAME = "baton-router"
RECOVER_ATTEMPTS = 30  # a restarted router tries to listen again this many times, 1 s apart
# One health report from the controller (its pings and any re-pairing); a call that outlives
# it (e.g. one caught in a controller restart) is given up and the next period asks again.
HEALTH_CALL_S = 60.0


def saved_router_ports() -> dict | None:
    """The ports the controller recorded in its saved state (cluster/state_store.py), for a
    router restarted while the controller is down too; None if there are none."""
    from cluster import state_store

    saved = state_store.load(ray.get_runtime_context().namespace) or {}
    return (saved.get("router") or {}).get("ports")


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class RouterActor:
    """Routes gRPC requests over the workers the controller assigns."""

    def __init__(self, controller, settings: RouterSettings) -> None:
        self.controller = controller
        self.settings = settings
        self.server: grpc.aio.Server | None = None
        self.http_server: HttpServer | None = None
        self.router: Router | None = None
        self.api_keys: ApiKeys | None = None  # num_refused for the metrics
        self.admission: Admission | None = None  # pending, num_refused
        self._watch_task: asyncio.Task[None] | None = None
        self._last_health: float | None = None  # time.monotonic() of the last report applied
        self._control_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="control")
        self._recovering = False
        if ray.get_runtime_context().was_current_actor_reconstructed:
            # Ray restarted this actor after its process died: serve again on our own.
            ray.get_runtime_context().current_actor.recover.remote()

    # Submitted from __init__ while Ray still counts the actor as restarting: such a call
    # fails as "actor unavailable" and is retried once the actor is alive (maybe twice).
    @ray.method(max_task_retries=20)
    async def recover(self) -> dict | None:
        """Restarted by Ray: listen on the ports the first incarnation bound, then ask the
        controller to publish the workers again. If it cannot listen, the process exits and
        Ray restarts it once more."""
        if self._recovering:
            return None
        self._recovering = True
        try:
            ports = await self.controller.bound_router_ports.remote()
        except Exception as exc:  # noqa: BLE001 - the controller is down or restarting
            ports = saved_router_ports()
            logger.warning(
                "router restarted; the controller does not answer (%s); its saved state "
                "says ports %s",
                exc,
                ports,
            )
        for attempt in range(1, RECOVER_ATTEMPTS + 1):
            try:
                bound = await self.start(ports)
                break
            except Exception as exc:  # noqa: BLE001 - e.g. the old sockets linger a moment
                logger.warning("router restarted; cannot listen yet (%d): %s", attempt, exc)
                await self.stop()
                await asyncio.sleep(1.0)
        else:
            os._exit(1)
        logger.warning("router restarted; serving again on %s", bound)
        for attempt in range(1, RECOVER_ATTEMPTS + 1):  # the controller may be restarting too
            try:
                await self.controller.router_restarted.remote()
                break
            except Exception as exc:  # noqa: BLE001 - keep serving; ask again
                logger.warning(
                    "router restarted; the controller did not publish the workers (%d): %s",
                    attempt,
                    exc,
                )
                await asyncio.sleep(1.0)
        return bound

    def process_threads(self) -> dict:
        """{"pid": this process, "threads": {native id: name}}, each Python thread's OS name
        set from it first (cluster/thread_names.py; `baton profile serving` reads /proc)."""
        from cluster.thread_names import name_os_threads

        return {"pid": os.getpid(), "threads": name_os_threads()}

    async def start(self, ports: dict | None = None) -> dict:
        """Start both front doors with no workers yet (requests get UNAVAILABLE until
        set_workers); returns the bound ports {"grpc": port, "http": port or None}. `ports`
        (a restart: what the first incarnation bound) overrides the settings' ports."""
        from engine.model_resolver import resolve_model
        from engine.tokenizer import load_tokenizer
        from router.admission import Admission, GrpcAdmissionInterceptor
        from router.chat_template import read_chat_template
        from router.http_server import start_http_server
        from router.metrics_exposition import router_scrape
        from router.openai_http import create_app
        from router.router import Router
        from router.security import (
            ApiKeys,
            GrpcKeyInterceptor,
            TLSFiles,
            load_api_keys,
            warn_if_exposed,
        )
        from router.server import SERVICE, start_server

        s = self.settings
        if ports:
            s = replace(s, port=ports["grpc"])
            if s.http_port is not None and ports.get("http") is not None:
                s = replace(s, http_port=ports["http"])
        self.router = router = Router(
            {},
            {},
            block_size=s.block_size,
            hash_seed=s.hash_seed,
            policy=s.policy,
            local_prefill_tokens=s.local_prefill_tokens,
            wait_for_workers_s=s.wait_for_workers_s,
            aggregated=s.aggregated,
            migration_limit=s.migration_limit,
            max_retention_seconds=s.max_retention_seconds,
        )
        tokenizer = (
            None
            if s.skip_tokenizer
            else await asyncio.to_thread(load_tokenizer, resolve_model(s.model))
        )
        chat_template = read_chat_template(s.chat_template)
        # Checked once, before a request reaches the router's queue: key, then admission.
        self.api_keys = api_keys = ApiKeys(
            load_api_keys(env_var=s.api_key_env, file=s.api_key_file)
        )
        tls = TLSFiles(**asdict(s.tls)) if s.tls else None
        self.admission = admission = Admission(s.max_pending_requests)
        router.metrics.read_counter(
            "auth_failures",
            "Requests refused for a missing or unknown API key (both doors).",
            lambda: api_keys.num_refused,
        )
        router.metrics.read_counter(
            "admission_refused",
            "Requests refused because max_pending_requests were already waiting.",
            lambda: admission.num_refused,
        )
        metrics = router.metrics  # both doors count every error answer there
        interceptors = [
            GrpcKeyInterceptor(api_keys, metrics),
            GrpcAdmissionInterceptor(admission, (f"/{SERVICE}/Generate",), metrics),
        ]
        self.server, port = await start_server(
            router,
            s.host,
            s.port,
            tokenizer,
            interceptors=interceptors,
            tls=tls,
            chat_template=chat_template,
        )
        warn_if_exposed("gRPC", s.host, api_keys)
        http_port = None
        if s.http_port is not None:
            app = create_app(
                router,
                s.served_model_names,
                tokenizer=tokenizer,
                api_keys=api_keys,
                admission=admission,
                metrics_text=lambda: router_scrape(router),  # the whole cluster's series
                chat_template=chat_template,
            )
            self.http_server, http_port = await start_http_server(app, s.host, s.http_port, tls)
            warn_if_exposed("HTTP", s.host, api_keys)
        self._watch_task = asyncio.create_task(self._watch(s.health_period_s))
        return {"grpc": port, "http": http_port}

    async def set_workers(
        self,
        prefill: dict,
        decode: dict,
        block_size: int,
        hash_seed: str,
        max_model_len: int | None,
    ) -> None:
        """New requests go to these workers ({worker id: actor handle}) from now on."""
        from cluster.ray_peer import decode_client, prefill_client

        await self._control(
            self._started().set_workers,
            {w: prefill_client(h) for w, h in prefill.items()},
            {w: decode_client(h) for w, h in decode.items()},
            block_size=block_size,
            hash_seed=hash_seed,
            max_model_len=max_model_len,
        )

    async def configure(self, settings: RouterSettings) -> None:
        """Apply the settings that change in place (policy, conditional disaggregation, the
        wait for workers, aggregated mode, the migration limit); the front doors keep what
        they were started with (a change there restarts this actor)."""
        self.settings = settings
        await self._control(
            self._started().configure,
            settings.policy,
            settings.local_prefill_tokens,
            settings.wait_for_workers_s,
            settings.aggregated,
            settings.migration_limit,
            settings.max_retention_seconds,
        )

    async def node_id(self) -> str:
        """The Ray node this router runs on (hex): the head node (its address is stable)."""
        return ray.get_runtime_context().get_node_id()

    async def active_counts(self) -> dict[str, int]:
        return await self._control(self._started().active_counts)

    async def _control(self, fn, *args, **kwargs):
        """Control calls run on their own threads: never behind blocked request streams."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._control_pool, lambda: fn(*args, **kwargs))

    def _started(self) -> Router:
        """The Router; the controller calls anything else only after start()."""
        if self.router is None:
            raise RuntimeError("the router actor has not started")
        return self.router

    async def stats(self) -> dict:
        router = self._started()
        return {
            "hit_rate": router.hit_rate(),
            "policy": router.policy_name,
            "aggregated": router.aggregated,
            "prompt_tokens": router.num_prompt_tokens,
            "cached_tokens": router.num_cached_tokens,
            # Whether a new request can be served now, as /health and gRPC health answer.
            "readiness": router.readiness().body(),
            # Seconds since the controller's last health report (None: none yet); grows
            # while the controller is down, the router serving on meanwhile.
            "health_age_s": None
            if self._last_health is None
            else round(time.monotonic() - self._last_health, 1),
        }

    async def _watch(self, period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                health = await asyncio.wait_for(
                    self.controller.router_health.remote(), HEALTH_CALL_S
                )
            except Exception as exc:  # noqa: BLE001 - keep serving; try again next period
                logger.warning("health check failed: %s", exc)
                continue
            await self._control(self._started().update_membership, health)
            self._last_health = time.monotonic()

    async def stop(self) -> None:
        if self._watch_task is not None:
            self._watch_task.cancel()
        if self.http_server is not None:
            await self.http_server.stop(grace=5)
            self.http_server = None
        if self.server is not None:
            await self.server.stop(grace=5)
            self.server = None
