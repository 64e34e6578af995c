"""TransferDescriptor: what one KV transfer moves, and its msgpack wire form."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import msgpack
import torch

from kvtransfer.errors import DescriptorError

WIRE_VERSION = 1
UINT64_MAX = (1 << 64) - 1
INT64_MAX = (1 << 63) - 1

# Supported KV dtypes by wire name; the name is what travels, never the torch repr.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a torch dtype ("float32"); DescriptorError if kvtransfer cannot move it."""
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise DescriptorError(f"unsupported KV dtype {dtype}; supported: {sorted(DTYPES)}")


@dataclass(frozen=True, slots=True)
class TransferDescriptor:
    """One request's KV hand-over: which prompt blocks move, from which to which block ids.

    Invariants (checked on construction): `missing`, `src_block_ids` and `dst_block_ids` have
    equal length and are aligned (missing[i] is the prompt block stored at src_block_ids[i] on
    the sender and written to dst_block_ids[i] on the receiver); `missing` is strictly
    increasing and indexes the prompt's ceil(num_prompt_tokens / block_size) blocks;
    `block_hashes` covers the full blocks only (num_prompt_tokens // block_size of them).
    """

    request_id: str
    block_hashes: tuple[int, ...]  # uint64 chained hash per full prompt block
    missing: tuple[int, ...]  # prompt block indices that move (the receiver lacks them)
    src_block_ids: tuple[int, ...]  # sender's block ids, aligned with `missing`
    dst_block_ids: tuple[int, ...]  # receiver's block ids, aligned with `missing`
    layers: tuple[int, int]  # [start, end) layer range
    dtype: str  # key of DTYPES
    block_shape: tuple[int, int, int]  # (block_size, num_kv_heads, head_dim)
    first_token: int
    num_prompt_tokens: int
    sampling: dict[str, Any] = field(default_factory=dict)  # plain msgpack-able dict

    def __post_init__(self) -> None:
        # Normalise sequences to tuples so a descriptor is immutable and compares by value.
        for name in (
            "block_hashes",
            "missing",
            "src_block_ids",
            "dst_block_ids",
            "layers",
            "block_shape",
        ):
            value = getattr(self, name)
            if isinstance(value, str | bytes) or not isinstance(value, Sequence):
                raise DescriptorError(f"{name} must be a list of ints, got {type(value).__name__}")
            object.__setattr__(self, name, tuple(value))
        self._validate()

    # ---- derived sizes ------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Number of blocks that move."""
        return len(self.missing)

    @property
    def num_layers(self) -> int:
        """Number of layers in the layer range."""
        return self.layers[1] - self.layers[0]

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype named by `dtype`."""
        return DTYPES[self.dtype]

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one block of one layer, keys and values: 2 * bs * kvh * d * itemsize."""
        bs, kvh, d = self.block_shape
        return 2 * bs * kvh * d * self.torch_dtype.itemsize

    @property
    def payload_bytes(self) -> int:
        """KV bytes the transfer moves: blocks x layers x layer_block_bytes."""
        return self.num_blocks * self.num_layers * self.layer_block_bytes

    # ---- wire form ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain dict (lists, ints, strs) for control channels that carry dicts."""
        out: dict[str, Any] = {"v": WIRE_VERSION}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def encode(self) -> bytes:
        """msgpack bytes of `to_dict()`."""
        return msgpack.packb(self.to_dict(), use_bin_type=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TransferDescriptor:
        """Build from `to_dict()` output; DescriptorError names the first bad field."""
        if not isinstance(data, Mapping):
            raise DescriptorError(f"descriptor must be a map, got {type(data).__name__}")
        if data.get("v") != WIRE_VERSION:
            raise DescriptorError(
                f"descriptor version {data.get('v')!r} is not supported "
                f"(expected {WIRE_VERSION}); are both workers the same build?"
            )
        names = {f.name for f in fields(cls)}
        missing = sorted(names - data.keys())
        if missing:
            raise DescriptorError(f"descriptor is missing field(s) {missing}")
        unknown = sorted(set(data.keys()) - names - {"v"})
        if unknown:
            raise DescriptorError(f"descriptor has unknown field(s) {unknown}")
        return cls(**{name: data[name] for name in names})

    @classmethod
    def decode(cls, data: bytes) -> TransferDescriptor:
        """Parse `encode()` output; DescriptorError on malformed bytes or fields."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise DescriptorError(f"descriptor bytes expected, got {type(data).__name__}")
        try:
            obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            raise DescriptorError(f"descriptor is not valid msgpack: {e}") from e
        return cls.from_dict(obj)

    # ---- validation ---------------------------------------------------------------------
    def _validate(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise DescriptorError(f"request_id must be a non-empty str, got {self.request_id!r}")
        if self.dtype not in DTYPES:
            raise DescriptorError(
                f"dtype {self.dtype!r} is not supported; use one of {sorted(DTYPES)}"
            )
        _check_ints("block_shape", self.block_shape, low=1)
        if len(self.block_shape) != 3:
            raise DescriptorError(
                "block_shape must be (block_size, num_kv_heads, head_dim), "
                f"got {len(self.block_shape)} values"
            )
        _check_int("num_prompt_tokens", self.num_prompt_tokens, low=1)
        _check_int("first_token", self.first_token, low=0)
        _check_ints("layers", self.layers, low=0)
        if len(self.layers) != 2 or self.layers[0] >= self.layers[1]:
            raise DescriptorError(
                f"layers must be (start, end) with start < end, got {self.layers}"
            )

        block_size = self.block_shape[0]
        num_full = self.num_prompt_tokens // block_size
        num_blocks = -(-self.num_prompt_tokens // block_size)
        _check_ints("block_hashes", self.block_hashes, low=0, high=UINT64_MAX)
        if len(self.block_hashes) != num_full:
            raise DescriptorError(
                f"block_hashes has {len(self.block_hashes)} entries but a "
                f"{self.num_prompt_tokens}-token prompt has {num_full} full "
                f"blocks of {block_size}"
            )
        _check_ints("missing", self.missing, low=0, high=num_blocks - 1)
        if any(a >= b for a, b in zip(self.missing, self.missing[1:], strict=False)):
            raise DescriptorError("missing must be strictly increasing prompt block indices")
        for name in ("src_block_ids", "dst_block_ids"):
            ids = getattr(self, name)
            _check_ints(name, ids, low=0)
            if len(ids) != len(self.missing):
                raise DescriptorError(
                    f"{name} has {len(ids)} entries but missing has "
                    f"{len(self.missing)}; they must be aligned"
                )
            if len(set(ids)) != len(ids):
                raise DescriptorError(f"{name} contains duplicate block ids")
        if not isinstance(self.sampling, dict):
            raise DescriptorError(f"sampling must be a dict, got {type(self.sampling).__name__}")
        _check_plain("sampling", self.sampling)


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> None:
    # bool is an int subclass; a True block id is always a bug upstream.
    if isinstance(value, bool) or not isinstance(value, int):
        raise DescriptorError(f"{name} must be an int, got {type(value).__name__}")
    high = INT64_MAX if high is None else high
    if not low <= value <= high:
        raise DescriptorError(f"{name} = {value} is out of range [{low}, {high}]")


def _check_ints(name: str, values: tuple[Any, ...], low: int, high: int | None = None) -> None:
    for i, value in enumerate(values):
        _check_int(f"{name}[{i}]", value, low, high)


def _check_plain(path: str, value: Any) -> None:
    """Raise unless `value` is built from msgpack-native types (dict keys must be str)."""
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_plain(f"{path}[{i}]", item)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise DescriptorError(f"{path} has a non-str key {key!r}")
            _check_plain(f"{path}.{key}", item)
        return
    raise DescriptorError(
        f"{path} holds a {type(value).__name__}; only plain msgpack types "
        "(None, bool, int, float, str, bytes, list, dict) may travel"
    )
