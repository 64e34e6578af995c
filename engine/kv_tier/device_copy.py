"""Copies between the paged device cache and a tier's host-side block tensors.

A device cache layer is [2, num_blocks, block_size, num_kv_heads, head_dim] (a logical view,
engine/attention/kv_layout.py); `layer[:, block_id]` is one block of it, [2, BS, KVH, D].
A host block is [num_layers, 2, BS, KVH, D], contiguous (pinned when the cache is on CUDA).

On CUDA both directions are asynchronous and ordered by events:
  copy_out: enqueued on the current (compute) stream, so it reads the block before any later
            kernel overwrites it; the writer thread waits on the returned event.
  copy_in:  on the loader's own stream, after an event recorded on the compute stream when the
            load started (so it writes only after every earlier kernel, e.g. a copy_out of the
            block's previous content); the loader synchronizes its stream before reporting done.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class BlockDestination:
    """Where a load writes: these blocks of the engine's per-layer KV tensors."""

    kv_caches: Sequence[torch.Tensor]  # per layer [2, num_blocks, BS, KVH, D]
    block_ids: Sequence[int]  # destination of the i-th loaded block

    @property
    def device(self) -> torch.device:
        return self.kv_caches[0].device


def block_views(kv_caches: Sequence[torch.Tensor], block_id: int) -> list[torch.Tensor]:
    """Each layer's [2, BS, KVH, D] view of one block (no copy)."""
    return [layer[:, block_id] for layer in kv_caches]


def copy_out(layers: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """A host copy [num_layers, 2, BS, KVH, D] of one block's per-layer views, and the CUDA
    event after which it is complete (None on CPU: complete on return)."""
    src = layers[0]
    cuda = src.device.type == "cuda"
    out = torch.empty((len(layers), *src.shape), dtype=src.dtype, pin_memory=cuda)
    for i, layer in enumerate(layers):
        out[i].copy_(layer, non_blocking=cuda)
    if not cuda:
        return out, None
    event = torch.cuda.Event()
    event.record()
    return out, event


def start_event(device: torch.device) -> torch.cuda.Event | None:
    """An event on the current stream of `device` that copy_in waits for (None on CPU)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class BlockCopier:
    """Writes host blocks into device blocks; owns the loader's CUDA stream (created lazily,
    on the loader thread that uses it)."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def copy_in(
        self, block: torch.Tensor, dst: BlockDestination, i: int, after: torch.cuda.Event | None
    ) -> None:
        """Write host block `block` into dst.block_ids[i] of every layer."""
        if dst.device.type != "cuda":
            for layer, src in zip(dst.kv_caches, block, strict=True):
                layer[:, dst.block_ids[i]].copy_(src)
            return
        stream = self._stream(dst.device)
        if after is not None:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            for layer, src in zip(dst.kv_caches, block, strict=True):
                layer[:, dst.block_ids[i]].copy_(src, non_blocking=True)

    def finish(self, dst: BlockDestination) -> None:
        """Block until every copy_in into dst has landed."""
        if dst.device.type == "cuda":
            self._stream(dst.device).synchronize()

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]
