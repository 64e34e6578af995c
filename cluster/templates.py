"""What each worker of a manifest runs with, which workers may exchange KV, and what the
router runs with.

The controller compares a running worker's template key with the manifest's: a worker whose
engine options, transfer options, resources or threads changed is replaced.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from kvtransfer.worker_api import Role
from router.settings import RouterSettings, TLSPaths

if TYPE_CHECKING:
    from deploy.manifest import Manifest

ROLES = tuple(Role)  # every pool, in the order they are started and listed


@dataclass(frozen=True)
class WorkerTemplate:
    role: str
    engine: dict  # EngineConfig keyword arguments (model and dtype included)
    transfer: dict  # TransferOptions fields
    resources: dict  # the worker's placement-group bundle, e.g. {"CPU": 1} or {"GPU": 1}
    threads: int  # torch intra-op threads

    @property
    def key(self) -> str:
        """Equal keys: a running worker already is what the manifest asks for."""
        return json.dumps(asdict(self), sort_keys=True)

    @property
    def kv_key(self) -> str:
        """Workers are paired only with peers whose KV blocks they can read: same model,
        dtype, block size, hash seed and transfer backend."""
        e = self.engine
        return json.dumps(
            [e["model"], e["dtype"], e["block_size"], e["hash_seed"], self.transfer["backend"]]
        )


def worker_engine_options(engine: dict, worker_id: str) -> dict:
    """The engine options one worker starts with: its template's, with the KV tier directory
    made its own (kv_tier_path is the pools' parent directory; each worker keeps its blocks in
    <kv_tier_path>/<worker id>, so a worker Ray restarts, same id, reopens what it wrote)."""
    path = engine.get("kv_tier_path")
    if path is None:
        return dict(engine)
    return {**engine, "kv_tier_path": os.path.join(path, worker_id)}


def worker_templates(manifest: Manifest) -> dict[str, WorkerTemplate]:
    """The template of each role's workers."""
    spec = manifest.spec
    out: dict[str, WorkerTemplate] = {}
    for role in ROLES:
        pool = getattr(spec, role)
        engine = {
            "model": spec.model.path,
            "dtype": spec.model.dtype,
            "skip_tokenizer_init": spec.model.skip_tokenizer_init,
            **spec.engine_for(role).model_dump(exclude_none=True),
        }
        out[role] = WorkerTemplate(
            role, engine, spec.transfer.model_dump(), dict(pool.resources), pool.threads
        )
    return out


def router_settings(manifest: Manifest) -> RouterSettings:
    """What the router actor runs with (block size and hash seed: the pools', which the
    manifest guarantees are the same; read from the decode pool, which every shape has)."""
    spec = manifest.spec
    router, engine = spec.router, spec.engine_for("decode")
    return RouterSettings(
        model=spec.model.path,
        skip_tokenizer=spec.model.skip_tokenizer_init,
        host=router.host,
        port=router.port,
        http_port=router.http_port,
        served_model_names=(router.served_model_name or spec.model.path, *router.model_aliases),
        api_key_env=router.api_key_env,
        api_key_file=router.api_key_file,
        tls=TLSPaths(**router.tls.model_dump()) if router.tls else None,
        max_pending_requests=router.max_pending_requests,
        chat_template=router.chat_template,
        policy=router.policy,
        local_prefill_tokens=router.local_prefill_tokens,
        aggregated=spec.prefill.replicas == 0,
        wait_for_workers_s=router.wait_for_workers_seconds,
        migration_limit=router.migration_limit,
        max_retention_seconds=min(
            spec.engine_for(role).max_retention_seconds
            for role in (("prefill", "decode") if spec.prefill.replicas else ("decode",))
        ),
        block_size=engine.block_size,
        hash_seed=engine.hash_seed,
    )
