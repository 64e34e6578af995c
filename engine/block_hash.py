"""Chained prefix-block hashes, shared by the engine, the workers and the router.

hash(block i) = H(seed, hash(block i-1), tokens of block i, extra keys). Only full blocks
are hashed, so two prompts share hash i exactly when they share their first
(i + 1) * block_size tokens and their extra keys (e.g. a tenant's cache_salt).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgpack

BlockHash = int


def root_hash(seed: str | int) -> BlockHash:
    """The parent hash of a prompt's first block, derived from the configured seed."""
    digest = hashlib.blake2b(msgpack.packb(["baton-root", seed]), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def hash_block(parent: BlockHash, tokens: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    """Hash one full block given its parent's hash."""
    payload = msgpack.packb([parent, list(tokens), list(extra_keys)])
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little")


def hash_prompt_blocks(
    token_ids: Sequence[int],
    block_size: int,
    seed: str | int,
    cache_salt: str | None = None,
    start: int = 0,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids`, starting at block index `start`.

    `parent` must be the hash of block `start - 1` when start > 0. The salt is an extra
    key of the first block only: it changes every hash after it through the chain.
    """
    hashes: list[BlockHash] = []
    prev = root_hash(seed) if start == 0 else parent
    if prev is None:
        raise ValueError("parent hash is required when start > 0")
    for i in range(start, len(token_ids) // block_size):
        extra = (cache_salt,) if (i == 0 and cache_salt) else ()
        prev = hash_block(prev, token_ids[i * block_size : (i + 1) * block_size], extra)
        hashes.append(prev)
    return hashes
