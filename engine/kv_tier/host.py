"""HostTier: KV blocks in host memory, bounded in bytes, LRU.

A stored block is the host copy that offer() made ([L, 2, BS, KVH, D]; pinned when the device
cache is on CUDA, so loads back are asynchronous DMA): the writer thread only waits for that
copy to complete and indexes it, no second copy. The contents do not survive the process.
"""

from __future__ import annotations

import torch

from engine.block_hash import BlockHash
from engine.kv_tier.base import DEFAULT_WRITE_QUEUE_BLOCKS, KVTier, Staged, WriteJob
from engine.kv_tier.spec import TierIdentity


class HostTier(KVTier):
    """A tier in host memory: block hash -> host tensor."""

    medium = "host"
    persistent = False

    def __init__(
        self,
        identity: TierIdentity,
        capacity_bytes: int,
        write_queue_blocks: int = DEFAULT_WRITE_QUEUE_BLOCKS,
    ) -> None:
        self._blocks: dict[BlockHash, torch.Tensor] = {}
        super().__init__(identity, capacity_bytes, write_queue_blocks)

    def _prepare(self, job: WriteJob) -> Staged:
        return Staged(self.identity.block_bytes, job.block)

    def _commit(self, block_hash: BlockHash, staged: Staged, last_use: int) -> None:
        self._blocks[block_hash] = staged.data

    def _discard(self, staged: Staged) -> None:
        pass  # the tensor is freed with the job

    def _delete(self, block_hash: BlockHash) -> None:
        del self._blocks[block_hash]

    def _read(self, block_hash: BlockHash) -> torch.Tensor:
        with self._lock:  # pinned: present until the load unpins it
            return self._blocks[block_hash]

    def _used(self, uses: list[tuple[BlockHash, int]]) -> None:
        pass  # the order lives in the index only

    def _close_backend(self) -> None:
        self._blocks.clear()

    def check_integrity(self) -> None:
        super().check_integrity()
        with self._lock:
            held = {e.block_hash for e in self._index}
            if held != set(self._blocks):
                raise AssertionError(
                    f"index holds {len(held)} blocks, the store {len(self._blocks)}"
                )
