"""Gather KV blocks into contiguous message buffers and scatter them back.

KV cache layout (fixed by the engine): one tensor per layer, [2, num_blocks, bs, kvh, d]
(index 0 keys, 1 values). A message carries a run of consecutive layers for the moving blocks:
[num_layers_in_message, 2, n, bs, kvh, d], contiguous and layer-major, so packing is one
index_select per layer straight into the message buffer and unpacking one index_copy_.
Within a message, blocks are in `wire_order`.

Zero-copy alternative (the "runs" mode, kvtransfer.run_payload): when the moving blocks form a few
`runs` (stretches where src and dst ids both ascend by one) and a cache `is_head_major`, each
(layer, k/v, kv head, run) region, storage[kv, head, s0:s0 + n], is already contiguous
(n * bs * d values) and travels as its own message, straight from and into the cache
(`run_slices`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from kvtransfer.descriptor import TransferDescriptor, dtype_name
from kvtransfer.errors import DescriptorError

DEFAULT_MESSAGE_BYTES = 32 << 20


def is_head_major(kv_cache: Sequence[torch.Tensor], layers: tuple[int, int]) -> bool:
    """Whether every layer in [layers) is stored head-major and contiguous
    ([2, kvh, num_blocks, bs, d] storage, engine.attention.kv_layout)."""
    return all(kv_cache[layer].permute(0, 3, 1, 2, 4).is_contiguous() for layer in range(*layers))


def runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of the maximal stretches of aligned `src`/`dst` (given in
    wire order) where both ids go up by exactly one from each block to the next."""
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if out:
            s0, d0, n = out[-1]
            if s == s0 + n and d == d0 + n:
                out[-1] = (s0, d0, n + 1)
                continue
        out.append((s, d, 1))
    return out


def run_region(kv: torch.Tensor, k: int, head: int, start: int, n: int) -> torch.Tensor:
    """Blocks [start, start + n) of `head`'s keys (k=0) or values (k=1) of one layer:
    [n, bs, d]; contiguous when the layer is head-major."""
    return kv.permute(0, 3, 1, 2, 4)[k, head, start : start + n]


def run_slices(
    kv_cache: Sequence[torch.Tensor],
    desc: TransferDescriptor,
    spans: Sequence[tuple[int, int, int]],
    side: int,
) -> Iterator[torch.Tensor]:
    """The run regions of a head-major cache as flat uint8 slices, in wire order: layer, then
    k/v, then kv head, then span. `side` 0 takes each span's src start, 1 its dst start.

    Equal to run_region(...).view(-1).view(torch.uint8) region by region, but one slice each
    (about 4x less Python per message; a 1k-token transfer has 180 of them).
    """
    block_size, num_kv_heads, head_dim = desc.block_shape
    block_bytes = block_size * head_dim * desc.torch_dtype.itemsize  # one head, K or V
    for layer in range(*desc.layers):
        kv = kv_cache[layer]
        flat = kv.permute(0, 3, 1, 2, 4).view(-1).view(torch.uint8)  # [2, kvh, nb, bs, d] bytes
        for row in range(2 * num_kv_heads):  # row = k * kvh + head, storage order
            base = row * kv.shape[1]
            for span in spans:
                offset = (base + span[side]) * block_bytes
                yield flat[offset : offset + span[2] * block_bytes]


def check_cache(
    kv_cache: Sequence[torch.Tensor], desc: TransferDescriptor, block_ids: Sequence[int], side: str
) -> None:
    """Raise DescriptorError unless `desc` fits `kv_cache` on this `side` ("sender"/"receiver")."""
    start, end = desc.layers
    if end > len(kv_cache):
        raise DescriptorError(
            f"request {desc.request_id}: layers {desc.layers} exceed the "
            f"{side}'s {len(kv_cache)}-layer KV cache"
        )
    first = kv_cache[start]
    for layer in range(start, end):
        kv = kv_cache[layer]
        if kv.dim() != 5 or kv.shape[0] != 2 or tuple(kv.shape[2:]) != desc.block_shape:
            raise DescriptorError(
                f"request {desc.request_id}: {side} layer {layer} has shape "
                f"{tuple(kv.shape)}, expected [2, num_blocks, "
                f"{', '.join(map(str, desc.block_shape))}]"
            )
        if kv.dtype != desc.torch_dtype:
            raise DescriptorError(
                f"request {desc.request_id}: {side} KV cache is "
                f"{dtype_name(kv.dtype)} but the transfer is {desc.dtype}"
            )
        if kv.device != first.device or kv.shape[1] != first.shape[1]:
            raise DescriptorError(
                f"request {desc.request_id}: {side} layers differ in device "
                "or block count; kvtransfer needs one uniform cache"
            )
    num_blocks = first.shape[1]
    bad = [b for b in block_ids if b >= num_blocks]
    if bad:
        raise DescriptorError(
            f"request {desc.request_id}: {side} block ids {bad[:8]} are out "
            f"of range for a cache of {num_blocks} blocks"
        )


