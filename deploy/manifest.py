"""The Baton cluster manifest (YAML), validated by pydantic models.

Unknown fields are errors; every error names the field path, the bad value and what is
allowed (ManifestError). spec.model, spec.engine and spec.transfer are derived from the one
definition of each option (engine/options.py, kvtransfer/options.py: type, default,
description, bounds), spec.router.policy's names from router/policy_names.py. Cross-field
checks: the engine's own (chunk size within the step budget); prefill and decode use the same
block size and hash seed (the router hashes prompts with them); resources must be placeable on
the Ray cluster (check_resources, given what the cluster has).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from engine.errors import InvalidRequestError
from engine.options import EngineOptions
from kvtransfer.options import TransferOptions
from router.policy_names import DEFAULT_POLICY, POLICY_DESCRIPTION, PolicyName


class ManifestError(ValueError):
    """A manifest that cannot be used; the message lists every problem, one per line."""


class _Strict(BaseModel):
    # strict: YAML's true is not a replica count and "16" is not a block size
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


# engine options that are not fields of spec.engine, and where each one is set instead
ENGINE_OPTIONS_ELSEWHERE = {
    "model": "spec.model.path",
    "dtype": "spec.model.dtype",
    "skip_tokenizer_init": "spec.model.skip_tokenizer_init",
    "num_threads": "spec.<pool>.threads (default 1 per worker)",
    "device": "not in the manifest: auto, the device of the worker's bundle",
    "seed": "not in the manifest: the engine's default",
    "attention_backend": "not in the manifest: auto for the worker's device",
}
MODEL_FIELDS = {"path": "model", "dtype": "dtype", "skip_tokenizer_init": "skip_tokenizer_init"}
ENGINE_FIELDS = {
    f.name: f.name
    for f in dataclasses.fields(EngineOptions)
    if f.name not in ENGINE_OPTIONS_ELSEWHERE
}


def option_fields(options: type, names: Mapping[str, str]) -> dict[str, Any]:
    """Pydantic field definitions (manifest name -> (type, Field)) of the named options of an
    options dataclass: its type (choices become a Literal), default, description and bounds."""
    by_name = {f.name: f for f in dataclasses.fields(options)}
    out = {}
    for spec_name, option_name in names.items():
        f = by_name[option_name]
        meta = f.metadata
        annotation = Literal[meta["choices"]] if "choices" in meta else f.type
        rules = {k: meta[k] for k in ("ge", "gt", "le", "min_length") if k in meta}
        out[spec_name] = (annotation, Field(f.default, description=meta["description"], **rules))
    return out


class _EngineChecks(_Strict):
    @model_validator(mode="after")
    def _engine_accepts(self) -> _EngineChecks:
        """The engine's own cross-field checks (e.g. chunk_size <= max_num_batched_tokens)."""
        try:
            EngineOptions(**self.model_dump())
        except InvalidRequestError as exc:
            raise ValueError(str(exc)) from None
        return self


if TYPE_CHECKING:  # create_model's fields (EngineOptions') are not visible to a type checker

    class ModelSpec(_Strict):
        def __getattr__(self, name: str) -> Any: ...

    class EngineSpec(_EngineChecks):
        def __getattr__(self, name: str) -> Any: ...

else:
    ModelSpec = create_model(
        "ModelSpec",
        __base__=_Strict,
        __module__=__name__,
        __doc__="What every worker serves (engine options model, dtype, skip_tokenizer_init).",
        **option_fields(EngineOptions, MODEL_FIELDS),
    )
    EngineSpec = create_model(
        "EngineSpec",
        __base__=_EngineChecks,
        __module__=__name__,
        __doc__="Engine options of a pool: EngineOptions less ENGINE_OPTIONS_ELSEWHERE.",
        **option_fields(EngineOptions, ENGINE_FIELDS),
    )
TransferSpec = create_model(
    "TransferSpec",
    __base__=_Strict,
    __module__=__name__,
    __doc__="How workers move KV (TransferOptions).",
    **option_fields(TransferOptions, {f.name: f.name for f in dataclasses.fields(TransferOptions)}),
)


# The fewest workers a pool may have: with 0 prefill workers the cluster is aggregated (every
# request is prefilled on its decode worker); decoding always needs a worker.
MIN_REPLICAS = {"prefill": 0, "decode": 1}


