"""KVTier: a bounded store of KV blocks, keyed by block hash, below a worker's device cache.

The block pool stays the one owner of block ids and reference counts; a tier owns only bytes
keyed by block hash. The engine thread calls offer() / lookup() / load_async() and never
waits on storage:
  offer      copies the block's KV out of the device cache (that copy is the only work on the
             engine thread) and queues it to the writer thread; a full queue drops the block
  lookup     how many leading hashes the tier holds (an in-memory index)
  load_async pins those blocks and queues a load into given device blocks (the loader thread)
Both threads and the engine share one lock around the index, the counters and the events.
Backends (host.py, disk.py) implement only where the bytes live: _prepare, _commit,
_discard, _delete, _read.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from engine.block_hash import BlockHash
from engine.block_pool import HashKey, KVEvent
from engine.kv_tier.device_copy import BlockCopier, BlockDestination, copy_out, start_event
from engine.kv_tier.file_format import BlockFileError
from engine.kv_tier.index import TierEntry, TierIndex
from engine.kv_tier.io_thread import IOThread
from engine.kv_tier.load import TierLoad
from engine.kv_tier.spec import TierCounters, TierIdentity, TierStats

logger = logging.getLogger(__name__)

DEFAULT_WRITE_QUEUE_BLOCKS = 64


@dataclass(frozen=True, slots=True)
class WriteJob:
    """One offered block on its way to the writer thread."""

    block_hash: BlockHash
    block: torch.Tensor  # host copy [L, 2, BS, KVH, D]
    ready: torch.cuda.Event | None  # CUDA: the copy out is complete after this event
    parent_hash: BlockHash | None
    hash_key: HashKey | None


@dataclass(frozen=True, slots=True)
class Staged:
    """A block written where the backend keeps it, not yet visible (e.g. a .tmp file)."""

    nbytes: int
    data: Any  # the backend's own: a tensor (host), a temporary path (disk)


class KVTier(ABC):
    """Bytes of whole KV blocks by block hash, LRU under a byte bound, written and loaded
    asynchronously. Thread-safe; close() when done."""

    medium: ClassVar[str]  # what KV events from this tier name as their medium
    persistent: ClassVar[bool]  # whether what it holds outlives the process

    def __init__(
        self,
        identity: TierIdentity,
        capacity_bytes: int,
        write_queue_blocks: int = DEFAULT_WRITE_QUEUE_BLOCKS,
    ) -> None:
        self.identity = identity
        self._lock = threading.Lock()
        self._index = TierIndex(capacity_bytes)
        self._counters = TierCounters()
        self._events: list[KVEvent] = []
        self._clock = 0  # last value of _tick(); strictly increasing
        self._closed = False
        self._copier = BlockCopier()
        self._writer = IOThread(self._write, f"kv-tier-{self.medium}-writer", write_queue_blocks)
        self._loader = IOThread(self._load, f"kv-tier-{self.medium}-loader")

    # ---- the engine's side --------------------------------------------------------------
    def offer(
        self,
        block_hash: BlockHash,
        layers: Sequence[torch.Tensor],
        parent_hash: BlockHash | None = None,
        hash_key: HashKey | None = None,
    ) -> bool:
        """Copy one block's KV (per-layer [2, BS, KVH, D] views) and queue it for storing.
        True when queued; False when already held (then marked used), closed, or the write
        queue is full (counted in dropped_writes). Never waits for storage."""
        self._check_layers(layers)
        with self._lock:
            if self._closed:
                return False
            if block_hash in self._index:
                self._index.touch(block_hash, self._tick())
                return False
        if not self._writer.has_room():
            with self._lock:
                self._counters.dropped_writes += 1
            return False
        block, ready = copy_out(layers)
        # Only offer() submits, from one thread: the room seen above is still there.
        if not self._writer.submit(WriteJob(block_hash, block, ready, parent_hash, hash_key)):
            with self._lock:
                self._counters.dropped_writes += 1
            return False
        return True

    def has_write_room(self) -> bool:
        """Whether offer() would queue a block now rather than drop it."""
        return self._writer.has_room()

    def lookup(
        self, block_hashes: Sequence[BlockHash], hash_keys: Sequence[HashKey] | None = None
    ) -> int:
        """How many leading hashes the tier holds (with keys: whose stored key matches too)."""
        with self._lock:
            n = self._index.leading(block_hashes, hash_keys)
            self._counters.queries += len(block_hashes)
            self._counters.hits += n
        return n

    def load_async(
        self,
        block_hashes: Sequence[BlockHash],
        dst: BlockDestination,
        hash_keys: Sequence[HashKey] | None = None,
    ) -> TierLoad:
        """Start loading the leading held blocks of block_hashes into dst.block_ids (the i-th
        block into the i-th id). The handle's num_blocks says how many it took (they cannot be
        evicted until it is done); poll or wait on it."""
        with self._lock:
            n = 0 if self._closed else self._index.leading(block_hashes, hash_keys)
            hashes = tuple(block_hashes[:n])
            # Touched tail first: the head of a prefix is the most recently used.
            for h in reversed(hashes):
                entry = self._index.get(h)
                if entry is None:  # leading() found it under this same lock
                    raise RuntimeError(f"tier index lost held block {h:#x}")
                entry.pins += 1
                self._index.touch(h, self._tick())
        load = TierLoad(hashes, dst, start_event(dst.device) if hashes else None)
        if not hashes:
            load.finish(0, 0.0)
        elif not self._loader.submit(load):
            self._unpin(hashes)
            load.finish(0, 0.0)
        return load

    def cancel_load(self, load: TierLoad) -> None:
        """Stop a load and return once it writes its destination blocks no more (a load not
        started yet is dropped; a running one stops after its current block)."""
        load.cancel()
        if self._loader.discard(load):
            self._unpin(load.block_hashes)
            load.finish(0, time.perf_counter() - load.started)
        load.wait()

    def held_hashes(self) -> list[BlockHash]:
        """Every held block hash, least recently used first."""
        with self._lock:
            return [e.block_hash for e in self._index]

    def take_events(self) -> list[KVEvent]:
        """Stored / removed events (medium = this tier's) since the last call, oldest first."""
        with self._lock:
            events, self._events = self._events, []
        return events

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(
                medium=self.medium,
                capacity_bytes=self._index.capacity_bytes,
                usage_bytes=self._index.usage_bytes,
                num_blocks=len(self._index),
                **dataclasses.asdict(self._counters),
            )

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is stored (or dropped); False on timeout. (A load is
        waited for on its own handle.)"""
        return self._writer.flush(timeout)

    def pause_writes(self) -> None:
        """Let the writer take no further blocks until resume_writes() (offers still queue,
        then drop once the queue is full)."""
        self._writer.pause()

    def resume_writes(self) -> None:
        self._writer.resume()

    def pause_loads(self) -> None:
        """Let the loader start no further loads until resume_loads() (handles stay not done)."""
        self._loader.pause()

    def resume_loads(self) -> None:
        self._loader.resume()

    def close(self) -> None:
        """Finish queued writes and loads, stop the threads, release the backend."""
        self._writer.close()
        self._loader.close()
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._close_backend()

    def __enter__(self) -> KVTier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def check_integrity(self) -> None:
        """Raise AssertionError unless the index is consistent (backends check their store)."""
        with self._lock:
            self._index.check_integrity()

    # ---- the threads --------------------------------------------------------------------
    def _write(self, job: WriteJob) -> None:
        if job.ready is not None:
            job.ready.synchronize()
        try:
            staged = self._prepare(job)
        except OSError as exc:
            with self._lock:
                self._write_failed(job, exc)
            return
        with self._lock:
            if self._closed or job.block_hash in self._index:
                self._discard(staged)
                return
            victims = self._index.make_room(staged.nbytes)
            if victims is None:
                self._discard(staged)
                self._counters.rejected_writes += 1
                return
            for victim in victims:
                self._remove(victim.block_hash, "evictions")
            now = self._tick()
            try:
                self._commit(job.block_hash, staged, now)
            except OSError as exc:
                self._discard(staged)
                self._write_failed(job, exc)
                return
            self._index.add(
                TierEntry(job.block_hash, staged.nbytes, job.parent_hash, job.hash_key, now)
            )
            self._counters.blocks_written += 1
            self._counters.bytes_written += staged.nbytes
            self._events.append(
                KVEvent("stored", (job.block_hash,), job.parent_hash, medium=self.medium)
            )

    def _load(self, load: TierLoad) -> None:
        try:
            n, nbytes = self._copy_blocks(load)
        except Exception:  # e.g. a device error: report nothing loaded, the engine recomputes
            logger.exception("KV tier (%s): a load failed", self.medium)
            n = nbytes = 0
        self._unpin(load.block_hashes)
        seconds = time.perf_counter() - load.started
        with self._lock:
            self._counters.loads += 1
            self._counters.blocks_read += n
            self._counters.bytes_read += nbytes
            self._counters.load_seconds += seconds
            uses = [(h, e.last_use) for h in load.block_hashes[:n] if (e := self._index.get(h))]
        self._used(uses)
        load.finish(n, seconds)

    def _copy_blocks(self, load: TierLoad) -> tuple[int, int]:
        """Copy the leading valid blocks into place; (blocks, bytes) once they have landed. A
        block that fails its checks is dropped from the tier and ends the load."""
        n = nbytes = 0
        for i, h in enumerate(load.block_hashes):
            if load.cancelled:
                break
            try:
                block = self._read(h)
            except (BlockFileError, OSError) as exc:
                kind = exc.kind if isinstance(exc, BlockFileError) else "corrupted"
                logger.warning("KV tier (%s): dropping block %#x: %s", self.medium, h, exc)
                with self._lock:
                    self._remove(h, f"{kind}_dropped")
                break
            self._copier.copy_in(block, load.dst, i, load.after)
            n += 1
            nbytes += block.numel() * block.element_size()
        self._copier.finish(load.dst)
        return n, nbytes

    # ---- shared helpers (call with the lock held where noted) ---------------------------
    def _tick(self) -> int:
        """The next value of a strictly increasing clock in ns (lock held)."""
        self._clock = max(time.time_ns(), self._clock + 1)
        return self._clock

    def _write_failed(self, job: WriteJob, exc: OSError) -> None:
        """Count and log a write that raised (lock held)."""
        logger.warning("KV tier (%s): cannot store block %#x: %s", self.medium, job.block_hash, exc)
        self._counters.failed_writes += 1

    def _remove(self, block_hash: BlockHash, counter: str) -> None:
        """Drop a block, count it under `counter`, publish its removal (lock held)."""
        if self._index.remove(block_hash) is None:
            return
        try:
            self._delete(block_hash)
        except OSError as exc:
            logger.warning(
                "KV tier (%s): cannot delete block %#x: %s", self.medium, block_hash, exc
            )
        setattr(self._counters, counter, getattr(self._counters, counter) + 1)
        self._events.append(KVEvent("removed", (block_hash,), medium=self.medium))

    def _unpin(self, hashes: Sequence[BlockHash]) -> None:
        with self._lock:
            for h in hashes:
                entry = self._index.get(h)
                if entry is not None:
                    entry.pins -= 1

    def _check_layers(self, layers: Sequence[torch.Tensor]) -> None:
        ident = self.identity
        if len(layers) != ident.num_layers:
            raise ValueError(f"{len(layers)} layers offered, this tier stores {ident.num_layers}")
        for layer in layers:
            if tuple(layer.shape) != ident.block_shape[1:] or layer.dtype != ident.torch_dtype:
                raise ValueError(
                    f"a layer of shape {tuple(layer.shape)} {layer.dtype}; this tier stores "
                    f"{ident.block_shape[1:]} {ident.torch_dtype}"
                )

    # ---- the backend --------------------------------------------------------------------
    @abstractmethod
    def _prepare(self, job: WriteJob) -> Staged:
        """Put the block's bytes where they will live, not yet visible (writer thread)."""

    @abstractmethod
    def _commit(self, block_hash: BlockHash, staged: Staged, last_use: int) -> None:
        """Make a prepared block visible under its hash (writer thread, lock held)."""

    @abstractmethod
    def _discard(self, staged: Staged) -> None:
        """Throw away a prepared block that will not be committed (lock held)."""

    @abstractmethod
    def _delete(self, block_hash: BlockHash) -> None:
        """Remove a committed block's bytes (lock held)."""

    @abstractmethod
    def _read(self, block_hash: BlockHash) -> torch.Tensor:
        """The block's host tensor [L, 2, BS, KVH, D] (loader thread; the entry is pinned).
        Raises BlockFileError when the stored bytes are not this block's valid KV."""

    @abstractmethod
    def _used(self, uses: list[tuple[BlockHash, int]]) -> None:
        """Blocks just loaded, with their new last-use clock (loader thread, no lock)."""

    @abstractmethod
    def _close_backend(self) -> None:
        """Release what the backend holds (after the threads stopped)."""
