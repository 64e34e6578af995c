"""TransferStats: what one transfer (or pull) moved and how long it took."""

from __future__ import annotations

from dataclasses import dataclass

from kvtransfer.descriptor import TransferDescriptor


@dataclass(frozen=True, slots=True)
class TransferStats:
    """What one transfer moved and how long it took (measured on the side that reports it)."""

    request_id: str
    num_blocks: int
    num_layers: int
    num_messages: int
    payload_bytes: int  # KV bytes through the backend group
    control_bytes: int  # announcement frame through the pair store
    seconds: float

    @property
    def wire_bytes(self) -> int:
        """All bytes the transfer put on the wire."""
        return self.payload_bytes + self.control_bytes


def stats_of(
    desc: TransferDescriptor, num_messages: int, payload: int, control: int, seconds: float
) -> TransferStats:
    """The stats of a finished transfer of desc."""
    return TransferStats(
        desc.request_id, desc.num_blocks, desc.num_layers, num_messages, payload, control, seconds
    )