class PoolSpec(_Strict):
    replicas: int = Field(
        1, ge=MIN_REPLICAS["decode"], le=256, description="number of workers in the pool"
    )
    # The default is a float like every validated amount: a worker started from it keeps its
    # template key when the stored manifest is parsed again (scale).
    resources: dict[str, float] = Field(
        default_factory=lambda: {"CPU": 1.0},
        description="Ray resources of each worker's bundle, e.g. {CPU: 1} or {GPU: 1}",
    )
    engine: EngineSpec | None = Field(
        None, description="engine options for this pool only (overrides spec.engine)"
    )
    threads: int = Field(
        1, ge=1, le=256, description="torch intra-op threads per worker (CPU); match resources.CPU"
    )

    @model_validator(mode="after")
    def _positive_resources(self) -> PoolSpec:
        bad = {k: v for k, v in self.resources.items() if v <= 0}
        if bad or not self.resources:
            raise ValueError(
                f"resources must name at least one resource with an amount > 0, "
                f"got {dict(self.resources)}"
            )
        return self


class PrefillPoolSpec(PoolSpec):
    replicas: int = Field(
        1,
        ge=MIN_REPLICAS["prefill"],
        le=256,
        description="number of prefill workers (0: aggregated, every request is prefilled "
        "on its decode worker and no KV moves)",
    )


class TLSSpec(_Strict):
    cert_file: str = Field(description="PEM certificate chain of the server (on the head node)")
    key_file: str = Field(description="PEM private key of the server (on the head node)")
    client_ca_file: str | None = Field(
        None, description="PEM CA bundle: when set, clients must present a certificate it signed"
    )


class RouterSpec(_Strict):
    policy: PolicyName = Field(DEFAULT_POLICY, description=POLICY_DESCRIPTION)
    host: str = Field("127.0.0.1", description="gRPC listen address")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port (0: any free port)")
    local_prefill_tokens: int = Field(
        0,
        ge=0,
        description="conditional disaggregation: prefill on the decode worker (no KV transfer) "
        "when a prompt's uncached tail is at most this many tokens (0: always transfer)",
    )
    wait_for_workers_seconds: float = Field(
        120.0,
        ge=0,
        description="how long a request waits for a healthy worker in each "
        "pool (one being replaced or restarted; then UNAVAILABLE) and for a decode worker "
        "with free KV blocks for its prompt (then RESOURCE_EXHAUSTED)",
    )
    migration_limit: int = Field(
        3,
        ge=0,
        description="how many times a request moves to other workers when its worker dies or "
        "stops answering (it continues from the tokens already streamed); past it the client "
        "gets UNAVAILABLE naming the failed workers (0: never move)",
    )
    http_port: int | None = Field(
        8000,
        ge=0,
        le=65535,
        description="OpenAI-compatible HTTP port on the router's host (0: any free port; "
        "null: no HTTP front door)",
    )
    served_model_name: str | None = Field(
        None,
        description="the model name clients send (`model` in OpenAI requests; default: "
        "spec.model.path)",
    )
    model_aliases: list[str] = Field(
        default_factory=list, description="other names clients may send for the same model"
    )
    api_key_env: str | None = Field(
        None,
        description="name of an environment variable on the head node holding the API keys "
        "(comma-separated); the keys themselves never go in the manifest",
    )
    api_key_file: str | None = Field(
        None,
        description="path on the head node of a file holding the API keys (one per line)",
    )
    tls: TLSSpec | None = Field(
        None, description="TLS for both front doors (gRPC and HTTP) from cert/key files"
    )
    max_pending_requests: int | None = Field(
        None,
        ge=1,
        description="admission: most requests waiting at the router for their first token; "
        "past it new requests get 429 / RESOURCE_EXHAUSTED at once (null: no bound)",
    )
    chat_template: str | None = Field(
        None,
        min_length=1,
        description="path on the head node of a Jinja chat template that replaces the "
        "tokenizer's at both doors (one that uses `tools` renders tools itself; otherwise "
        "tools are folded into the turns in the Hermes format; null: the tokenizer's, else "
        "ChatML)",
    )


