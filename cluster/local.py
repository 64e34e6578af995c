"""LocalCluster: Ray started in this process, the controller's workers, a Router and the
gRPC server — what `baton serve` and the demo run."""

from __future__ import annotations

import asyncio
import os
import threading
from dataclasses import dataclass, field


@dataclass
class LocalOptions:
    """What `baton serve` takes on the command line."""

    model: str = "smollm2-135m-instruct"
    prefill: int = 1
    decode: int = 1
    host: str = "127.0.0.1"
    port: int = 50051
    policy: str = "cache_aware"
    block_size: int = 16
    chunk_size: int = 1024
    kv_cache_memory_gb: float = 1.0
    threads: int = 1
    local_prefill_tokens: int = 0  # conditional disaggregation threshold (0: always transfer)
    engine_extra: dict = field(default_factory=dict)


class LocalCluster:
    """Start with start(); the gRPC server runs on its own event-loop thread; close() undoes
    everything (server, workers, controller, placement group, Ray)."""

    def __init__(self, options: LocalOptions) -> None:
        self.options = options
        self.port: int | None = None
        self._loop = asyncio.new_event_loop()
        self._server = None
        self._controller = None
        self._stop = threading.Event()

    @property
    def address(self) -> str:
        return f"{self.options.host}:{self.port}"

    def start(self, log=print) -> LocalCluster:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        import ray

        from cluster.controller import NAMESPACE, ClusterSpec, start_controller
        from cluster.ray_peer import RayPeer
        from engine.model_resolver import resolve_model
        from engine.tokenizer import load_tokenizer
        from router.router import Router
        from router.server import start_server

        o = self.options
        log(f"resolving {o.model} ...")
        model_dir = resolve_model(o.model)  # a GGUF is converted once, before workers load it
        tokenizer = None if o.engine_extra.get("skip_tokenizer_init") else load_tokenizer(
            model_dir)
        ray.init(num_cpus=max(8, o.prefill + o.decode + 2), include_dashboard=False,
                 namespace=NAMESPACE, log_to_driver=False, configure_logging=False)
        log(f"starting {o.prefill} prefill + {o.decode} decode workers on Ray ...")
        engine = {"model": o.model, "kv_cache_memory_gb": o.kv_cache_memory_gb,
                  "chunk_size": o.chunk_size, "block_size": o.block_size, **o.engine_extra}
        self._controller = start_controller(ClusterSpec(
            engine=engine, num_prefill=o.prefill, num_decode=o.decode, resources={"CPU": 1},
            torch_threads=o.threads))
        workers = ray.get(self._controller.workers.remote())
        peers = {w["worker_id"]: RayPeer(ray.get(self._controller.handle.remote(w["worker_id"])))
                 for w in workers}
        roles = {w["worker_id"]: w["role"] for w in workers}
        info = next(iter(peers.values())).info()
        self.router = Router({i: p for i, p in peers.items() if roles[i] == "prefill"},
                             {i: p for i, p in peers.items() if roles[i] == "decode"},
                             block_size=info["block_size"], hash_seed=info["hash_seed"],
                             policy=o.policy, local_prefill_tokens=o.local_prefill_tokens)
        threading.Thread(target=self._loop.run_forever, daemon=True).start()
        threading.Thread(target=self._watch, daemon=True, name="health").start()
        self._server, self.port = asyncio.run_coroutine_threadsafe(
            start_server(self.router, o.host, o.port, tokenizer, info.get("max_model_len")),
            self._loop).result(60)
        return self

    def _watch(self, period_s: float = 2.0) -> None:
        """Every period: the controller pings the workers (re-pairing restarted ones) and the
        router learns who is healthy and whose cache was lost."""
        import ray

        while not self._stop.wait(period_s):
            try:
                health = ray.get(self._controller.check_health.remote(), timeout=60)
            except Exception:  # noqa: BLE001 - shutting down, or the controller is busy
                continue
            self.router.update_membership(health)

    def close(self) -> None:
        import ray

        self._stop.set()
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(5), self._loop).result(30)
            self._server = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._controller is not None:
            ray.get(self._controller.shutdown.remote(), timeout=120)
            self._controller = None
        ray.shutdown()
