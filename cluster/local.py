"""LocalCluster: Ray started in this process, the controller with its worker actors, and the
router actor serving gRPC — what `baton serve` and the demo run."""

from __future__ import annotations

import os
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
    resources: dict | None = None  # per worker; None: {"GPU": 1} if CUDA is visible else CPU
    transfer: dict = field(default_factory=dict)  # TransferOptions fields
    engine_extra: dict = field(default_factory=dict)


def default_resources() -> dict:
    """One GPU per worker where CUDA is visible (NCCL transfers), else one CPU."""
    import torch

    return {"GPU": 1} if torch.cuda.is_available() else {"CPU": 1}


class LocalCluster:
    """start() brings everything up; close() undoes it (router, workers, controller,
    placement group, Ray)."""

    def __init__(self, options: LocalOptions) -> None:
        self.options = options
        self.port: int | None = None
        self._router = None
        self._controller = None

    @property
    def address(self) -> str:
        return f"{self.options.host}:{self.port}"

    def start(self, log=print) -> LocalCluster:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        import ray

        from cluster.controller import NAMESPACE, ClusterSpec, start_controller
        from cluster.router_actor import ROUTER_NAME, RouterActor
        from engine.model_resolver import resolve_model

        o = self.options
        log(f"resolving {o.model} ...")
        resolve_model(o.model)  # a GGUF is converted once, before the workers load it
        ray.init(num_cpus=max(8, o.prefill + o.decode + 2), include_dashboard=False,
                 namespace=NAMESPACE, log_to_driver=False, configure_logging=False)
        log(f"starting {o.prefill} prefill + {o.decode} decode workers on Ray ...")
        engine = {"model": o.model, "kv_cache_memory_gb": o.kv_cache_memory_gb,
                  "chunk_size": o.chunk_size, "block_size": o.block_size, **o.engine_extra}
        self._controller = start_controller(ClusterSpec(
            engine=engine, num_prefill=o.prefill, num_decode=o.decode,
            resources=o.resources or default_resources(), transfer=dict(o.transfer),
            torch_threads=o.threads))
        self._router = RouterActor.options(name=ROUTER_NAME, namespace=NAMESPACE).remote(
            self._controller, {"model": o.model, "host": o.host, "port": o.port,
                               "policy": o.policy,
                               "local_prefill_tokens": o.local_prefill_tokens,
                               "skip_tokenizer": bool(o.engine_extra.get(
                                   "skip_tokenizer_init"))})
        self.port = ray.get(self._router.start.remote(), timeout=120)
        return self

    def close(self) -> None:
        import ray

        if self._router is not None:
            try:
                ray.get(self._router.stop.remote(), timeout=30)
            finally:
                ray.kill(self._router)
                self._router = None
        if self._controller is not None:
            ray.get(self._controller.shutdown.remote(), timeout=120)
            ray.kill(self._controller)
            self._controller = None
        ray.shutdown()
