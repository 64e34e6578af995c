"""Router: picks the prefill and decode worker of each request and streams its tokens.

Transport-agnostic: workers are control objects (in-process workers, RPC clients or
cluster.ray_peer.RayPeer wrappers). The prefill choice uses a KV index built from the
workers' own stored/removed events, the queued prefill tokens counted from dispatch, and the
named policy; the decode choice uses free blocks, running requests and the decode worker's
own cached prefix. The gRPC front door (cluster issue) sits on top of this class.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from engine.block_hash import hash_prompt_blocks
from router.handoff import generate_disaggregated, generate_local
from router.kv_index import KVIndex
from router.policy import (
    DecodeLoad,
    LoadTracker,
    Policy,
    WorkerLoad,
    choose_decode,
    choose_prefill,
    make_policy,
)


class Router:
    """Routes requests over a fixed set of prefill and decode workers."""

    def __init__(self, prefill: dict[str, Any], decode: dict[str, Any], *, block_size: int,
                 hash_seed: str, policy: str | Policy = "cache_aware",
                 timeout: float = 600.0, local_prefill_tokens: int = 0) -> None:
        self.prefill = dict(prefill)
        self.decode = dict(decode)
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.timeout = timeout
        # Conditional disaggregation: when the chosen decode worker's uncached tail is at
        # most this many tokens, it prefills locally and no KV moves (0 = always transfer).
        self.local_prefill_tokens = local_prefill_tokens
        self.index = KVIndex()
        self.load = LoadTracker()
        self._lock = threading.Lock()  # index updates: events must apply in emission order
        for worker_id in [*self.prefill, *self.decode]:
            self.index.add_worker(worker_id)
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        # request id -> (prefill id or None when prefilled locally, decode id)
        self._active: dict[str, tuple[str | None, str]] = {}
        self._healthy: dict[str, bool] = {}  # from the controller; unknown = healthy

    def update_membership(self, health: dict) -> None:
        """Apply the controller's check_health(): restarted workers start with an empty cache,
        unhealthy ones get no new requests."""
        with self._lock:
            for worker_id in health.get("restarted", []):
                self.index.remove_worker(worker_id)
                self.index.add_worker(worker_id)
                self.load.forget(worker_id)
            self._healthy.update(health.get("healthy", {}))

    def abort(self, request_id: str) -> bool:
        """Abort a running request on its decode worker (which tells the prefill worker)."""
        workers = self._active.get(request_id)
        if workers is None:
            return False
        prefill_id, decode_id = workers
        self.decode[decode_id].abort(request_id)
        if prefill_id is not None:
            self.prefill[prefill_id].abort(request_id)
        return True

    def status(self) -> list[dict]:
        """Every worker's stats with its role and health."""
        out = []
        for role, pool in (("prefill", self.prefill), ("decode", self.decode)):
            for worker_id, worker in pool.items():
                try:
                    stats, healthy = worker.stats(), True
                except Exception as exc:  # noqa: BLE001 - reported as unhealthy
                    stats, healthy = {"error": str(exc)}, False
                out.append({**stats, "worker_id": worker_id, "role": role, "healthy": healthy})
        return out

    def hit_rate(self) -> float:
        """Prompt tokens served from prefill workers' prefix caches / all prompt tokens."""
        return self.num_cached_tokens / max(1, self.num_prompt_tokens)

    def refresh_index(self) -> None:
        """Apply every worker's KV events published since the last refresh."""
        with self._lock:
            for worker_id, worker in [*self.prefill.items(), *self.decode.items()]:
                self.index.apply(worker_id, worker.kv_events())

    def generate(self, request_id: str, prompt_token_ids: list[int], params: dict,
                 cache_salt: str | None = None) -> Iterator[dict]:
        """Output dicts of one request; the last carries prefill_worker and decode_worker."""
        hashes = hash_prompt_blocks(prompt_token_ids, self.block_size, self.hash_seed,
                                    cache_salt)
        n = len(prompt_token_ids)
        self.refresh_index()
        healthy = lambda w: self._healthy.get(w, True)  # noqa: E731
        loads = [WorkerLoad(w, self.load.queued(w), healthy=healthy(w)) for w in self.prefill]
        choice = choose_prefill(self.policy, hashes, self.block_size, loads, self.index,
                                num_prompt_tokens=n)
        decode_loads = [DecodeLoad(w, (s := d.stats())["free_blocks"], s["num_requests"])
                        if healthy(w) else DecodeLoad(w, 0, 0, healthy=False)
                        for w, d in self.decode.items()]
        decode_choice = choose_decode(hashes, n, self.block_size, decode_loads, self.index)
        local_tail = n - decode_choice.hit_blocks * self.block_size
        if local_tail <= self.local_prefill_tokens:
            yield from self._generate_local(request_id, prompt_token_ids, params, cache_salt,
                                            decode_choice.worker_id)
            return
        uncached = n - choice.cached_tokens
        self.load.dispatched(choice.worker_id, uncached)  # load counts from dispatch
        self._active[request_id] = (choice.worker_id, decode_choice.worker_id)
        prefilled = False
        try:
            for out in generate_disaggregated(
                    self.prefill[choice.worker_id], self.decode[decode_choice.worker_id],
                    request_id, prompt_token_ids, params, prefill_id=choice.worker_id,
                    decode_id=decode_choice.worker_id, cache_salt=cache_salt,
                    timeout=self.timeout):
                if not prefilled:
                    prefilled = True
                    self.load.prefilled(choice.worker_id, uncached)
                    self._count(n, out["num_cached_tokens"])
                if out["finished"]:
                    out.update(prefill_worker=choice.worker_id,
                               decode_worker=decode_choice.worker_id, prompt_tokens=n)
                yield out
        finally:
            self._active.pop(request_id, None)
            if not prefilled:
                self.load.prefilled(choice.worker_id, uncached)

    def _generate_local(self, request_id: str, prompt_token_ids: list[int], params: dict,
                        cache_salt: str | None, decode_id: str) -> Iterator[dict]:
        self._active[request_id] = (None, decode_id)
        counted = False
        try:
            for out in generate_local(self.decode[decode_id], request_id, prompt_token_ids,
                                      params, cache_salt=cache_salt, timeout=self.timeout):
                if not counted:
                    counted = True
                    self._count(len(prompt_token_ids), out["num_cached_tokens"])
                if out["finished"]:
                    out.update(prefill_worker=decode_id, decode_worker=decode_id,
                               prompt_tokens=len(prompt_token_ids))
                yield out
        finally:
            self._active.pop(request_id, None)

    def _count(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.num_prompt_tokens += prompt_tokens
        self.num_cached_tokens += cached_tokens
