"""The oracle prefix cache: one infinite cache shared by every worker, fed the same request
sequence as the cluster. Its hit rate is the most any routing policy could get from a cache
that is empty when the run starts (a cluster's cache may already hold a previous run's
prompts: compare on a fresh cluster, or with a new --seed).

It uses the cluster's own block hash (`engine.block_hash.hash_prompt_blocks`, same block size,
seed and cache_salt), counts full blocks only, and, as the engine does, at most
(prompt_tokens - 1) // block_size blocks: the last prompt token is always computed. An answer's
blocks are cached too once it is in (insert_answer): the engine that decoded it holds their KV
(all but the last token's), and the next turn of a conversation starts with them.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.block_hash import BlockHash, hash_prompt_blocks


class OracleCache:
    """lookup_and_insert(prompt) -> cached tokens an infinite shared cache would give it; the
    prompt's full blocks are then cached forever."""

    def __init__(self, block_size: int, hash_seed: str | int = "baton") -> None:
        self.block_size = block_size
        self.hash_seed = hash_seed
        self._cached: set[BlockHash] = set()

    def lookup_and_insert(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        hashes = hash_prompt_blocks(token_ids, self.block_size, self.hash_seed, cache_salt)
        limit = (len(token_ids) - 1) // self.block_size
        hits = 0
        while hits < min(limit, len(hashes)) and hashes[hits] in self._cached:
            hits += 1
        self._cached.update(hashes)
        return hits * self.block_size

    def insert_answer(
        self, prompt: Sequence[int], answer: Sequence[int], cache_salt: str | None = None
    ) -> None:
        """Cache the full blocks of prompt + answer whose KV was computed (the last answer
        token's never is)."""
        tokens = list(prompt) + list(answer)
        computed = tokens[: max(0, len(tokens) - 1)]
        self._cached.update(
            hash_prompt_blocks(computed, self.block_size, self.hash_seed, cache_salt)
        )
