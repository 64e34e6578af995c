"""LLMEngine's hooks for moving cached blocks to another engine outside a request (mixed into
LLMEngine; they use its KV cache manager and block pool): a decode engine's prefix, pulled by
a prefill engine for the next turn of a conversation (kvtransfer.pull).

A run of blocks is named by its token ids (and cache_salt): each side re-derives the chained
hashes and re-checks every hit against its tokens, as a prompt's lookup does.
  exporting side   export_blocks pins the cached blocks of the run from a given block on, until
                   release_exchange (their KV must not change while it is read)
  importing side   import_blocks pins the run's cached head and takes fresh blocks for the rest;
                   finish_import caches the first n of them once their KV is in place and lets
                   them all go (they stay in the prefix cache, most recently used);
                   release_exchange lets them go uncached (the pull failed)
Every pinned table has an id of its own (in check_integrity's accounting) and an owner that
always ends it: the worker's pull, whose every wait is bounded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.errors import InvalidRequestError
from engine.request import Request
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.block_pool import BlockPool
    from engine.config import EngineConfig
    from engine.kv_cache_manager import KVCacheManager
    from engine.model_runner import ModelRunner


@dataclass(frozen=True, slots=True)
class ImportPlan:
    """Where a pull lands: of the run's full blocks (block_hashes), the first `start` are
    cached here already; dst_block_ids (held) take blocks start, start + 1, ... (fewer than
    the rest when too few blocks are free; none: nothing to pull)."""

    block_hashes: tuple[int, ...]
    start: int
    dst_block_ids: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)


class BlockExchangeHooks:
    """The exporting and importing sides of a pull, for LLMEngine."""

    if TYPE_CHECKING:  # what they use of LLMEngine
        config: EngineConfig
        pool: BlockPool
        kv: KVCacheManager
        runner: ModelRunner
        _exchanges: dict[str, Request]

    def export_blocks(
        self,
        exchange_id: str,
        token_ids: Sequence[int],
        cache_salt: str | None,
        start: int,
        max_blocks: int,
    ) -> list[int]:
        """Pin the cached blocks of the run's blocks [start, start + max_blocks), up to the
        first one not cached here; returns their ids (possibly none)."""
        run = self._exchange_run(exchange_id, token_ids, cache_salt)
        blocks = self.kv.cached_run(run, start, start + max_blocks)
        self.kv.pin(exchange_id, blocks)
        self._exchanges[exchange_id] = run
        return [b.block_id for b in blocks]

    def import_blocks(
        self, exchange_id: str, token_ids: Sequence[int], cache_salt: str | None
    ) -> ImportPlan:
        """Pin the run's cached head and take fresh blocks for the full blocks after it (as
        many as are free). With no destination block, nothing stays pinned."""
        run = self._exchange_run(exchange_id, token_ids, cache_salt)
        n = len(run.block_hashes)
        head = self.kv.cached_run(run, 0, n)
        free = self.pool.num_free_blocks - sum(1 for b in head if b.ref_cnt == 0)
        num_new = max(0, min(n - len(head), free))
        hashes = tuple(run.block_hashes)
        if not num_new or not self.kv.pin(exchange_id, head, num_new):
            return ImportPlan(hashes, len(head), ())
        self._exchanges[exchange_id] = run
        ids = self.kv.block_ids(exchange_id)
        return ImportPlan(hashes, len(head), tuple(ids[len(head) :]))

    def finish_import(self, exchange_id: str, start: int, num_received: int) -> int:
        """The KV of blocks [start, start + num_received) arrived in the plan's leading
        destination blocks: cache them and let every block of the import go. Returns the
        blocks newly cached (a block another request cached meanwhile stays that one)."""
        run = self._exchanges[exchange_id]
        cached = self.kv.cache_range(exchange_id, run, start, start + num_received)
        self.release_exchange(exchange_id)
        return cached

    def release_exchange(self, exchange_id: str) -> bool:
        """Let an export's or import's pinned blocks go (an import's uncached ones are plain
        free blocks again); False if it pins none."""
        if self._exchanges.pop(exchange_id, None) is None:
            return False
        self.kv.free_table(exchange_id)
        return True

    def exchanges(self) -> list[str]:
        """Ids of the exports and imports pinning blocks now."""
        return list(self._exchanges)

    def _exchange_run(
        self, exchange_id: str, token_ids: Sequence[int], cache_salt: str | None
    ) -> Request:
        """The token run as a request that is never scheduled: its block hashes and keys."""
        if exchange_id in self._exchanges or exchange_id in self.kv.table_ids():
            raise InvalidRequestError(f"exchange id {exchange_id!r} is already in use")
        vocab = self.runner.model.args.vocab_size
        tokens = [int(t) for t in token_ids]
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token_ids out of range [0, {vocab}): {bad[:5]}")
        if not self.config.enable_prefix_caching:
            raise InvalidRequestError("moving cached blocks needs enable_prefix_caching")
        run = Request(exchange_id, tokens, SamplingParams(), cache_salt=cache_salt)
        self.kv.update_block_hashes(run)
        return run
