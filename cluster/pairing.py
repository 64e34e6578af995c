"""Prefill/decode pairs: every active prefill worker is paired with every active decode worker
of the same KV key (cluster/templates.py: kv_key), each pair a 2-rank torch.distributed group
set up by the two workers themselves (kvtransfer), so KV never moves through Ray."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import ray

from cluster import timeouts as T
from cluster.ray_peer import RayPeer
from cluster.state import ClusterState
from cluster.worker_actor import Worker

logger = logging.getLogger(__name__)


def missing_pairs(
    prefill: Sequence[Worker], decode: Sequence[Worker], pairs: Iterable[tuple[str, str]]
) -> list[tuple[Worker, Worker]]:
    """The (prefill, decode) workers of the same KV key not paired yet, prefill-major in the
    order given."""
    have = set(pairs)
    return [
        (p, d)
        for p in prefill
        for d in decode
        if p.template.kv_key == d.template.kv_key and (p.worker_id, d.worker_id) not in have
    ]


def pairs_of(worker_id: str, pairs: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The pairs a worker is in."""
    return [pair for pair in pairs if worker_id in pair]


def ensure_pairs(state: ClusterState) -> None:
    """Pair every active prefill worker with every active decode worker of the same KV key
    that it is not paired with yet (also mends what a failed apply left)."""
    for p, d in missing_pairs(state.active("prefill"), state.active("decode"), state.pairs):
        pair(state, p, d)


def pair(state: ClusterState, p: Worker, d: Worker) -> None:
    """Set up the pair's group: the prefill worker hosts it, the decode worker joins."""
    address = ray.get(
        p.handle.connect_decode.remote(d.worker_id, RayPeer(d.handle)), timeout=T.PAIR_S
    )
    ray.get(
        d.handle.connect_prefill.remote(p.worker_id, address, RayPeer(p.handle)),
        timeout=T.PAIR_S,
    )
    with state.state_lock:
        state.pairs.add((p.worker_id, d.worker_id))
    state.save()


def unpair(state: ClusterState, p: Worker, d: Worker) -> None:
    """Forget the pair and tear its group down on both sides (a dead side is skipped)."""
    with state.state_lock:
        state.pairs.discard((p.worker_id, d.worker_id))
    state.save()
    for call in (
        d.handle.disconnect_prefill.remote(p.worker_id),
        p.handle.disconnect_decode.remote(d.worker_id),
    ):
        try:
            ray.get(call, timeout=T.UNPAIR_S)
        except Exception as exc:  # noqa: BLE001 - a dead peer has nothing to tear down
            logger.warning("unpairing %s and %s: %s", p.worker_id, d.worker_id, exc)
