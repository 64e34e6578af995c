"""Health checks and repair: ping every worker; a worker that answers with a new incarnation
was restarted by Ray (on its node or, after a node loss, wherever its placement group went)
and is paired again; one that stops answering, and one that comes back, gets a progress line
naming its node. The router polls this (router_health) to skip unhealthy workers and forget
the cache and load of restarted ones."""

from __future__ import annotations

import enum
import logging

import ray

from cluster import timeouts as T
from cluster.pairing import pair, pairs_of, unpair
from cluster.ray_helpers import live_node_ids, short_error, short_node
from cluster.state import ClusterState
from cluster.worker_actor import Worker

logger = logging.getLogger(__name__)


class Verdict(enum.Enum):
    """What one ping says of a worker."""

    HEALTHY = "healthy"  # the same incarnation answers, as it did last time
    BACK = "back"  # the same incarnation answers again after it did not
    LOST = "lost"  # no answer from a worker that answered last time
    STILL_LOST = "still lost"  # no answer again
    RESTARTED = "restarted"  # a new incarnation answers: pair it again


def verdict(worker: Worker, answer: str | BaseException) -> Verdict:
    """Judge a ping's `answer` (the incarnation, or the exception waiting for it raised)."""
    if isinstance(answer, BaseException):
        return Verdict.LOST if worker.healthy else Verdict.STILL_LOST
    if answer != worker.incarnation:
        return Verdict.RESTARTED
    return Verdict.HEALTHY if worker.healthy else Verdict.BACK


def lost_line(worker: Worker, exc: BaseException, live_nodes: set[str]) -> str:
    """The progress line of a worker that stopped answering: where it ran and whether
    that node is still alive (`live_nodes`: their ids)."""
    node = short_node(worker.node_id)
    where = (
        f"its node {node} is alive (its process died; Ray restarts it there)"
        if worker.node_id in live_nodes
        else f"its node {node} is gone (Ray restarts it where its bundle fits again)"
    )
    return f"{worker.worker_id} lost: no answer ({short_error(exc)}); {where}"


def check_health(state: ClusterState, timeout: float = T.HEALTH_PING_S) -> dict:
    """Ping every worker; re-pair any that Ray restarted. Returns {"restarts", "healthy":
    {id: bool}, "restarted": [ids re-paired by this check]}."""
    workers = state.workers()
    refs = [w.handle.ping.remote() for w in workers]
    restarted = []
    for worker, ref in zip(workers, refs, strict=True):
        try:
            answer = ray.get(ref, timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - dead, restarting or hung
            answer = exc
        match verdict(worker, answer):
            case Verdict.LOST:
                if worker.worker_id in state.workers_by_id:  # not removed meanwhile
                    state.log(lost_line(worker, answer, live_node_ids()))
                worker.healthy = False
            case Verdict.STILL_LOST:
                worker.healthy = False
            case Verdict.RESTARTED:
                restarted.append(worker)
            case Verdict.BACK:
                state.log(f"{worker.worker_id} answers again")
                worker.healthy = True
            case Verdict.HEALTHY:
                worker.healthy = True
    repaired = []
    if restarted and state.apply_lock.acquire(blocking=False):
        try:
            for worker in restarted:
                if repair(state, worker, timeout):
                    repaired.append(worker)
            state.restarts += len(repaired)
        finally:
            state.apply_lock.release()
        state.save()
    else:
        for worker in restarted:  # an apply runs: re-paired by a later check, no requests
            worker.healthy = False
    return {
        "restarts": state.restarts,
        "healthy": {w.worker_id: w.healthy for w in workers},
        "restarted": [w.worker_id for w in repaired],
    }


def router_health(state: ClusterState) -> dict:
    """check_health for the router: "restarted" lists every worker re-paired since the
    router last asked, whichever check re-paired it (the router must forget the cache
    and load of each)."""
    health = check_health(state)
    with state.state_lock:
        restarted = sorted(state.unreported)
        state.unreported.clear()
    return {**health, "restarted": restarted}


def repair(state: ClusterState, worker: Worker, timeout: float) -> bool:
    """Pair a worker Ray restarted again with its peers; False (left unhealthy, tried
    again at the next check) if that fails."""
    logger.warning("worker %s was restarted; pairing it again", worker.worker_id)
    try:
        for ids in pairs_of(worker.worker_id, state.pairs):
            p, d = (state.workers_by_id[i] for i in ids)
            unpair(state, p, d)
            pair(state, p, d)
        incarnation, node = ray.get(
            [worker.handle.ping.remote(), worker.handle.node_id.remote()], timeout=timeout
        )
    except Exception as exc:  # noqa: BLE001 - a peer may be down too
        worker.healthy = False
        state.log(
            f"{worker.worker_id} was restarted, but pairing it again failed "
            f"({short_error(exc)}); trying again at the next health check"
        )
        return False
    moved = "" if node == worker.node_id else f" (was on node {short_node(worker.node_id)})"
    worker.incarnation, worker.node_id, worker.healthy = incarnation, node, True
    with state.state_lock:
        state.unreported.add(worker.worker_id)
    state.log(
        f"{worker.worker_id} was restarted by Ray on node {short_node(node)}{moved}; "
        "paired again and serving"
    )
    return True
