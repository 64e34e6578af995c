"""TransferEndpoint: what a prefill and a decode worker share — an engine on its loop thread,
the pair groups to peers, the transfer engine, leases, peer workers (kvtransfer.worker_api) and
the one pool that carries one-way messages (ack, abort) to them."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engine import LLMEngine
from engine.engine_loop import EngineLoop
from engine.metrics import snapshot
from kvtransfer.group import GroupRegistry
from kvtransfer.lease import LeaseTable
from kvtransfer.metrics import TransferMetrics
from kvtransfer.options import TransferOptions
from kvtransfer.transfer import KVTransfer
from kvtransfer.worker_api import KVEvent, Role, WorkerInfo, WorkerStats
from kvtransfer.worker_client import as_worker

logger = logging.getLogger(__name__)
LOOPBACK = "127.0.0.1"  # where "auto" advertises outside Ray (the Ray actor passes the node IP)
NOTIFY_THREADS = 4  # a peer that does not answer holds one for at most its RPC timeout


class TransferEndpoint:
    """Base of the worker roles; subclasses add the role's control methods."""

    role: Role  # set by each role
    peer_role: Role  # the role of the workers it pairs with

    def __init__(
        self, worker_id: str, engine_options: dict | None = None, transfer: dict | None = None
    ) -> None:
        self.worker_id = worker_id
        self.options = TransferOptions(**(transfer or {}))
        self.engine = LLMEngine(**(engine_options or {}))
        self.loop = EngineLoop(self.engine)  # started below, once its step hook is in place
        self.registry = GroupRegistry(
            self.engine.runner.device,
            self.options.backend,
            host=LOOPBACK if self.options.advertise_host == "auto" else self.options.advertise_host,
            timeout=self.options.timeout_seconds,
        )
        self.transfer = KVTransfer(self.registry)
        self.transfer_metrics = TransferMetrics()  # bytes, blocks, failures, hand-over time
        self.leases = LeaseTable()
        self._lock = threading.Lock()
        self._peers: dict[str, Any] = {}  # peer worker id -> its PrefillAPI / DecodeAPI
        self._events: list[KVEvent] = []  # not yet taken by a router, oldest first
        # One-way messages to peers run here, never on the caller's thread: the caller may be
        # the engine loop or a receive loop, and a peer may be slow to answer.
        self._notifier = ThreadPoolExecutor(
            NOTIFY_THREADS, thread_name_prefix=f"notify-{worker_id}"
        )
        # Before the loop starts: its first idle tick carries the KV events of start-up (a
        # disk tier's re-indexed blocks), which must reach self._events.
        self.loop.add_step_hook(self._after_step)
        self.loop.start()

    def info(self) -> WorkerInfo:
        """Identity and cache geometry; constant while the worker runs."""
        cfg = self.engine.config
        return WorkerInfo(
            worker_id=self.worker_id,
            role=self.role,
            block_size=cfg.block_size,
            hash_seed=cfg.hash_seed,
            num_kv_blocks=self.engine.pool.num_blocks,
            max_model_len=self.engine.max_model_len,
            model=str(self.engine.model_dir),
            backend=self.registry.backend,
        )

    def stats(self) -> WorkerStats:
        """Load and counters now."""
        eng = self.engine
        return WorkerStats(
            worker_id=self.worker_id,
            role=self.role,
            num_requests=eng.num_unfinished(),
            kv_usage=eng.pool.usage(),
            free_blocks=eng.pool.num_free_blocks,
            num_blocks=eng.pool.num_blocks,
            cache_queries=eng.pool.stats.queries,
            cache_hits=eng.pool.stats.hits,
            **self._tier_stats(),
            **self._role_stats(),
        )

    def _tier_stats(self) -> dict:
        """The KV tier's WorkerStats fields (none without a tier)."""
        if self.engine.kv_tier is None:
            return {}
        t = self.engine.kv_tier.stats()
        return {
            "tier_medium": t.medium,
            "tier_capacity_bytes": t.capacity_bytes,
            "tier_usage_bytes": t.usage_bytes,
            "tier_blocks": t.num_blocks,
            "tier_queries": t.queries,
            "tier_hits": t.hits,
            "tier_blocks_read": t.blocks_read,
        }

    def kv_events(self) -> list[KVEvent]:
        """Take the stored/removed block-hash events since the last call, oldest first."""
        with self._lock:
            events, self._events = self._events, []
        return events

    def metrics(self) -> list[dict]:
        """This worker's Prometheus families (engine and KV transfer) as plain values
        (engine.metrics.snapshot); the router merges every worker's into one scrape."""
        return snapshot(self.engine.metrics.registry, self.transfer_metrics.registry)

    def check_integrity(self) -> None:
        """Raise unless the block pool's accounting adds up."""
        self.loop.run(self.engine.check_integrity)

    def shutdown(self) -> None:
        """Leave the peers, stop the engine loop and close the engine (a disk KV tier first
        receives the blocks the KV cache holds, then its directory is unlocked)."""
        for peer_id in list(self._peers):
            self._disconnect(peer_id)
        stopped = self.loop.stop()
        self.registry.close()
        self._notifier.shutdown(wait=False, cancel_futures=True)
        if stopped:
            self.engine.close()
        else:  # a step still runs: the process exit releases the tier
            logger.warning(
                "worker %s: the engine loop did not stop; engine not closed", self.worker_id
            )

    def _role_stats(self) -> dict:
        """The role's own WorkerStats fields."""
        return {}

    def _attach_peer(self, peer_id: str, peer: Any) -> None:
        if peer is not None:
            self._peers[peer_id] = as_worker(peer, self.peer_role)

    def _notify_peer(self, peer_id: str, what: str, send: Callable[[Any], object]) -> None:
        """Run send(peer) for a connected peer on the notifier pool; `what` names it in the
        log. A lost message is covered by the peer's lease, so a failure is only logged."""
        peer = self._peers.get(peer_id)
        if peer is None:
            return

        def run() -> None:
            try:
                send(peer)
            except Exception as exc:  # noqa: BLE001 - the peer's lease covers a lost message
                logger.warning("%s to peer %s failed: %s", what, peer_id, exc)

        try:
            self._notifier.submit(run)
        except RuntimeError:  # shut down: the peer's lease covers it
            pass

    def _disconnect(self, peer_id: str) -> None:
        """Forget a peer: its control object and its pair group."""
        with self._lock:
            self._peers.pop(peer_id, None)
            if peer_id in self.registry:
                self.registry.remove(peer_id)

    def _after_step(self, result) -> None:
        if result.kv_events:
            with self._lock:
                self._events.extend(result.kv_events)
        self._expire_leases()

    def _expire_leases(self) -> None:
        """Runs on the loop thread after every step; subclasses free what expired."""
