"""Manifests of small test clusters (a tiny checkpoint, token ids in and out, any free port)."""

from __future__ import annotations


def tiny_manifest(
    model: str, prefill: int = 1, decode: int = 1, name: str = "test", **engine
) -> dict:
    return {
        "apiVersion": "baton/v1",
        "kind": "Cluster",
        "metadata": {"name": name},
        "spec": {
            "model": {"path": model, "skip_tokenizer_init": True},
            "engine": {"block_size": 4, "num_kv_blocks": 256, "chunk_size": 16, **engine},
            "prefill": {"replicas": prefill},
            "decode": {"replicas": decode},
            "router": {"port": 0, "http_port": 0},
            "transfer": {"timeout_seconds": 10.0},
        },
    }