def wire_order(desc: TransferDescriptor) -> tuple[list[int], list[int]]:
    """(src ids, dst ids) in the order blocks travel: ascending dst id on both sides.

    The receiver's scatter then writes memory front to back (about 1.5x faster on CPU than
    the descriptor's order); the sender's gather reads in whatever order that implies.
    """
    pairs = sorted(zip(desc.dst_block_ids, desc.src_block_ids, strict=True))
    return [s for _, s in pairs], [d for d, _ in pairs]


def plan_messages(desc: TransferDescriptor, layers_per_message: int) -> list[tuple[int, int]]:
    """Layer ranges [a, b) of the messages, in send order, covering desc.layers."""
    if layers_per_message < 1:
        raise ValueError(f"layers_per_message must be >= 1, got {layers_per_message}")
    start, end = desc.layers
    return [(a, min(a + layers_per_message, end)) for a in range(start, end, layers_per_message)]


def layers_per_message(desc: TransferDescriptor, message_bytes: int) -> int:
    """How many layers fit one message of at most `message_bytes` (at least one layer)."""
    per_layer = max(1, desc.num_blocks * desc.layer_block_bytes)
    return max(1, min(desc.num_layers, message_bytes // per_layer))


class Staging:
    """Two reusable flat byte buffers on one device, for double-buffered pack/send.

    Grow-only: a buffer is reallocated only when a message needs more bytes than it has.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._slots: list[torch.Tensor | None] = [None, None]

    @property
    def nbytes(self) -> int:
        """Bytes currently held."""
        return sum(t.numel() for t in self._slots if t is not None)

    def view(self, slot: int, desc: TransferDescriptor, num_layers: int) -> torch.Tensor:
        """Slot `slot` viewed as [num_layers, 2, kvh, n, bs, d] of desc's dtype."""
        block_size, num_kv_heads, head_dim = desc.block_shape
        shape = (num_layers, 2, num_kv_heads, desc.num_blocks, block_size, head_dim)
        nbytes = num_layers * desc.num_blocks * desc.layer_block_bytes
        buf = self._slots[slot]
        if buf is None or buf.numel() < nbytes:
            self._slots[slot] = None  # free the old buffer before allocating the new one
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._slots[slot] = buf
        return buf[:nbytes].view(desc.torch_dtype).view(shape)

    def raw(self, slot: int, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of slot `slot`, flat uint8 (grown if needed)."""
        buf = self._slots[slot]
        if buf is None or buf.numel() < nbytes:
            self._slots[slot] = None
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._slots[slot] = buf
        return buf[:nbytes]


def pack(
    kv_cache: Sequence[torch.Tensor], layers: tuple[int, int], src: torch.Tensor, out: torch.Tensor
) -> None:
    """out[j] = the src blocks of layer layers[0] + j, head-major: [2, kvh, n, bs, d].

    The engine stores each layer head-major (engine.attention.kv_layout), so a block of one
    head is bs * d contiguous values and the gather copies whole runs; any layout works.
    """
    for j, layer in enumerate(range(*layers)):
        hm = kv_cache[layer].permute(0, 3, 1, 2, 4)  # [2, kvh, nb, bs, d]
        if hm.is_contiguous():  # as rows [2 * kvh, nb, bs * d]: ~15% faster gather on CPU
            rows, piece = hm.shape[0] * hm.shape[1], hm.shape[3] * hm.shape[4]
            torch.index_select(hm.view(rows, -1, piece), 1, src, out=out[j].view(rows, -1, piece))
        else:
            torch.index_select(hm, 2, src, out=out[j])


def unpack(
    buf: torch.Tensor, kv_cache: Sequence[torch.Tensor], layers: tuple[int, int], dst: torch.Tensor
) -> None:
    """Write buf[j] ([2, kvh, n, bs, d], head-major) into the dst blocks of layer
    layers[0] + j."""
    for j, layer in enumerate(range(*layers)):
        kv_cache[layer].permute(0, 3, 1, 2, 4).index_copy_(2, dst, buf[j])
