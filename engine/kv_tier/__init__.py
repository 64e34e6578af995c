"""KV tiers below a worker's device KV cache: blocks evicted from the device cache are kept
(by block hash) in host memory or on a local disk, and a later prefix hit loads them back
instead of recomputing them.

    base.py         KVTier: the interface and the machinery both backends share
    host.py         HostTier: host memory (pinned with a CUDA device cache)
    disk.py         DiskTier: one checksummed file per block, re-indexed on open, locked
    file_format.py  the block file's header and payload
    index.py        TierIndex: LRU under a byte bound
    io_thread.py    the writer and loader threads
    load.py         TierLoad: the handle of an asynchronous load
    device_copy.py  copies between the paged device cache and host block tensors
    spec.py         TierIdentity (what makes stored KV valid), TierStats
    fingerprint.py  the model fingerprint stored KV is stamped with
    connector.py    TierConnector: the engine's side (eviction hook, lookup, loads)
    metrics.py      TierCollector: TierStats as Prometheus families
Backends are chosen by name from TIERS.
"""

from __future__ import annotations

import os

from engine.kv_tier.base import DEFAULT_WRITE_QUEUE_BLOCKS, KVTier
from engine.kv_tier.device_copy import BlockDestination, block_views
from engine.kv_tier.disk import DiskTier, TierLockedError
from engine.kv_tier.host import HostTier
from engine.kv_tier.load import TierLoad
from engine.kv_tier.spec import TierIdentity, TierStats

TIERS: dict[str, type[KVTier]] = {"host": HostTier, "disk": DiskTier}

__all__ = [
    "TIERS",
    "BlockDestination",
    "DiskTier",
    "HostTier",
    "KVTier",
    "TierIdentity",
    "TierLoad",
    "TierLockedError",
    "TierStats",
    "block_views",
    "open_tier",
]


def open_tier(
    kind: str,
    identity: TierIdentity,
    capacity_bytes: int,
    path: str | os.PathLike | None = None,
    write_queue_blocks: int = DEFAULT_WRITE_QUEUE_BLOCKS,
) -> KVTier:
    """The tier named `kind` ("host" or "disk"; a disk tier needs `path`)."""
    if kind == "host":
        return HostTier(identity, capacity_bytes, write_queue_blocks)
    if kind == "disk":
        if path is None:
            raise ValueError("a disk KV tier needs a path (kv_tier_path)")
        return DiskTier(identity, capacity_bytes, path, write_queue_blocks)
    raise ValueError(f"unknown KV tier {kind!r}; choose one of {', '.join(TIERS)}")
