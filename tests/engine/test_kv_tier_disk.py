"""DiskTier: block files, re-index on open (a new object on the same directory), dropped
truncated / corrupted / foreign files, the directory lock."""

from __future__ import annotations

import dataclasses
import os

import pytest

from engine.block_pool import KVEvent
from engine.kv_tier import DiskTier, TierLockedError
from engine.kv_tier.file_format import MAGIC, PREFIX, read_header
from tests.engine.kv_tier_helpers import (
    BLOCK_BYTES,
    IDENTITY,
    H,
    block_of,
    empty_cache,
    load,
    paged_cache,
    same_bytes,
    store,
)

CAPACITY = 64 * BLOCK_BYTES


@pytest.fixture
def tier_dir(tmp_path):
    return tmp_path / "tier"


def filled(tier_dir, pairs, kv, identity=IDENTITY, capacity=CAPACITY) -> None:
    """Store (hash, block id) pairs in a tier on tier_dir, then close it."""
    with DiskTier(identity, capacity, tier_dir) as tier:
        store(tier, kv, pairs)


def test_one_file_per_block_with_its_identity_in_the_header(tier_dir):
    kv = paged_cache()
    key = (H[7], (5, 6, 7, 8), ("salt",))
    with DiskTier(IDENTITY, CAPACITY, tier_dir) as tier:
        assert tier.offer(H[0], [v for v in block_of(kv, 2)], parent_hash=H[7], hash_key=key)
        assert tier.flush(timeout=30)
        path = tier.file_of(H[0])
        tier.check_integrity()
    assert sorted(p.name for p in tier_dir.iterdir()) == [".lock", f"{H[0]:016x}.kvb"]
    with open(path, "rb") as f:
        assert f.read(8) == MAGIC
        f.seek(0)
        header = read_header(f, path.stat().st_size)
    assert (header.block_hash, header.parent_hash, header.hash_key) == (H[0], H[7], key)
    assert header.model_fingerprint == "tiny-llama-test" and header.hash_seed == "tier-test"
    assert (header.block_size, header.dtype, header.shape) == (4, "float32", (2, 2, 4, 2, 8))
    assert header.payload_len == BLOCK_BYTES and len(header.payload_digest) == 16
    assert not list(tier_dir.glob("*.tmp"))


def test_reopen_reindexes_the_directory_in_lru_order(tier_dir):
    kv = paged_cache(seed=5)
    with DiskTier(IDENTITY, CAPACITY, tier_dir) as tier:
        store(tier, kv, [(H[0], 0), (H[1], 1), (H[2], 2)])
        assert load(tier, [H[0]], empty_cache(), [0]) == 1
        usage = tier.stats().usage_bytes
    reopened = DiskTier(IDENTITY, CAPACITY, tier_dir)
    try:
        assert reopened.held_hashes() == [H[1], H[2], H[0]]
        assert reopened.take_events() == [
            KVEvent("stored", (h,), medium="disk") for h in (H[1], H[2], H[0])
        ]
        s = reopened.stats()
        assert (s.usage_bytes, s.num_blocks, s.blocks_written) == (usage, 3, 0)
        assert s.truncated_dropped == s.corrupted_dropped == s.foreign_dropped == 0
        dst = empty_cache()
        assert load(reopened, [H[0], H[1], H[2]], dst, [5, 6, 7]) == 3
        for src, d in [(0, 5), (1, 6), (2, 7)]:
            assert same_bytes(block_of(dst, d), block_of(kv, src))
        store(reopened, kv, [(H[3], 3)])  # new uses come after the re-indexed ones
        assert reopened.held_hashes() == [H[2], H[1], H[0], H[3]]
        reopened.check_integrity()
    finally:
        reopened.close()


def test_a_truncated_file_is_dropped_and_counted_on_open(tier_dir):
    filled(tier_dir, [(H[0], 0), (H[1], 1), (H[2], 2)], paged_cache())
    path = tier_dir / f"{H[1]:016x}.kvb"
    os.truncate(path, path.stat().st_size - 100)
    header_only = tier_dir / f"{H[2]:016x}.kvb"
    os.truncate(header_only, PREFIX.size + 5)
    with DiskTier(IDENTITY, CAPACITY, tier_dir) as tier:
        assert tier.held_hashes() == [H[0]]
        assert tier.stats().truncated_dropped == 2
        assert tier.take_events() == [KVEvent("stored", (H[0],), medium="disk")]
        assert not path.exists() and not header_only.exists()
        tier.check_integrity()


def test_a_corrupted_header_is_dropped_and_counted_on_open(tier_dir):
    filled(tier_dir, [(H[0], 0), (H[1], 1), (H[2], 2)], paged_cache())
    flip(tier_dir / f"{H[0]:016x}.kvb", PREFIX.size + 3)  # inside the msgpack header
    flip(tier_dir / f"{H[1]:016x}.kvb", 0)  # the magic
    (tier_dir / f"{H[3]:016x}.kvb").write_bytes(b"")  # empty
    (tier_dir / "not-a-hash.kvb").write_bytes(b"x" * 40)
    with DiskTier(IDENTITY, CAPACITY, tier_dir) as tier:
        assert tier.held_hashes() == [H[2]]
        s = tier.stats()
        assert (s.corrupted_dropped, s.truncated_dropped) == (3, 1)
        tier.check_integrity()


