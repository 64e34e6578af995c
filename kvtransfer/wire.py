"""What both payload modes of a transfer share: the channel to the peer, one blocking step
whose failure becomes a TransferError subclass, the wait for one posted send or receive, and
the pair's staging buffers.

Deadlines: `timeout` bounds each blocking step (a store call, the group rendezvous, each
message), so a dead or hung peer fails a transfer within about `timeout` of its last progress.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from kvtransfer.errors import PeerLost, TransferError, TransferTimeout
from kvtransfer.packing import Staging
from kvtransfer.pair import PeerGroup

TAG = 0  # NCCL ignores tags: the protocol relies on per-pair message order only


@dataclass(frozen=True, slots=True)
class Channel:
    """One transfer's way to its peer: the pair's backend group of the transfer's epoch (`pg`),
    the pair itself, the deadline of each blocking step, and whether messages overlap."""

    pg: Any
    group: PeerGroup
    timeout: float
    pipeline: bool

    def send(self, tensor: Any) -> Any:
        """Post a send of `tensor` to the peer; returns its work (wait() for it in order)."""
        return self.pg.send([tensor], 1 - self.group.rank, TAG)

    def recv(self, tensor: Any) -> Any:
        """Post a receive into `tensor` from the peer; returns its work."""
        return self.pg.recv([tensor], 1 - self.group.rank, TAG)


@contextmanager
def blocking(group: PeerGroup, what: str, timeout: float, *, store: bool) -> Iterator[None]:
    """Turn a backend/store failure of one blocking step into a TransferError subclass.

    `store`: the step talks to the pair store, which lives in the host's process, so an error
    there means the host is gone (PeerLost; a store call that hangs is cut off by the group as
    TransferTimeout). A broken data connection only means the peer reset the group or died.
    """
    start = time.perf_counter()
    try:
        yield
    except TransferError:
        raise
    except RuntimeError as e:  # torch.distributed errors (DistError is a RuntimeError)
        elapsed = time.perf_counter() - start
        peer = group.peer_id
        if group.closed:
            raise PeerLost(f"{what}: peer {peer!r} was removed during the transfer") from e
        if store:
            raise PeerLost(
                f"{what}: the store of peer {peer!r} is unreachable, its process is "
                f"gone; remove() it [{e}]"
            ) from e
        if elapsed >= 0.9 * timeout:
            raise TransferTimeout(
                f"{what}: no progress from peer {peer!r} for {elapsed:.1f}s "
                f"(deadline {timeout}s); the group was torn down and the next "
                f"transfer rebuilds it [{e}]"
            ) from e
        raise TransferError(
            f"{what}: the connection to peer {peer!r} broke after "
            f"{elapsed:.2f}s (it reset the group or died); the group was torn "
            "down and the next transfer rebuilds it, or raises PeerLost if the "
            f"peer is gone [{e}]"
        ) from e


def wait(work: Any, timeout: float) -> None:
    """Block until one posted send or receive completes; raises (a RuntimeError) once
    `timeout` seconds pass without it."""
    # work.wait(timeout) blocks the CPU thread and raises once the deadline passes, for gloo and
    # NCCL alike; on CUDA it also orders the current stream after the operation. Wait for works
    # in the order they were posted: with gloo (torch 2.13, TCP), waiting for a later send or
    # receive before an earlier one hangs until the deadline.
    if not work.wait(timedelta(seconds=timeout)):
        raise RuntimeError("backend operation did not complete")


def staging(group: PeerGroup) -> Staging:
    """The pair's staging buffers, made on first use (dropped with the group)."""
    if group.staging is None:
        group.staging = Staging(group.device)
    return group.staging
