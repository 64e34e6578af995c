"""GroupRegistry: a worker's pairwise groups by peer id, created and torn down on demand.

No world group: a prefill worker (rank 0 of each of its pairs) hosts one TCPStore per decode
peer on a free port; the decode worker (rank 1) joins it with the address dict the prefill side
handed it over any control channel. Workers join and leave while the others keep running.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kvtransfer.backends import resolve_backend, route_to
from kvtransfer.errors import AddressError, PeerLost, UnknownPeer
from kvtransfer.pair import (
    EPOCH_KEY,
    HOST_RANK,
    JOIN_RANK,
    BoundedCaller,
    PeerGroup,
    StoreHung,
)


class GroupRegistry:
    """This worker's pairwise groups by peer id: created on demand, torn down when peers leave.

    Sender side (prefill, rank 0): `address = host(peer_id)`, hand `address` to the peer over
    any control channel. Receiver side (decode, rank 1): `join(peer_id, address)`. The backend
    group itself is built by the first transfer (`kvtransfer.transfer.KVTransfer`).
    """

    def __init__(
        self,
        device: torch.device | str,
        backend: str = "auto",
        host: str = "127.0.0.1",
        timeout: float = 10.0,
    ) -> None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.device = device
        self.backend = resolve_backend(backend, device)
        self.host_address = host  # advertised to peers; must be reachable from them
        self.timeout = timeout
        self._groups: dict[str, PeerGroup] = {}
        self._lock = threading.Lock()

    def __contains__(self, peer_id: object) -> bool:
        with self._lock:
            return peer_id in self._groups

    def __enter__(self) -> GroupRegistry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def peers(self) -> list[str]:
        """Peer ids with a registered group, sorted."""
        with self._lock:
            return sorted(self._groups)

    def host(self, peer_id: str) -> dict[str, Any]:
        """Start the pair's store on a free port (rank 0); returns the msgpack-able address."""
        self._check_new(peer_id)
        td = timedelta(seconds=self.timeout)
        tcp = dist.TCPStore(
            self.host_address, 0, is_master=True, wait_for_workers=False, timeout=td
        )  # port 0: the OS picks a free port
        name = uuid.uuid4().hex
        group = PeerGroup(
            peer_id,
            HOST_RANK,
            name,
            self.backend,
            self.device,
            self.timeout,
            self.host_address,
            tcp,
        )
        group.live_store().set(EPOCH_KEY, "0")  # in-process server: cannot hang
        self._add(group)
        return {"host": self.host_address, "port": tcp.port, "group": name, "backend": self.backend}

    def join(self, peer_id: str, address: Mapping[str, Any]) -> None:
        """Connect to a peer's store from its `host()` address (rank 1); PeerLost if unreachable."""
        host, port, name = _check_address(address, self.backend)
        self._check_new(peer_id)
        td = timedelta(seconds=self.timeout)
        caller = BoundedCaller(name)  # the pair's store calls run on it from now on
        try:
            tcp = caller.call(
                lambda: dist.TCPStore(
                    host, port, is_master=False, wait_for_workers=False, timeout=td
                ),
                self.timeout * 1.5 + 1.0,
            )
        except (StoreHung, RuntimeError) as e:
            caller.close()
            raise PeerLost(
                f"cannot reach the store of peer {peer_id!r} at {host}:{port} within "
                f"{self.timeout}s: {str(e) or 'no answer'}"
            ) from e
        group = PeerGroup(
            peer_id,
            JOIN_RANK,
            name,
            self.backend,
            self.device,
            self.timeout,
            route_to(host, port),
            tcp,
            caller,
        )
        self._add(group)

    def get(self, peer_id: str) -> PeerGroup:
        """The group of `peer_id`; UnknownPeer if it was never hosted/joined or was removed."""
        with self._lock:
            group = self._groups.get(peer_id)
        if group is None:
            raise UnknownPeer(f"no group for peer {peer_id!r}; call host() or join() first")
        return group

    def remove(self, peer_id: str) -> None:
        """Tear down the pair with `peer_id` (abort its group, release its store); idempotent."""
        with self._lock:
            group = self._groups.pop(peer_id, None)
        if group is not None:
            group.close()

    def close(self) -> None:
        """Remove every peer."""
        for peer_id in self.peers():
            self.remove(peer_id)

    def _check_new(self, peer_id: str) -> None:
        if not isinstance(peer_id, str) or not peer_id:
            raise ValueError(f"peer_id must be a non-empty str, got {peer_id!r}")
        if peer_id in self:
            raise ValueError(f"peer {peer_id!r} already has a group; remove() it first")

    def _add(self, group: PeerGroup) -> None:
        with self._lock:
            if group.peer_id in self._groups:
                group.close()
                raise ValueError(f"peer {group.peer_id!r} already has a group")
            self._groups[group.peer_id] = group


def _check_address(address: Mapping[str, Any], backend: str) -> tuple[str, int, str]:
    if not isinstance(address, Mapping):
        raise AddressError(f"peer address must be a dict from host(), got {type(address).__name__}")
    missing = sorted({"host", "port", "group", "backend"} - address.keys())
    if missing:
        raise AddressError(f"peer address is missing {missing}; pass host()'s dict unchanged")
    host, port, name = address["host"], address["port"], address["group"]
    if not isinstance(host, str) or not host:
        raise AddressError(f"peer address host must be a non-empty str, got {host!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise AddressError(f"peer address port must be an int in 1..65535, got {port!r}")
    if not isinstance(name, str) or not name:
        raise AddressError(f"peer address group must be a non-empty str, got {name!r}")
    if address["backend"] != backend:
        raise AddressError(
            f"peer uses backend {address['backend']!r} but this worker uses "
            f"{backend!r}; both sides' KV caches must be on the same device type"
        )
    return host, port, name
