"""The router actor's life as the controller drives it: start it, restart it when what its
servers were started with changes, set what changes in place, tell it which workers take new
requests, stop it.

The router's settings are the RouterSettings (router/settings.py) cluster/templates.py:
router_settings builds from the manifest; this module is the only part of the controller that
reads them.
"""

from __future__ import annotations

import logging
from typing import Any

import ray

from cluster import timeouts as T
from cluster.ray_helpers import HEAD_NODE_RESOURCE, NAMESPACE, short_error
from cluster.router_actor import ROUTER_NAME, RouterActor
from cluster.state import ClusterState, RouterRecord
from cluster.templates import ROLES, router_settings
from deploy.manifest import Manifest, parse_manifest
from router.settings import RouterSettings

logger = logging.getLogger(__name__)


def addresses(settings: RouterSettings, ports: dict) -> tuple[str, str | None]:
    """(gRPC host:port, OpenAI HTTP scheme://host:port or None when not served) of a router
    started with `settings` that bound `ports` ({"grpc", "http"})."""
    grpc_address = f"{settings.host}:{ports['grpc']}"
    scheme = "https" if settings.tls else "http"
    http_address = (
        f"{scheme}://{settings.host}:{ports['http']}" if ports["http"] is not None else None
    )
    return grpc_address, http_address


def configure_router(state: ClusterState, settings: RouterSettings) -> None:
    """Set what the router changes in place: policy, conditional disaggregation, the
    wait for workers, aggregated mode and the migration limit."""
    ray.get(state.require_router().handle.configure.remote(settings), timeout=T.ROUTER_CONFIGURE_S)


def ensure_router(state: ClusterState, settings: RouterSettings) -> str | None:
    """Start the router actor, or restart it when what its servers were started with
    changed (RouterSettings.server_key); the rest is set in place. Returns "start",
    "restart" or None."""
    key: tuple | None = settings.server_key()
    if state.router is not None and key == state.router.key:
        try:
            configure_router(state, settings)
            return None
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            state.log(f"the router does not answer ({short_error(exc)}); starting a new one")
            key = None  # restart it below
    verb = "restart" if state.router is not None else "start"
    if state.router is not None:
        if key is not None:
            state.log(
                f"restarting the router ({state.router.address} -> {settings.host}:{settings.port})"
            )
        stop_router(state)
    me = ray.get_runtime_context().current_actor
    # On the head node: the address clients (and a KubeRay Service) reach is stable.
    handle = RouterActor.options(  # type: ignore[attr-defined]  # an ActorClass, to ray
        name=ROUTER_NAME,
        namespace=NAMESPACE,
        lifetime="detached",
        resources={HEAD_NODE_RESOURCE: 0.001},
    ).remote(me, settings)
    state.router = RouterRecord(handle)
    ports = ray.get(handle.start.remote(), timeout=T.ROUTER_START_S)
    address, http_address = addresses(settings, ports)
    state.router = RouterRecord(handle, settings.server_key(), address, http_address, ports)
    state.log(
        f"router serving gRPC on {address}"
        + (f", OpenAI HTTP on {http_address}" if http_address else "")
    )
    return verb


def publish(state: ClusterState, m: Manifest) -> None:
    """Tell the router which workers take new requests; returns once it holds."""
    if state.router is None:
        return
    pools: dict[str, dict[str, Any]] = {
        role: {w.worker_id: w.handle for w in state.active(role)} for role in ROLES
    }
    pool_engine = m.spec.engine_for("prefill")
    max_model_len = None
    for decode in state.active("decode"):  # any that answers: one may be restarting
        try:
            info = ray.get(decode.handle.info.remote(), timeout=T.WORKER_INFO_S)
        except Exception as exc:  # noqa: BLE001 - dead or restarting: ask the next one
            logger.warning("info of %s: %s", decode.worker_id, short_error(exc))
            continue
        max_model_len = info.max_model_len
        break
    ray.get(
        state.require_router().handle.set_workers.remote(
            pools["prefill"],
            pools["decode"],
            pool_engine.block_size,
            pool_engine.hash_seed,
            max_model_len,
        ),
        timeout=T.PUBLISH_S,
    )


def republish(state: ClusterState) -> None:
    """A router Ray restarted came back empty: set its settings and publish the workers of
    the applied manifest again."""
    state.log(f"the router was restarted; serving again on {state.require_router().address}")
    if state.manifest is None:  # the controller publishes only once a manifest was applied
        raise RuntimeError("no applied manifest to publish the workers of")
    m = parse_manifest(state.manifest)
    configure_router(state, router_settings(m))
    publish(state, m)


def stop_router(state: ClusterState) -> None:
    """Stop the router's servers (open streams get a few seconds) and kill the actor."""
    router = state.require_router()
    try:
        ray.get(router.handle.stop.remote(), timeout=T.ROUTER_STOP_S)
    except Exception as exc:  # noqa: BLE001 - killed below either way
        logger.warning("stopping the router: %s", exc)
    ray.kill(router.handle)
    state.router = None
