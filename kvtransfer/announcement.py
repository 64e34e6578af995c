"""The frames of a pair's queues in its store: an Announcement precedes a transfer's payload
(or answers a pull); a PullAsk asks the joined side for blocks (kvtransfer.pull)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import msgpack

from kvtransfer.descriptor import INT64_MAX, UINT64_MAX, TransferDescriptor
from kvtransfer.errors import DescriptorError

ANNOUNCEMENT_VERSION = 2
MODE_PACKED, MODE_RUNS = "packed", "runs"  # payload: staged messages | zero-copy block runs


@dataclass(frozen=True, slots=True)
class Announcement:
    """A transfer about to start: the group epoch it uses, how its payload is cut into
    messages (the receiver follows the sender's plan and mode), and its descriptor."""

    epoch: int
    layers_per_message: int
    descriptor: TransferDescriptor
    mode: str = MODE_PACKED
    nbytes: int = field(default=0, compare=False)  # size on the wire, set by decode()

    def encode(self) -> bytes:
        """msgpack bytes."""
        return msgpack.packb(
            {
                "v": ANNOUNCEMENT_VERSION,
                "epoch": self.epoch,
                "layers_per_message": self.layers_per_message,
                "mode": self.mode,
                "descriptor": self.descriptor.encode(),
            },
            use_bin_type=True,
        )

    @classmethod
    def decode(cls, raw: bytes) -> Announcement:
        """Parse `encode()` output; DescriptorError if malformed."""
        try:
            obj = msgpack.unpackb(raw, raw=False, strict_map_key=True)
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            raise DescriptorError(f"announcement is not valid msgpack: {e}") from e
        version = obj.get("v") if isinstance(obj, dict) else None
        if version != ANNOUNCEMENT_VERSION:
            raise DescriptorError(
                f"announcement version {version!r} is not "
                f"{ANNOUNCEMENT_VERSION}; are both workers the same build?"
            )
        epoch, lpm = obj.get("epoch"), obj.get("layers_per_message")
        if (
            isinstance(epoch, bool)
            or not isinstance(epoch, int)
            or epoch < 0
            or isinstance(lpm, bool)
            or not isinstance(lpm, int)
            or lpm < 1
        ):
            raise DescriptorError(
                f"announcement has a bad epoch or layers_per_message: {epoch!r}, {lpm!r}"
            )
        mode = obj.get("mode")
        if mode not in (MODE_PACKED, MODE_RUNS):
            raise DescriptorError(f"announcement has an unknown payload mode {mode!r}")
        return cls(epoch, lpm, TransferDescriptor.decode(obj.get("descriptor")), mode, len(raw))


PULL_KIND = "pull"


@dataclass(frozen=True, slots=True)
class PullAsk:
    """A request for the KV of blocks [start, start + len(dst_block_ids)) of a token run.

    block_hashes: the asker's chained hashes of every full block of token_ids (block 0 on);
    token_ids: exactly len(block_hashes) full blocks; dst_block_ids: the asker's blocks for
    blocks start, start + 1, ... (the answer fills a leading part of them).
    """

    pull_id: str
    block_hashes: tuple[int, ...]
    token_ids: tuple[int, ...]
    cache_salt: str | None
    start: int
    dst_block_ids: tuple[int, ...]
    epoch: int = 0  # the pair epoch it is asked in (KVTransfer.pull sets it)

    def __post_init__(self) -> None:
        for name in ("block_hashes", "token_ids", "dst_block_ids"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        self._validate()

    @property
    def block_size(self) -> int:
        return len(self.token_ids) // len(self.block_hashes)

    def encode(self) -> bytes:
        """msgpack bytes (a frame of the host -> joiner queue)."""
        return msgpack.packb(
            {
                "v": ANNOUNCEMENT_VERSION,
                "kind": PULL_KIND,
                "pull_id": self.pull_id,
                "epoch": self.epoch,
                "block_hashes": list(self.block_hashes),
                "token_ids": list(self.token_ids),
                "cache_salt": self.cache_salt,
                "start": self.start,
                "dst_block_ids": list(self.dst_block_ids),
            },
            use_bin_type=True,
        )

    @classmethod
    def from_dict(cls, obj: dict) -> PullAsk:
        """From the decoded frame; DescriptorError names what is wrong."""
        names = ("pull_id", "block_hashes", "token_ids", "cache_salt", "start", "dst_block_ids")
        missing = [n for n in (*names, "epoch") if n not in obj]
        if missing:
            raise DescriptorError(f"pull ask is missing field(s) {missing}")
        try:
            return cls(**{n: obj[n] for n in names}, epoch=obj["epoch"])
        except TypeError as e:
            raise DescriptorError(f"pull ask has a malformed field: {e}") from e

    def describe(
        self,
        src_block_ids: Sequence[int],
        layers: tuple[int, int],
        dtype: str,
        block_shape: tuple[int, int, int],
    ) -> TransferDescriptor:
        """The answer's descriptor: the asked blocks from `start` that the joined side holds
        (src_block_ids, in order: they fill the leading dst_block_ids)."""
        n = len(src_block_ids)
        return TransferDescriptor(
            request_id=self.pull_id,
            block_hashes=self.block_hashes,
            missing=tuple(range(self.start, self.start + n)),
            src_block_ids=tuple(src_block_ids),
            dst_block_ids=self.dst_block_ids[:n],
            layers=layers,
            dtype=dtype,
            block_shape=block_shape,
            first_token=0,  # no token is sampled: the blocks are a cached prefix
            num_prompt_tokens=len(self.token_ids),
        )

    def _validate(self) -> None:
        if not isinstance(self.pull_id, str) or not self.pull_id:
            raise DescriptorError(f"pull_id must be a non-empty str, got {self.pull_id!r}")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise DescriptorError("cache_salt must be a str or None")
        ints = {
            "epoch": (self.epoch,),
            "start": (self.start,),
            "block_hashes": self.block_hashes,
            "token_ids": self.token_ids,
            "dst_block_ids": self.dst_block_ids,
        }
        for name, values in ints.items():
            high = UINT64_MAX if name == "block_hashes" else INT64_MAX
            if not all(_is_int(v, high) for v in values):
                raise DescriptorError(f"{name} must hold ints in [0, {high}]")
        n = len(self.block_hashes)
        if n == 0 or len(self.token_ids) % n or len(self.token_ids) < n:
            raise DescriptorError(
                f"token_ids ({len(self.token_ids)}) must be whole blocks, one per block hash ({n})"
            )
        if not 0 <= self.start < n or not 0 < len(self.dst_block_ids) <= n - self.start:
            raise DescriptorError(
                f"start {self.start} with {len(self.dst_block_ids)} destination blocks does "
                f"not fit {n} blocks"
            )
        if len(set(self.dst_block_ids)) != len(self.dst_block_ids):
            raise DescriptorError("dst_block_ids contains duplicate block ids")


def _is_int(value: object, high: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and 0 <= value <= high


def decode_frame(raw: bytes) -> Announcement | PullAsk:
    """A frame of the pair's announcement queues: a transfer or a pull ask."""
    try:
        obj = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise DescriptorError(f"announcement is not valid msgpack: {e}") from e
    if isinstance(obj, dict) and obj.get("kind") == PULL_KIND:
        if obj.get("v") != ANNOUNCEMENT_VERSION:
            raise DescriptorError(
                f"pull ask version {obj.get('v')!r} is not {ANNOUNCEMENT_VERSION}; "
                "are both workers the same build?"
            )
        return PullAsk.from_dict(obj)
    return Announcement.decode(raw)