def test_a_corrupted_payload_is_caught_at_load_and_never_loaded(tier_dir):
    kv = paged_cache()
    filled(tier_dir, [(H[0], 0), (H[1], 1), (H[2], 2)], kv)
    path = tier_dir / f"{H[1]:016x}.kvb"
    flip(path, path.stat().st_size - 1)  # the last payload byte
    with DiskTier(IDENTITY, CAPACITY, tier_dir) as tier:
        assert tier.held_hashes() == [H[0], H[1], H[2]]  # headers are fine: checked lazily
        tier.take_events()
        assert tier.lookup([H[0], H[1], H[2]]) == 3
        dst = empty_cache()
        assert load(tier, [H[0], H[1], H[2]], dst, [4, 5, 6]) == 1
        assert same_bytes(block_of(dst, 4), block_of(kv, 0))
        assert not block_of(dst, 5).any() and not block_of(dst, 6).any()
        assert tier.held_hashes() == [H[2], H[0]]
        assert tier.stats().corrupted_dropped == 1
        assert tier.take_events() == [KVEvent("removed", (H[1],), medium="disk")]
        assert not path.exists()
        assert tier.lookup([H[0], H[1], H[2]]) == 1
        tier.check_integrity()


def test_a_file_renamed_to_another_hash_is_corrupted(tier_dir):
    filled(tier_dir, [(H[0], 0)], paged_cache())
    os.rename(tier_dir / f"{H[0]:016x}.kvb", tier_dir / f"{H[5]:016x}.kvb")
    with DiskTier(IDENTITY, CAPACITY, tier_dir) as tier:
        assert tier.held_hashes() == []
        assert tier.stats().corrupted_dropped == 1


@pytest.mark.parametrize(
    "change",
    [
        {"model_fingerprint": "another-model"},
        {"hash_seed": "another-seed"},
        {"block_size": 8},
        {"dtype": "bfloat16"},
        {"num_layers": 3},
        {"head_dim": 16},
    ],
    ids=lambda c: next(iter(c)),
)
def test_files_of_another_identity_are_rejected(tier_dir, change):
    filled(tier_dir, [(H[0], 0), (H[1], 1)], paged_cache())
    other = dataclasses.replace(IDENTITY, **change)
    with DiskTier(other, CAPACITY, tier_dir) as tier:
        assert tier.held_hashes() == [] and tier.take_events() == []
        s = tier.stats()
        assert (s.foreign_dropped, s.usage_bytes) == (2, 0)
        assert tier.lookup([H[0]]) == 0
    assert list(tier_dir.glob("*.kvb")) == []


def test_left_over_temporary_files_are_dropped_and_other_files_left_alone(tier_dir):
    filled(tier_dir, [(H[0], 0)], paged_cache())
    (tier_dir / f"{H[1]:016x}.tmp").write_bytes(b"partial")
    (tier_dir / "README").write_text("not a block")
    with DiskTier(IDENTITY, CAPACITY, tier_dir) as tier:
        assert tier.held_hashes() == [H[0]]
        assert tier.stats().truncated_dropped == 1
    assert sorted(p.name for p in tier_dir.iterdir()) == [".lock", f"{H[0]:016x}.kvb", "README"]


def test_reopening_with_less_capacity_keeps_the_most_recently_used(tier_dir):
    filled(tier_dir, [(H[0], 0), (H[1], 1), (H[2], 2), (H[3], 3)], paged_cache())
    size = (tier_dir / f"{H[0]:016x}.kvb").stat().st_size
    with DiskTier(IDENTITY, 2 * size, tier_dir) as tier:
        assert tier.held_hashes() == [H[2], H[3]]
        assert tier.stats().evictions == 2
        tier.check_integrity()


def test_a_second_opener_of_a_directory_is_refused(tier_dir):
    first = DiskTier(IDENTITY, CAPACITY, tier_dir)
    with pytest.raises(TierLockedError, match=rf"in use by another engine \(pid {os.getpid()}\)"):
        DiskTier(IDENTITY, CAPACITY, tier_dir)
    first.close()
    with DiskTier(IDENTITY, CAPACITY, tier_dir) as again:  # the lock went with the first
        assert again.held_hashes() == []


def test_a_second_process_is_refused_too(tier_dir):
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from engine.kv_tier import DiskTier, TierLockedError\n"
        "from tests.engine.kv_tier_helpers import IDENTITY\n"
        "try:\n"
        f"    DiskTier(IDENTITY, 1 << 20, {str(tier_dir)!r})\n"
        "except TierLockedError as exc:\n"
        "    print(exc); sys.exit(3)\n"
    )
    with DiskTier(IDENTITY, CAPACITY, tier_dir):
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
        )
    assert done.returncode == 3, done.stderr
    assert f"pid {os.getpid()}" in done.stdout


def flip(path, offset: int) -> None:
    """Invert one byte of a file in place (keeping its mtime: its last use)."""
    mtime = path.stat().st_mtime_ns
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(mtime, mtime))


def test_a_failed_write_is_counted_and_stores_nothing(tier_dir):
    import shutil

    with DiskTier(IDENTITY, CAPACITY, tier_dir) as tier:
        shutil.rmtree(tier_dir)  # every write now fails (no directory)
        kv = paged_cache()
        assert tier.offer(H[0], [v for v in block_of(kv, 0)])
        assert tier.flush(timeout=30)
        s = tier.stats()
        assert (s.failed_writes, s.blocks_written, s.num_blocks) == (1, 0, 0)
        assert tier.take_events() == []
