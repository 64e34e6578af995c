"""Where the controller keeps its state so that a restarted controller carries on: one JSON
document in Ray's internal key-value store (held by the GCS, so it outlives the controller's
process, not the Ray cluster).

The document (cluster/state.py: ClusterState.snapshot writes it, ClusterState.restore reads it):
    {"manifest", "generation", "restarts", "next_index": {role: int},
     "workers": [{"worker_id", "template": WorkerTemplate fields, "incarnation", "draining",
                  "node_id"}],
     "pairs": [[prefill id, decode id]], "router": {"key", "address", "http_address",
     "ports"} or None, "events": [last lines], "num_events": int}
Actor handles and placement groups are not stored: they are looked up again by name.
"""

from __future__ import annotations

import json

STATE_KEY = "controller-state"


def save(state: dict, namespace: str) -> None:
    """Replace the stored state (called by the controller whenever its state changes)."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(STATE_KEY, json.dumps(state), overwrite=True, namespace=namespace)


def load(namespace: str) -> dict | None:
    """The stored state, or None (no controller ran here since the last `down`)."""
    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(STATE_KEY, namespace=namespace)
    return None if raw is None else json.loads(raw)


def delete(namespace: str) -> None:
    """Forget the state (`down`: the next controller starts from nothing)."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(STATE_KEY, namespace=namespace)
