"""TransferEndpoint: what a prefill and a decode worker share — an engine on its loop thread,
the pair groups to peers, the transfer engine, leases and peer control objects."""

from __future__ import annotations

import threading
from typing import Any

from engine import LLMEngine
from engine.engine_loop import EngineLoop
from kvtransfer.control import control_peer
from kvtransfer.group import GroupRegistry
from kvtransfer.lease import LeaseTable
from kvtransfer.options import TransferOptions
from kvtransfer.transfer import KVTransfer


class TransferEndpoint:
    """Base of the worker roles; subclasses add the role's control methods."""

    role = ""

    def __init__(
        self, worker_id: str, engine_options: dict | None = None, transfer: dict | None = None
    ) -> None:
        self.worker_id = worker_id
        self.options = TransferOptions(**(transfer or {}))
        self.engine = LLMEngine(**(engine_options or {}))
        self.loop = EngineLoop(self.engine).start()
        self.registry = GroupRegistry(
            self.engine.runner.device, self.options.backend, timeout=self.options.timeout_seconds
        )
        self.transfer = KVTransfer(self.registry)
        self.leases = LeaseTable()
        self._lock = threading.Lock()
        self._peers: dict[str, Any] = {}  # peer worker id -> its control object
        self._events: list[dict] = []  # KV events not yet taken by a router, oldest first
        self.loop.add_step_hook(self._after_step)

    def info(self) -> dict:
        cfg = self.engine.config
        return {
            "worker_id": self.worker_id,
            "role": self.role,
            "block_size": cfg.block_size,
            "hash_seed": cfg.hash_seed,
            "num_kv_blocks": self.engine.pool.num_blocks,
            "max_model_len": self.engine.max_model_len,
            "model": str(self.engine.model_dir),
            "backend": self.registry.backend,
        }

    def stats(self) -> dict:
        eng = self.engine
        return {
            "worker_id": self.worker_id,
            "role": self.role,
            "num_requests": eng.num_unfinished(),
            "kv_usage": eng.pool.usage(),
            "free_blocks": eng.pool.num_free_blocks,
            "num_blocks": eng.pool.num_blocks,
            "cache_queries": eng.pool.stats.queries,
            "cache_hits": eng.pool.stats.hits,
        }

    def kv_events(self) -> list[dict]:
        """Take the stored/removed block-hash events since the last call, oldest first."""
        with self._lock:
            events, self._events = self._events, []
        return events

    def check_integrity(self) -> None:
        self.loop.run(self.engine.check_integrity)

    def shutdown(self) -> None:
        for peer_id in list(self._peers):
            self._disconnect(peer_id)
        self.loop.stop()
        self.registry.close()

    def _attach_peer(self, peer_id: str, peer: Any) -> None:
        if peer is not None:
            self._peers[peer_id] = control_peer(peer)

    def _disconnect(self, peer_id: str) -> None:
        """Forget a peer: its control object and its pair group."""
        with self._lock:
            self._peers.pop(peer_id, None)
            if peer_id in self.registry:
                self.registry.remove(peer_id)

    def _after_step(self, result) -> None:
        if result.kv_events:
            with self._lock:
                self._events.extend(
                    {
                        "kind": e.kind,
                        "block_hashes": list(e.block_hashes),
                        "parent_hash": e.parent_hash,
                    }
                    for e in result.kv_events
                )
        self._expire_leases()

    def _expire_leases(self) -> None:
        """Runs on the loop thread after every step; subclasses free what expired."""
