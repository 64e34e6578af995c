"""kvtransfer: move KV-cache blocks between two engines over pairwise torch.distributed groups.

Sender (prefill, rank 0)::

    registry = GroupRegistry(kv_device)                  # gloo on CPU, NCCL on CUDA
    address = registry.host(decode_id)                   # send over any control channel
    stats = KVTransfer(registry).send(decode_id, kv_cache, descriptor)

Receiver (decode, rank 1)::

    registry = GroupRegistry(kv_device)
    registry.join(prefill_id, address)
    descriptor, stats = KVTransfer(registry).recv(prefill_id, kv_cache, wait=5.0)

The other way, over the same pair (kvtransfer.pull): the prefill side asks for cached blocks
with KVTransfer.pull(decode_id, kv_cache, PullAsk(...)); the decode side answers them inside
recv(..., serve=PullServer).

The names below load on first use (PEP 562), so that importing a light module of the package
(kvtransfer.options) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtransfer.announcement import PullAsk
    from kvtransfer.backends import resolve_backend
    from kvtransfer.descriptor import DTYPES, TransferDescriptor, dtype_name
    from kvtransfer.errors import (
        AddressError,
        DescriptorError,
        PeerLost,
        TransferError,
        TransferRejected,
        TransferTimeout,
        UnknownPeer,
    )
    from kvtransfer.group import GroupRegistry
    from kvtransfer.lease import Lease, LeaseError, LeaseTable
    from kvtransfer.packing import Staging, check_cache, pack, plan_messages, unpack, wire_order
    from kvtransfer.pair import PeerGroup
    from kvtransfer.pull import PullServer
    from kvtransfer.transfer import KVTransfer
    from kvtransfer.transfer_stats import TransferStats

_MODULE_OF = {
    "PullAsk": "kvtransfer.announcement",
    "resolve_backend": "kvtransfer.backends",
    "DTYPES": "kvtransfer.descriptor",
    "TransferDescriptor": "kvtransfer.descriptor",
    "dtype_name": "kvtransfer.descriptor",
    "AddressError": "kvtransfer.errors",
    "DescriptorError": "kvtransfer.errors",
    "PeerLost": "kvtransfer.errors",
    "TransferError": "kvtransfer.errors",
    "TransferRejected": "kvtransfer.errors",
    "TransferTimeout": "kvtransfer.errors",
    "UnknownPeer": "kvtransfer.errors",
    "GroupRegistry": "kvtransfer.group",
    "Lease": "kvtransfer.lease",
    "LeaseError": "kvtransfer.lease",
    "LeaseTable": "kvtransfer.lease",
    "Staging": "kvtransfer.packing",
    "check_cache": "kvtransfer.packing",
    "pack": "kvtransfer.packing",
    "plan_messages": "kvtransfer.packing",
    "unpack": "kvtransfer.packing",
    "wire_order": "kvtransfer.packing",
    "PeerGroup": "kvtransfer.pair",
    "PullServer": "kvtransfer.pull",
    "KVTransfer": "kvtransfer.transfer",
    "TransferStats": "kvtransfer.transfer_stats",
}
__all__ = [
    "DTYPES",
    "AddressError",
    "DescriptorError",
    "GroupRegistry",
    "KVTransfer",
    "Lease",
    "LeaseError",
    "LeaseTable",
    "PeerGroup",
    "PeerLost",
    "PullAsk",
    "PullServer",
    "Staging",
    "TransferDescriptor",
    "TransferError",
    "TransferRejected",
    "TransferStats",
    "TransferTimeout",
    "UnknownPeer",
    "check_cache",
    "dtype_name",
    "pack",
    "plan_messages",
    "resolve_backend",
    "unpack",
    "wire_order",
]


def __getattr__(name: str):
    """Import a public name's module when the name is first used."""
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'kvtransfer' has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULE_OF[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))
