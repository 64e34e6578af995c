"""DiskTier: KV blocks as files in a local directory, bounded in bytes, LRU by last use.

One file per block, `<hash as 16 hex digits>.kvb` (file_format.py): the block hash is the unit
of lookup, eviction and KV events, so a file per block evicts exactly what LRU chooses (a file
per run of blocks would have to evict a run's still-useful head with its tail, or rewrite it),
and a torn write costs one block. A block of a real model is large (a 8B Llama at 16 tokens:
2 MiB), so per-file overhead is small.

Writes are atomic: `<hash>.tmp`, then rename. No fsync: a cache loses nothing by forgetting a
block, and a file torn by a crash is caught by its size and checksums on the next open.
Last use is the file's mtime (a strictly increasing clock in ns, set on store and on load), so
the LRU order survives a restart.

Open re-indexes the directory, eagerly for headers (one small read per file: magic, header
checksum, identity, file size) and lazily for payloads (the blake2b digest is checked on every
load, so a flipped payload bit is caught when first read, not by reading the whole tier at
start-up). Files that fail are deleted and counted (truncated / corrupted / foreign), never
loaded. A lock file (`.lock`, flock) keeps a second engine out of a directory in use.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

import torch

from engine.block_hash import BlockHash
from engine.block_pool import KVEvent
from engine.kv_tier.base import DEFAULT_WRITE_QUEUE_BLOCKS, KVTier, Staged, WriteJob
from engine.kv_tier.file_format import (
    BlockFileError,
    BlockHeader,
    CorruptedBlockFile,
    check_header,
    make_header,
    read_header,
    read_payload,
    tensor_bytes,
    write_block,
)
from engine.kv_tier.index import TierEntry
from engine.kv_tier.spec import TierIdentity

logger = logging.getLogger(__name__)

SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"
LOCK_NAME = ".lock"


class TierLockedError(RuntimeError):
    """Another engine (process or object) has this tier directory open."""


class DiskTier(KVTier):
    """A tier in a local directory of block files."""

    medium = "disk"
    persistent = True

    def __init__(
        self,
        identity: TierIdentity,
        capacity_bytes: int,
        path: str | os.PathLike,
        write_queue_blocks: int = DEFAULT_WRITE_QUEUE_BLOCKS,
    ) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_fd = _lock_directory(self.path)
        try:
            super().__init__(identity, capacity_bytes, write_queue_blocks)
        except BaseException:
            os.close(self._lock_fd)
            raise
        try:
            self._reindex()
        except BaseException:
            self.close()
            raise

    def file_of(self, block_hash: BlockHash) -> Path:
        return self.path / f"{block_hash:016x}{SUFFIX}"

    # ---- re-index -----------------------------------------------------------------------
    def _reindex(self) -> None:
        """Index the valid files, oldest use first; delete and count the rest. Publishes a
        `stored` event per block kept, so a restarted worker announces what it holds."""
        found: list[tuple[int, str, BlockHeader, int]] = []  # (mtime ns, name, header, size)
        for p in sorted(self.path.iterdir()):
            if p.name.endswith(TMP_SUFFIX):
                self._drop_file(p, "truncated_dropped", "an interrupted write")
                continue
            if not p.name.endswith(SUFFIX) or not p.is_file():
                continue  # not ours (the lock file, anything else): left alone
            try:
                st = p.stat()
                header = self._read_checked_header(p, st.st_size)
            except BlockFileError as exc:
                self._drop_file(p, f"{exc.kind}_dropped", str(exc))
                continue
            except OSError as exc:
                logger.warning("KV tier (disk): cannot read %s: %s", p, exc)
                continue
            found.append((st.st_mtime_ns, p.name, header, st.st_size))
        found.sort(key=lambda f: (f[0], f[1]))
        kept, used = [], 0
        for item in reversed(found):  # most recently used first, while they fit
            if used + item[3] <= self._index.capacity_bytes:
                kept.append(item)
                used += item[3]
            else:
                self._drop_file(self.path / item[1], "evictions", "over capacity")
        with self._lock:
            for mtime, _, header, size in reversed(kept):
                self._clock = max(self._clock, mtime)
                self._index.add(
                    TierEntry(header.block_hash, size, header.parent_hash, header.hash_key, mtime)
                )
                self._events.append(_stored(header))

    def _read_checked_header(self, p: Path, size: int) -> BlockHeader:
        try:
            block_hash = int(p.name.removesuffix(SUFFIX), 16)
        except ValueError:
            raise CorruptedBlockFile(f"file name {p.name!r} is not a block hash") from None
        with open(p, "rb") as f:
            header = read_header(f, size)
        check_header(header, self.identity, block_hash)
        return header

    def _drop_file(self, p: Path, counter: str, why: str) -> None:
        logger.warning("KV tier (disk): dropping %s: %s", p, why)
        p.unlink(missing_ok=True)
        setattr(self._counters, counter, getattr(self._counters, counter) + 1)

    # ---- the backend --------------------------------------------------------------------
    def _prepare(self, job: WriteJob) -> Staged:
        payload = tensor_bytes(job.block)
        header = make_header(self.identity, job.block_hash, payload, job.parent_hash, job.hash_key)
        tmp = self.path / f"{job.block_hash:016x}{TMP_SUFFIX}"
        try:
            with open(tmp, "wb") as f:
                nbytes = write_block(f, header, payload)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        return Staged(nbytes, tmp)

    def _commit(self, block_hash: BlockHash, staged: Staged, last_use: int) -> None:
        os.utime(staged.data, ns=(last_use, last_use))
        os.replace(staged.data, self.file_of(block_hash))

    def _discard(self, staged: Staged) -> None:
        staged.data.unlink(missing_ok=True)

    def _delete(self, block_hash: BlockHash) -> None:
        self.file_of(block_hash).unlink(missing_ok=True)

    def _read(self, block_hash: BlockHash) -> torch.Tensor:
        p = self.file_of(block_hash)
        with open(p, "rb") as f:
            header = read_header(f, os.fstat(f.fileno()).st_size)
            check_header(header, self.identity, block_hash)
            return read_payload(f, header, self.identity)

    def _used(self, uses: list[tuple[BlockHash, int]]) -> None:
        for block_hash, last_use in uses:
            try:
                os.utime(self.file_of(block_hash), ns=(last_use, last_use))
            except FileNotFoundError:
                pass  # removed since (evicted after the load unpinned it)

    def _close_backend(self) -> None:
        os.close(self._lock_fd)  # releases the flock

    def check_integrity(self) -> None:
        """Also: the directory's block files are exactly the index, with its sizes."""
        super().check_integrity()
        with self._lock:
            want = {self.file_of(e.block_hash).name: e.nbytes for e in self._index}
            have = {p.name: p.stat().st_size for p in self.path.glob(f"*{SUFFIX}")}
        if want != have:
            raise AssertionError(f"index {sorted(want)} != files {sorted(have)}")


def _stored(header: BlockHeader) -> KVEvent:
    return KVEvent("stored", (header.block_hash,), header.parent_hash, medium=DiskTier.medium)


def _lock_directory(path: Path) -> int:
    """An fd holding an exclusive flock on path/.lock (which records the holder's pid)."""
    fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise TierLockedError(
            f"KV tier directory {path} is in use by another engine (pid {holder}); "
            "give each worker its own kv_tier_path"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd
