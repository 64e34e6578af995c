"""LocalCluster: Ray started in this process and a Baton cluster applied to it from a manifest
(the controller with its worker actors and the router actor serving gRPC) — what `baton
serve` and the demo run. `baton deploy` does the same on a Ray cluster that already runs."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

from deploy.manifest import Manifest, load_manifest, parse_manifest
from kvtransfer.worker_api import Role

LOCAL_MANIFEST = Path(__file__).resolve().parent.parent / "deploy" / "examples" / "local.yaml"
POOLS = tuple(Role)
# `baton serve` flag (a LocalOptions field) -> the manifest field it sets, spec.<section>.<key>;
# section "pools" sets the key of both pools. Type, description and choices are that field's.
SERVE_FLAGS = {
    "model": ("model", "path"),
    "prefill": ("prefill", "replicas"),
    "decode": ("decode", "replicas"),
    "host": ("router", "host"),
    "port": ("router", "port"),
    "policy": ("router", "policy"),
    "block_size": ("engine", "block_size"),
    "chunk_size": ("engine", "chunk_size"),
    "prefill_batch_tokens": ("engine", "prefill_batch_tokens"),
    "decode_stretch": ("engine", "decode_stretch"),
    "itl_target_ms": ("engine", "itl_target_ms"),
    "kv_cache_memory_gb": ("engine", "kv_cache_memory_gb"),
    "kv_tier": ("engine", "kv_tier"),
    "kv_tier_path": ("engine", "kv_tier_path"),
    "kv_tier_bytes": ("engine", "kv_tier_bytes"),
    "threads": ("pools", "threads"),
    "local_prefill_tokens": ("router", "local_prefill_tokens"),
    "migration_limit": ("router", "migration_limit"),
    "http_port": ("router", "http_port"),
    "max_pending_requests": ("router", "max_pending_requests"),
    "chat_template": ("router", "chat_template"),
}
# `baton serve --api-key KEY` puts the key in this variable of the serving process (the
# local cluster's router actor inherits it) and names it in spec.router.api_key_env: the
# key itself never goes into a manifest.
API_KEY_ENV = "BATON_API_KEY"


@dataclass
class LocalOptions:
    """`baton serve` flags (SERVE_FLAGS); None keeps the value of deploy/examples/local.yaml."""

    model: str | None = None
    prefill: int | None = None
    decode: int | None = None
    host: str | None = None
    port: int | None = None
    policy: str | None = None
    block_size: int | None = None
    chunk_size: int | None = None
    prefill_batch_tokens: int | None = None  # no other prompt joins a step with this many
    decode_stretch: float | None = None  # a step budget relative to the decode step (0: off)
    itl_target_ms: float | None = None  # an absolute step-time target instead
    kv_cache_memory_gb: float | None = None  # replaces the example's num_kv_blocks
    kv_tier: str | None = None  # none, host or disk (a KV tier below each worker's cache)
    kv_tier_path: str | None = None  # disk: the parent of the workers' tier directories
    kv_tier_bytes: int | None = None  # each worker's tier capacity
    threads: int | None = None  # torch threads per worker, both pools
    local_prefill_tokens: int | None = None  # conditional disaggregation threshold
    migration_limit: int | None = None  # moves of a request whose worker failed
    http_port: int | None = None  # the OpenAI-compatible HTTP front door
    max_pending_requests: int | None = None  # admission bound at the router
    chat_template: str | None = None  # a Jinja file replacing the tokenizer's template
    api_key: str | None = None  # clients must send it (see API_KEY_ENV)
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
        if self.kv_cache_memory_gb is not None:  # replaces the example's num_kv_blocks
            engine["num_kv_blocks"] = None
        for name, (section, key) in SERVE_FLAGS.items():
            value = getattr(self, name)
            if value is not None:
                for part in POOLS if section == "pools" else (section,):
                    spec[part][key] = value
        engine.update(extra)
        engine["max_num_batched_tokens"] = max(
            engine["max_num_batched_tokens"], engine["chunk_size"]
        )
        spec["transfer"].update(self.transfer)
        if self.api_key:
            spec["router"]["api_key_env"] = API_KEY_ENV
        resources = self.resources or default_resources()
        for role in POOLS:
            spec[role]["resources"] = dict(resources)
        return parse_manifest(data)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LocalOptions:
        """The options of parsed `baton serve` flags (add_serve_flags)."""
        return cls(
            **{name: getattr(args, name) for name in SERVE_FLAGS},
            api_key=getattr(args, "api_key", None),
        )


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """Add a --flag per SERVE_FLAGS entry: type, choices and help from the manifest field it
    sets (so from the option's one definition), its default shown as local.yaml's value."""
    local = load_manifest(LOCAL_MANIFEST).spec
    for name, (section, key) in SERVE_FLAGS.items():
        part = POOLS[0] if section == "pools" else section
        spec_field = type(getattr(local, part)).model_fields[key]
        where = "spec.<pool>" if section == "pools" else f"spec.{section}"
        value = getattr(getattr(local, part), key)
        shown = f"local.yaml: {value}"
        if name == "kv_cache_memory_gb":  # local.yaml sizes the KV cache in blocks instead
            shown = f"replaces local.yaml's num_kv_blocks: {local.engine.num_kv_blocks}"
        kind, choices = _flag_type(spec_field.annotation)
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=kind,
            choices=choices,
            help=f"{where}.{key}: {spec_field.description} ({shown})",
        )


def _flag_type(annotation) -> tuple[type, tuple | None]:
    """The argparse type and choices of a manifest field's annotation."""
    if get_origin(annotation) is Literal:
        return str, get_args(annotation)
    if get_origin(annotation) in (Union, UnionType):  # `int | None`: the flag sets the int
        (kind,) = [a for a in get_args(annotation) if a is not type(None)]
        return kind, None
    return annotation, None


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
        self.http_address: str | None = None  # e.g. http://127.0.0.1:8000, None without HTTP
        self._controller: Any = None  # the controller actor's handle, once started

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
            getattr(spec, r).replicas * getattr(spec, r).resources.get("CPU", 0) for r in POOLS
        )
        # always a new in-process cluster, even where RAY_ADDRESS is set
        start_local_ray(num_cpus=max(8, int(need) + 2), namespace=NAMESPACE)
        check_resources(self.manifest, ray.cluster_resources(), node_resources())
        shape = " (aggregated: decode workers prefill)" if not spec.prefill.replicas else ""
        log(
            f"starting {spec.prefill.replicas} prefill + {spec.decode.replicas} decode "
            f"workers{shape} on Ray ..."
        )
        self._controller = controller_handle(create=True)
        ray.get(self._controller.apply.remote(self.manifest.model_dump(mode="json")), timeout=900)
        status: dict = ray.get(self._controller.status.remote(), timeout=60)
        self.address = status["router"]["address"]
        self.port = int(self.address.rsplit(":", 1)[1])
        self.http_address = status["router"].get("http_address")
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
