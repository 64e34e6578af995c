"""The disk tier's block file: one block's KV with a self-describing, checksummed header.

Layout (little endian):
  magic        8 bytes  b"BATONKV\\x01"
  header_len   u32
  header_crc   u32      zlib.crc32 of the header bytes
  header       msgpack map (BlockHeader's fields)
  payload      payload_len bytes: the block tensor [L, 2, BS, KVH, D] in C order
The header carries what makes the payload valid for an engine (TierIdentity: model
fingerprint, hash seed, block size, dtype, shape) and a blake2b-128 digest of the payload.
A file whose size differs from 16 + header_len + payload_len is truncated (or corrupted when
longer). Reading a header costs one small read; the payload digest is checked when the payload
is read (a load), never trusted without it.
"""

from __future__ import annotations

import hashlib
import io
import struct
import zlib
from dataclasses import dataclass
from typing import BinaryIO

import msgpack
import torch

from engine.block_hash import BlockHash
from engine.block_pool import HashKey
from engine.kv_tier.spec import TierIdentity

MAGIC = b"BATONKV\x01"
PREFIX = struct.Struct("<8sII")  # magic, header length, header crc32
MAX_HEADER = 1 << 20  # a header is a few hundred bytes; anything larger is garbage
DIGEST_SIZE = 16


class BlockFileError(Exception):
    """A block file that must not be loaded as KV; `kind` names the counter it goes to."""

    kind = "corrupted"


class TruncatedBlockFile(BlockFileError):
    """The file ends before its header or payload does (a torn or interrupted write)."""

    kind = "truncated"


class CorruptedBlockFile(BlockFileError):
    """Bad magic, header checksum, header fields, payload size or payload digest."""

    kind = "corrupted"


class ForeignBlockFile(BlockFileError):
    """A valid file of another identity (model, hash seed, block size, dtype or shape)."""

    kind = "foreign"


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """The header of one block file."""

    block_hash: BlockHash
    parent_hash: BlockHash | None
    hash_key: HashKey | None
    model_fingerprint: str
    hash_seed: str
    block_size: int
    dtype: str
    shape: tuple[int, ...]
    payload_len: int
    payload_digest: bytes

    def mismatch(self, identity: TierIdentity) -> str | None:
        """What differs from `identity`, or None when the file is this engine's."""
        want = {
            "model_fingerprint": identity.model_fingerprint,
            "hash_seed": identity.hash_seed,
            "block_size": identity.block_size,
            "dtype": identity.dtype,
            "shape": identity.block_shape,
        }
        for name, value in want.items():
            if getattr(self, name) != value:
                return f"{name} {getattr(self, name)!r} != {value!r}"
        return None


def payload_digest(payload: memoryview | bytes | bytearray) -> bytes:
    return hashlib.blake2b(payload, digest_size=DIGEST_SIZE).digest()


def tensor_bytes(block: torch.Tensor) -> memoryview:
    """The raw bytes of a (CPU) block tensor, C order, without copying a contiguous one."""
    flat = block.contiguous().reshape(-1).view(torch.uint8)
    return flat.numpy().data


def make_header(
    identity: TierIdentity,
    block_hash: BlockHash,
    payload: memoryview,
    parent_hash: BlockHash | None = None,
    hash_key: HashKey | None = None,
) -> BlockHeader:
    return BlockHeader(
        block_hash=block_hash,
        parent_hash=parent_hash,
        hash_key=hash_key,
        model_fingerprint=identity.model_fingerprint,
        hash_seed=identity.hash_seed,
        block_size=identity.block_size,
        dtype=identity.dtype,
        shape=identity.block_shape,
        payload_len=len(payload),
        payload_digest=payload_digest(payload),
    )


def _pack_header(header: BlockHeader) -> bytes:
    key = header.hash_key
    return msgpack.packb(
        {
            "block_hash": header.block_hash,
            "parent_hash": header.parent_hash,
            "hash_key": None if key is None else [key[0], list(key[1]), list(key[2])],
            "model_fingerprint": header.model_fingerprint,
            "hash_seed": header.hash_seed,
            "block_size": header.block_size,
            "dtype": header.dtype,
            "shape": list(header.shape),
            "payload_len": header.payload_len,
            "payload_digest": header.payload_digest,
        }
    )


