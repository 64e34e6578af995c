"""Announcement: the frame a sender queues in the pair store before a transfer's payload."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack

from kvtransfer.descriptor import TransferDescriptor
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
