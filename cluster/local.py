"""LocalCluster: Ray started in this process and a Baton cluster applied to it from a manifest
(the controller with its worker actors and the router actor serving gRPC) — what `baton
serve` and the demo run. `baton deploy` does the same on a Ray cluster that already runs."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from deploy.manifest import Manifest, load_manifest, parse_manifest

LOCAL_MANIFEST = Path(__file__).resolve().parent.parent / "deploy" / "examples" / "local.yaml"


@dataclass
class LocalOptions:
    """`baton serve` flags; None keeps the value of deploy/examples/local.yaml."""

    model: str | None = None
    prefill: int | None = None
    decode: int | None = None
    host: str | None = None
    port: int | None = None
    policy: str | None = None
    block_size: int | None = None
    chunk_size: int | None = None
    kv_cache_memory_gb: float | None = None  # replaces the example's num_kv_blocks
    threads: int | None = None  # torch threads per worker
    local_prefill_tokens: int | None = None  # conditional disaggregation threshold
    resources: dict | None = None  # per worker; None: {"GPU": 1} if CUDA is visible
    transfer: dict = field(default_factory=dict)  # TransferSpec fields
    engine_extra: dict = field(default_factory=dict)  # EngineSpec fields, skip_tokenizer_init

    def manifest(self) -> Manifest:
        """local.yaml with these options applied (validated)."""
        data = load_manifest(LOCAL_MANIFEST).model_dump(mode="json")
        spec = data["spec"]
        engine, extra = spec["engine"], dict(self.engine_extra)
        for key in ("skip_tokenizer_init", "dtype"):
            if key in extra:
                spec["model"][key] = extra.pop(key)
        if self.kv_cache_memory_gb is not None:
            engine["kv_cache_memory_gb"] = self.kv_cache_memory_gb
            engine["num_kv_blocks"] = None
        values = {
            ("model", "path"): self.model,
            ("prefill", "replicas"): self.prefill,
            ("decode", "replicas"): self.decode,
            ("router", "host"): self.host,
            ("router", "port"): self.port,
            ("router", "policy"): self.policy,
            ("router", "local_prefill_tokens"): self.local_prefill_tokens,
            ("engine", "block_size"): self.block_size,
            ("engine", "chunk_size"): self.chunk_size,
        }
        for (section, key), value in values.items():
            if value is not None:
                spec[section][key] = value
        engine.update(extra)
        engine["max_num_batched_tokens"] = max(
            engine["max_num_batched_tokens"], engine["chunk_size"]
        )
        spec["transfer"].update(self.transfer)
        resources = self.resources or default_resources()
        for role in ("prefill", "decode"):
            spec[role]["resources"] = dict(resources)
            if self.threads is not None:
                spec[role]["threads"] = self.threads
        return parse_manifest(data)


def default_resources() -> dict:
    """One GPU per worker where CUDA is visible (NCCL transfers), else one CPU."""
    import torch

    return {"GPU": 1} if torch.cuda.is_available() else {"CPU": 1}


class LocalCluster:
    """start() brings everything up; close() undoes it (router, workers, controller,
    placement groups, Ray)."""

    def __init__(self, options: LocalOptions | Manifest) -> None:
        self.manifest = options if isinstance(options, Manifest) else options.manifest()
        self.address: str | None = None
        self.port: int | None = None
        self._controller = None

    def start(self, log=print) -> LocalCluster:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        import ray

        from cluster.controller import NAMESPACE, controller_handle, node_resources
        from cluster.local_ray import start_local_ray
        from deploy.manifest import check_resources
        from engine.model_resolver import resolve_model

        spec = self.manifest.spec
        log(f"resolving {spec.model.path} ...")
        resolve_model(spec.model.path)  # a GGUF is converted once, before workers load it
        need = sum(
            getattr(spec, r).replicas * getattr(spec, r).resources.get("CPU", 0)
            for r in ("prefill", "decode")
        )
        # always a new in-process cluster, even where RAY_ADDRESS is set
        start_local_ray(num_cpus=max(8, int(need) + 2), namespace=NAMESPACE)
        check_resources(self.manifest, ray.cluster_resources(), node_resources())
        log(
            f"starting {spec.prefill.replicas} prefill + {spec.decode.replicas} decode "
            "workers on Ray ..."
        )
        self._controller = controller_handle(create=True)
        ray.get(self._controller.apply.remote(self.manifest.model_dump(mode="json")), timeout=900)
        status = ray.get(self._controller.status.remote(), timeout=60)
        self.address = status["router"]["address"]
        self.port = int(self.address.rsplit(":", 1)[1])
        return self

    def close(self) -> None:
        import ray

        if self._controller is not None:
            try:
                ray.get(self._controller.shutdown.remote(), timeout=120)
            finally:
                ray.kill(self._controller)
                self._controller = None
        ray.shutdown()
