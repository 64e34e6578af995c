"""The soak benchmark's deployment and what it watches on it: the manifest, the processes'
resident memory, and the KV blocks left held once the cluster is idle."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from benchmarks.faults import actor_pid

NAMESPACE = "baton"
CONTROLLER = "baton-controller"
ROUTER = "baton-router"


def soak_manifest(model: str, tiny: bool, prefill: int, decode: int, threads: int) -> dict:
    """The deployment under test: tiny (random checkpoint, token ids only) or a real model."""
    engine = (
        {"block_size": 4, "num_kv_blocks": 1024, "chunk_size": 64}
        if tiny
        else {"block_size": 16, "kv_cache_memory_gb": 0.5, "chunk_size": 512}
    )
    return {
        "apiVersion": "baton/v1",
        "kind": "Cluster",
        "metadata": {"name": "soak"},
        "spec": {
            "model": {"path": model, "skip_tokenizer_init": tiny},
            "engine": engine,
            "prefill": {"replicas": prefill, "threads": threads},
            "decode": {"replicas": decode, "threads": threads},
            "router": {"port": 0, "http_port": 0, "wait_for_workers_seconds": 60.0},
            "transfer": {"timeout_seconds": 10.0, "lease_seconds": 10.0},
        },
    }


def tiny_checkpoint() -> str:
    """A tiny random Llama checkpoint (the tests' one) in a temporary directory."""
    from benchmarks.checkpoints import make_checkpoint

    return str(make_checkpoint(Path(tempfile.mkdtemp(prefix="baton-soak-")), "llama"))


def rss_mb(pid: int) -> float | None:
    """A process's resident memory in MiB (None: gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def process_pids(worker_ids: list[str]) -> dict[str, int]:
    """Name -> pid of the controller, the router, every worker and this client."""
    pids = {name: actor_pid(name, NAMESPACE) for name in (CONTROLLER, ROUTER, *worker_ids)}
    pids["client"] = os.getpid()
    return pids


def memory(pids: dict[str, int]) -> dict[str, dict]:
    return {name: {"pid": pid, "rss_mb": rss_mb(pid)} for name, pid in pids.items()}


def leaked_blocks(controller, worker_ids: list[str], settle_s: float) -> dict[str, dict]:
    """Per worker once idle (waits up to settle_s for leases of abandoned requests):
    check_integrity's verdict, blocks not free and requests still in flight."""
    import ray

    from cluster.ray_peer import decode_client, prefill_client

    clients = {}
    for w in worker_ids:
        handle = ray.get(controller.handle.remote(w), timeout=60)
        clients[w] = (prefill_client if w.startswith("prefill") else decode_client)(handle, 60.0)
    deadline = time.monotonic() + settle_s
    while True:  # a worker Ray is restarting does not answer yet: ask again
        stats, errors = {}, {}
        for w, c in clients.items():
            try:
                stats[w] = c.stats()
            except Exception as exc:  # noqa: BLE001 - restarting; reported if it stays so
                errors[w] = f"{type(exc).__name__}: {str(exc)[:200]}"
        idle = not errors and all(
            s.num_in_flight == 0 and s.free_blocks == s.num_blocks for s in stats.values()
        )
        if idle or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    out = {}
    for w, c in clients.items():
        if w in errors:
            out[w] = {"integrity": f"no answer: {errors[w]}", "leaked_blocks": 0, "in_flight": 0}
            continue
        try:
            c.check_integrity()
            integrity = "ok"
        except Exception as exc:  # noqa: BLE001 - reported
            integrity = f"{type(exc).__name__}: {exc}"
        s = stats[w]
        out[w] = {
            "integrity": integrity,
            "leaked_blocks": s.num_blocks - s.free_blocks,
            "in_flight": s.num_in_flight,
            "num_blocks": s.num_blocks,
        }
    return out


def current_pids(pids: dict[str, int]) -> dict[str, int]:
    """Pids now (restarted actors have new ones); unchanged where an actor does not answer."""
    out = {}
    for name in pids:
        if name == "client":
            continue
        try:
            out[name] = actor_pid(name, NAMESPACE, timeout=10.0)
        except Exception:  # noqa: BLE001 - keep the old pid (reported as gone)
            pass
    return out
