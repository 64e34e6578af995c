"""TierConnector: the engine's side of a KV tier.

  BlockPool   on_evict(block): a cached block is about to be reused, its KV goes to the tier
  Scheduler   num_hits(): tier blocks continuing a request's device prefix hits;
              start(): load them into the request's freshly allocated blocks; the request
              waits (WAITING_FOR_TIER_KV) while other requests keep stepping;
              finished(): loads that are done, with how many leading blocks arrived
              (the scheduler then caches those blocks and advances num_computed_tokens)
  decode side start_remote(): the same load for a request whose other blocks arrive from a
              prefill engine (it waits for those, WAITING_FOR_REMOTE_KV); not reported by
              finished(): take_remote() waits for it when the remote KV has arrived
The block pool stays the owner of block ids: the connector only names destination ids that
the request's table already holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, overload

import torch

from engine.block_pool import BlockPool, HashKey, KVBlock, KVEvent
from engine.errors import InvalidRequestError
from engine.kv_cache_manager import KVCacheManager
from engine.kv_tier import TierIdentity, TierLockedError, open_tier
from engine.kv_tier.base import KVTier
from engine.kv_tier.device_copy import BlockDestination, block_views
from engine.kv_tier.fingerprint import model_fingerprint
from engine.kv_tier.load import TierLoad
from engine.request import Request

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner


class TierConnector:
    """Offers evicted blocks to a tier and loads tier hits back for the scheduler."""

    def __init__(self, tier: KVTier, kv_caches: Sequence[torch.Tensor]) -> None:
        self.tier = tier
        self.kv_caches = kv_caches  # per layer [2, num_blocks, BS, KVH, D]
        self._loads: dict[str, tuple[Request, TierLoad]] = {}  # in start order
        self._remote: dict[str, TierLoad] = {}  # loads of requests waiting for remote KV

    def on_evict(self, block: KVBlock) -> bool:
        """BlockPool hook, called before a cached block is reused: copy its KV to the tier
        (True when queued)."""
        key = block.hash_key
        if block.block_hash is None:  # never cached: nothing a tier could look up
            return False
        views = block_views(self.kv_caches, block.block_id)
        return self.tier.offer(block.block_hash, views, key[0] if key else None, key)

    def persist(self, pool: BlockPool, timeout: float = 60.0) -> int:
        """Offer every block the device caches (next to be evicted first) and wait until
        they are written; for a tier that outlives the process (disk) before it closes.
        Returns the blocks offered (held ones are skipped)."""
        offered = 0
        for block in pool.cached_blocks():
            if not self.tier.has_write_room():
                self.tier.flush(timeout)
            offered += self.on_evict(block)
        self.tier.flush(timeout)
        return offered

    def num_hits(self, kv: KVCacheManager, req: Request, num_device: int) -> int:
        """Blocks the tier holds right after req's num_device device hits (stopping where the
        last prompt token's block starts: that token is always computed)."""
        limit = (req.num_tokens - 1) // kv.block_size
        n = min(limit, len(req.block_hashes)) - num_device
        if n <= 0:
            return 0
        hashes = req.block_hashes[num_device : num_device + n]
        return self.tier.lookup(hashes, _Keys(kv, req, num_device, n))

    def start(self, kv: KVCacheManager, req: Request, num_device: int, n: int) -> None:
        """Load req's blocks [num_device, num_device + n) from the tier into its table's."""
        self._loads[req.request_id] = (req, self._load(kv, req, num_device, n))

    def start_remote(self, kv: KVCacheManager, req: Request, num_device: int, n: int) -> None:
        """start() for a request waiting for remote KV: its load is collected by take_remote()
        (or stopped by cancel()), never by finished()."""
        self._remote[req.request_id] = self._load(kv, req, num_device, n)

    def take_remote(self, req: Request, wait: float) -> tuple[int, int] | None:
        """(blocks loaded, blocks asked) of req's remote-side load once it is done, waiting up
        to `wait` seconds for it and then stopping it (the blocks not yet loaded are computed
        instead); None if req has no such load."""
        load = self._remote.pop(req.request_id, None)
        if load is None:
            return None
        if not load.wait(wait):
            self.tier.cancel_load(load)
        return load.num_loaded, load.num_blocks

    def num_remote_blocks(self, request_id: str) -> int:
        """Blocks a request waiting for remote KV is loading from the tier (0: none)."""
        load = self._remote.get(request_id)
        return 0 if load is None else load.num_blocks

    def _load(self, kv: KVCacheManager, req: Request, num_device: int, n: int) -> TierLoad:
        ids = kv.block_ids(req.request_id)[num_device : num_device + n]
        hashes = req.block_hashes[num_device : num_device + n]
        return self.tier.load_async(
            hashes, BlockDestination(self.kv_caches, ids), _Keys(kv, req, num_device, n)
        )

    def finished(self) -> list[tuple[Request, int]]:
        """Requests whose load is done (in start order), each with its leading blocks loaded."""
        done = [(rid, req, load) for rid, (req, load) in self._loads.items() if load.done()]
        for rid, _, _ in done:
            del self._loads[rid]
        return [(req, load.num_loaded) for _, req, load in done]

    def cancel(self, req: Request) -> None:
        """Stop req's load (either kind); returns once its destination blocks may be freed."""
        entry = self._loads.pop(req.request_id, None)
        load = entry[1] if entry is not None else self._remote.pop(req.request_id, None)
        if load is not None:
            self.tier.cancel_load(load)

    @property
    def num_loading(self) -> int:
        return len(self._loads)

    def wait_any(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for the oldest load (when nothing else can run)."""
        if self._loads:
            next(iter(self._loads.values()))[1].wait(timeout)

    def take_events(self) -> list[KVEvent]:
        return self.tier.take_events()


class _Keys(Sequence[HashKey]):
    """The hash keys of req's blocks [start, start + n), computed on access (a lookup reads
    them only up to its first miss)."""

    def __init__(self, kv: KVCacheManager, req: Request, start: int, n: int) -> None:
        self._kv, self._req, self._start, self._n = kv, req, start, n

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> HashKey: ...
    @overload
    def __getitem__(self, i: slice) -> list[HashKey]: ...
    def __getitem__(self, i: int | slice) -> HashKey | list[HashKey]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        if not 0 <= i < self._n:
            raise IndexError(i)
        return self._kv.hash_key(self._req, self._start + i)


def open_engine_tier(config: EngineConfig, model_dir: Path, runner: ModelRunner) -> KVTier | None:
    """The tier an engine's options ask for (None for kv_tier="none"), stamped with the
    identity of this engine's KV: model, arithmetic, hash seed and block geometry."""
    if config.kv_tier == "none":
        return None
    dtype = str(runner.dtype).removeprefix("torch.")
    args = runner.model.args
    identity = TierIdentity(
        model_fingerprint(
            model_dir,
            dtype=dtype,
            use_gguf_blocks=config.use_gguf_blocks,
            int8_activations=config.int8_activations,
        ),
        config.hash_seed,
        config.block_size,
        dtype,
        args.num_layers,
        args.num_kv_heads,
        args.head_dim,
    )
    if config.kv_tier_bytes < identity.block_bytes:
        raise InvalidRequestError(
            f"kv_tier_bytes={config.kv_tier_bytes} is smaller than one KV block "
            f"({identity.block_bytes} bytes)"
        )
    # The write queue holds host copies of whole blocks: its byte bound in blocks, at least one.
    write_queue_blocks = max(1, config.kv_tier_write_queue_bytes // identity.block_bytes)
    try:
        return open_tier(
            config.kv_tier,
            identity,
            config.kv_tier_bytes,
            config.kv_tier_path,
            write_queue_blocks,
        )
    except (TierLockedError, OSError) as exc:
        raise InvalidRequestError(f"kv_tier_path={config.kv_tier_path!r}: {exc}") from exc
