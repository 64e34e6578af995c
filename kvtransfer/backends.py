"""Backend groups by name: build a 2-rank gloo (CPU) or NCCL (CUDA) group from a store.

Only what differs between backends lives here; everything that uses a group is identical for
both. The group is constructed directly on a PrefixStore, never through init_process_group:
there is no world group, each pair of workers has its own.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def _make_gloo(
    store: dist.Store, rank: int, timeout: timedelta, device: torch.device, local_host: str
) -> Any:
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # not in torch's stubs
    # Bind to the interface that reaches the peer, not whatever the hostname resolves to.
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
    opts._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, 2, opts)  # blocks until both ranks connect


def _make_nccl(
    store: dist.Store, rank: int, timeout: timedelta, device: torch.device, local_host: str
) -> Any:
    from torch.distributed import ProcessGroupNCCL  # absent from CPU builds

    opts = ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = False
    # NCCL's own watchdog must never fire before our per-operation deadline does: with the
    # default TORCH_NCCL_ASYNC_ERROR_HANDLING it would take the whole worker down.
    opts._timeout = timeout * 4 + timedelta(seconds=30)
    pg = ProcessGroupNCCL(store, rank, 2, opts)
    pg.eager_connect_single_device(device)  # rendezvous now (blocks), as gloo does
    return pg


BACKENDS: dict[str, Callable[[dist.Store, int, timedelta, torch.device, str], Any]] = {
    "gloo": _make_gloo,
    "nccl": _make_nccl,
}
BACKEND_DEVICE = {"gloo": "cpu", "nccl": "cuda"}


def resolve_backend(name: str, device: torch.device | str) -> str:
    """Backend for a KV cache on `device`: "auto" picks nccl for cuda and gloo otherwise."""
    device = torch.device(device)
    if name == "auto":
        name = "nccl" if device.type == "cuda" else "gloo"
    if name not in BACKENDS:
        raise ValueError(
            f"unknown transfer backend {name!r}; choose 'auto' or one of {sorted(BACKENDS)}"
        )
    if BACKEND_DEVICE[name] != device.type:
        raise ValueError(
            f"backend {name!r} moves {BACKEND_DEVICE[name]} tensors but the KV cache "
            f"is on {device}; use backend='auto'"
        )
    if name == "nccl" and not dist.is_nccl_available():
        raise ValueError("backend 'nccl' requested but this torch build has no NCCL")
    return name


def route_to(host: str, port: int) -> str:
    """Local IP address the OS would use to reach host:port (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]