def write_block(f: BinaryIO, header: BlockHeader, payload: memoryview) -> int:
    """Write header and payload to an open file; returns the bytes written."""
    packed = _pack_header(header)
    f.write(PREFIX.pack(MAGIC, len(packed), zlib.crc32(packed)))
    f.write(packed)
    f.write(payload)
    return PREFIX.size + len(packed) + len(payload)


def read_header(f: BinaryIO, file_size: int) -> BlockHeader:
    """Parse and check the header of a file of `file_size` bytes (positioned at 0); leaves f at
    the payload. Raises a BlockFileError subclass; checks the size, not the payload digest."""
    prefix = f.read(PREFIX.size)
    if len(prefix) < PREFIX.size:
        raise TruncatedBlockFile(f"{len(prefix)} bytes: shorter than the {PREFIX.size}-byte prefix")
    magic, header_len, crc = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise CorruptedBlockFile(f"bad magic {magic!r}")
    if header_len > MAX_HEADER:
        raise CorruptedBlockFile(f"header length {header_len} is implausible")
    packed = f.read(header_len)
    if len(packed) < header_len:
        raise TruncatedBlockFile(f"header cut at {len(packed)} of {header_len} bytes")
    if zlib.crc32(packed) != crc:
        raise CorruptedBlockFile("header checksum mismatch")
    header = _unpack_header(packed)
    expected = PREFIX.size + header_len + header.payload_len
    if file_size < expected:
        raise TruncatedBlockFile(f"{file_size} bytes, header says {expected}")
    if file_size > expected:
        raise CorruptedBlockFile(f"{file_size} bytes, header says {expected}")
    return header


def check_header(header: BlockHeader, identity: TierIdentity, block_hash: BlockHash) -> None:
    """Raise ForeignBlockFile unless the header is of `identity`, CorruptedBlockFile unless it
    is of `block_hash` (the hash its file name says) with a payload of the identity's size."""
    why = header.mismatch(identity)
    if why is not None:
        raise ForeignBlockFile(why)
    if header.block_hash != block_hash:
        raise CorruptedBlockFile(
            f"header of block {header.block_hash:#x} in {block_hash:#x}'s file"
        )
    if header.payload_len != identity.block_bytes:
        raise CorruptedBlockFile(
            f"payload of {header.payload_len} bytes, want {identity.block_bytes}"
        )


def _unpack_header(packed: bytes) -> BlockHeader:
    try:
        d = msgpack.unpackb(packed)
        key = d["hash_key"]
        header = BlockHeader(
            block_hash=int(d["block_hash"]),
            parent_hash=d["parent_hash"],
            hash_key=None if key is None else (key[0], tuple(key[1]), tuple(key[2])),
            model_fingerprint=str(d["model_fingerprint"]),
            hash_seed=str(d["hash_seed"]),
            block_size=int(d["block_size"]),
            dtype=str(d["dtype"]),
            shape=tuple(int(x) for x in d["shape"]),
            payload_len=int(d["payload_len"]),
            payload_digest=bytes(d["payload_digest"]),
        )
    except (ValueError, TypeError, KeyError, IndexError, msgpack.UnpackException) as exc:
        raise CorruptedBlockFile(f"unreadable header fields: {exc!r}") from exc
    if header.payload_len < 0:
        raise CorruptedBlockFile(f"negative payload length {header.payload_len}")
    return header


def read_payload(f: io.BufferedIOBase, header: BlockHeader, identity: TierIdentity) -> torch.Tensor:
    """The payload after read_header(), digest-checked, as a block tensor of `identity`
    (check_header() passed first)."""
    data = bytearray(header.payload_len)
    got = f.readinto(data)
    if got < header.payload_len:
        raise TruncatedBlockFile(f"payload cut at {got} of {header.payload_len} bytes")
    if payload_digest(data) != header.payload_digest:
        raise CorruptedBlockFile("payload checksum mismatch")
    flat = torch.frombuffer(data, dtype=torch.uint8)
    return flat.view(identity.torch_dtype).view(identity.block_shape)