class ClusterSpecModel(_Strict):
    model: ModelSpec = Field(default_factory=ModelSpec, description="what every worker serves")
    engine: EngineSpec = Field(
        default_factory=EngineSpec, description="engine options of both pools"
    )
    prefill: PrefillPoolSpec = Field(
        default_factory=PrefillPoolSpec, description="the prefill pool (0 replicas: aggregated)"
    )
    decode: PoolSpec = Field(default_factory=PoolSpec, description="the decode pool")
    router: RouterSpec = Field(
        default_factory=RouterSpec, description="the front doors (gRPC, OpenAI HTTP) and routing"
    )
    transfer: TransferSpec = Field(
        default_factory=TransferSpec, description="KV transfer between the pools"
    )
    drain_timeout_seconds: float = Field(
        600.0,
        gt=0,
        description="scale-down: how long a leaving worker may take to finish its requests",
    )

    def engine_for(self, role: str) -> EngineSpec:
        """The engine options of the prefill or decode pool (its own, else spec.engine)."""
        pool = self.prefill if role == "prefill" else self.decode
        return pool.engine or self.engine

    @model_validator(mode="after")
    def _same_hashing(self) -> ClusterSpecModel:
        p, d = self.engine_for("prefill"), self.engine_for("decode")
        for name in ("block_size", "hash_seed"):
            if getattr(p, name) != getattr(d, name):
                raise ValueError(
                    f"prefill and decode must use the same {name} (the router "
                    f"hashes prompts with it): prefill has {getattr(p, name)!r}, "
                    f"decode has {getattr(d, name)!r}"
                )
        return self


class Metadata(_Strict):
    name: str = Field(
        ...,
        min_length=1,
        max_length=63,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        description="cluster name (DNS label)",
    )


class Manifest(_Strict):
    """apiVersion baton/v1, kind Cluster."""

    apiVersion: Literal["baton/v1"] = Field(..., description="manifest schema version")  # noqa: N815
    kind: Literal["Cluster"] = Field(..., description="what the manifest describes")
    metadata: Metadata = Field(..., description="the cluster's name")
    spec: ClusterSpecModel = Field(
        default_factory=ClusterSpecModel, description="the desired cluster"
    )


def _format(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "(manifest)"
        value = e.get("input")
        shown = "missing" if e["type"] == "missing" else repr(value)
        if e["type"] == "extra_forbidden":
            lines.append(f"{path}: unknown field (value {shown}); remove it or check spelling")
        else:
            lines.append(f"{path}: {shown} is invalid: {e['msg']}")
    return "\n".join(lines)


def parse_manifest(data: dict | str) -> Manifest:
    """Validate a manifest (a dict, or YAML text); raises ManifestError."""
    if isinstance(data, str):
        try:
            data = yaml.safe_load(data)
        except yaml.YAMLError as exc:
            raise ManifestError(f"not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ManifestError(f"a manifest is a mapping, got {type(data).__name__}")
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        raise ManifestError(_format(exc)) from None


def load_manifest(path: str | Path) -> Manifest:
    """Read and validate a manifest file."""
    path = Path(path)
    if not path.is_file():
        raise ManifestError(f"{path}: no such manifest file")
    return parse_manifest(path.read_text())


def check_resources(
    manifest: Manifest, cluster: dict[str, float], nodes: list[dict[str, float]] | None = None
) -> None:
    """Raise ManifestError if the pools can never be placed on a cluster with these total
    resources (e.g. ray.cluster_resources()) or, given the nodes' own totals, if no single
    node can hold one worker's bundle."""
    need: dict[str, float] = {}
    problems = []
    for role in ("prefill", "decode"):
        pool = getattr(manifest.spec, role)
        if not pool.replicas:  # an empty pool places nothing
            continue
        for name, amount in pool.resources.items():
            if cluster.get(name, 0) < amount:
                problems.append(
                    f"spec.{role}.resources.{name}: {amount:g} per worker, but "
                    f"the Ray cluster has {cluster.get(name, 0):g} in total"
                )
            elif nodes and max(n.get(name, 0) for n in nodes) < amount:
                problems.append(
                    f"spec.{role}.resources.{name}: {amount:g} per worker, but no "
                    f"node has more than {max(n.get(name, 0) for n in nodes):g}"
                )
            need[name] = need.get(name, 0) + amount * pool.replicas
        if (
            nodes
            and not any(all(n.get(k, 0) >= v for k, v in pool.resources.items()) for n in nodes)
            and not problems
        ):
            problems.append(
                f"spec.{role}.resources: no node has all of {dict(pool.resources)} at once"
            )
    for name, amount in need.items():
        if cluster.get(name, 0) < amount and not any(name in p for p in problems):
            problems.append(
                f"spec.prefill/decode: {amount:g} {name} needed for all replicas, "
                f"the Ray cluster has {cluster.get(name, 0):g}"
            )
    if problems:
        raise ManifestError("\n".join(problems))
