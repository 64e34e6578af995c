"""TierLoad: the handle of one asynchronous load of tier blocks into device blocks."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch

from engine.block_hash import BlockHash
from engine.kv_tier.device_copy import BlockDestination


class TierLoad:
    """Loads `block_hashes` (leading blocks the tier pinned) into dst, on the loader thread.

    Poll done() or wait(); then num_loaded is how many leading blocks are in place (fewer than
    num_blocks when a block proved corrupt or the load was cancelled). dst.block_ids[:num_loaded]
    then hold exactly the stored KV; later destination blocks are untouched or partly written.
    """

    def __init__(
        self,
        block_hashes: Sequence[BlockHash],
        dst: BlockDestination,
        after: torch.cuda.Event | None,
    ) -> None:
        if len(dst.block_ids) < len(block_hashes):
            raise ValueError(
                f"{len(block_hashes)} blocks to load but {len(dst.block_ids)} destination ids"
            )
        self.block_hashes = tuple(block_hashes)
        self.dst = dst
        self.after = after  # CUDA: copies start after this compute-stream event
        self.started = time.perf_counter()
        self.seconds: float | None = None  # load_async -> done, once done
        self._num_loaded = 0
        self._cancelled = threading.Event()
        self._done = threading.Event()

    @property
    def num_blocks(self) -> int:
        """Blocks this load was asked to bring in (all held by the tier when it started)."""
        return len(self.block_hashes)

    @property
    def num_loaded(self) -> int:
        """Leading blocks in place; final once done() is True."""
        return self._num_loaded

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done; False on timeout."""
        return self._done.wait(timeout)

    def cancel(self) -> None:
        """Stop after the block being copied now (the destination blocks are to be freed:
        wait() before reusing them)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def finish(self, num_loaded: int, seconds: float) -> None:
        """Called by the tier once the copies of the leading num_loaded blocks have landed."""
        self._num_loaded = num_loaded
        self.seconds = seconds
        self._done.set()
