"""kvtransfer: move KV-cache blocks between two engines over pairwise torch.distributed groups.

Sender (prefill, rank 0)::

    registry = GroupRegistry(kv_device)                  # gloo on CPU, NCCL on CUDA
    address = registry.host(decode_id)                   # send over any control channel
    stats = KVTransfer(registry).send(decode_id, kv_cache, descriptor)

Receiver (decode, rank 1)::

    registry = GroupRegistry(kv_device)
    registry.join(prefill_id, address)
    descriptor, stats = KVTransfer(registry).recv(prefill_id, kv_cache, wait=5.0)
"""

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
from kvtransfer.transfer import KVTransfer, TransferStats

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
