"""Exceptions raised by kvtransfer; every transfer failure is a TransferError."""

from __future__ import annotations


class TransferError(RuntimeError):
    """A transfer did not complete; unless a subclass says otherwise, the pair's group was torn
    down and the next transfer with that peer rebuilds it."""


class TransferTimeout(TransferError):
    """The peer made no progress within the deadline (hung, overloaded or partitioned)."""


class PeerLost(TransferError):
    """The peer's process or store is gone; remove the peer and exchange a new address."""


class TransferRejected(TransferError):
    """The receiver refused an announced transfer; its payload was drained, the group is intact."""


class UnknownPeer(TransferError):
    """No group is registered for this peer id (never hosted/joined, or already removed)."""


class DescriptorError(ValueError):
    """A transfer descriptor is malformed or does not fit the KV cache it is applied to."""


class AddressError(ValueError):
    """A peer address (from host()) is malformed or was made for a different backend."""
