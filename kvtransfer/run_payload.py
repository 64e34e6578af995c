"""The "runs" payload mode (zero-copy): each cache region travels as its own message.

When the blocks, in wire order, form at most `max_runs` runs (stretches where src and dst ids
both go up by one; a fresh engine allocates prompts this way), those regions average at least
`min_run_bytes` and the sender's cache is head-major, every (layer, k/v, kv head, run) region
of the cache storage is contiguous and is one message, sent straight from the cache:
layers * 2 * kv_heads * runs messages, in that nesting order, all posted at once (up to
RUN_WINDOW). A head-major receiver receives each straight into its cache; any other receiver
(or a draining one) receives into SCRATCH_WINDOW scratch chunks and copies (correct, slower).

The run cap and the region floor bound the message count and keep messages large: each
message has a fixed cost (gloo: ~45 us of CPU per side on the 2-CPU box, about what copying
350 KiB costs), so more scattered ids or small regions go packed (kvtransfer.packed_payload),
where one gather + scatter is cheaper than many small sends.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from kvtransfer.announcement import Announcement
from kvtransfer.descriptor import TransferDescriptor
from kvtransfer.packing import is_head_major, run_region, run_slices, runs, wire_order
from kvtransfer.pair import PeerGroup
from kvtransfer.wire import Channel, blocking, staging, wait

MAX_RUNS = 8  # default cap on runs for the zero-copy mode (0 disables it)
# Default floor on the average run-mode message: below it, the fixed cost per message exceeds
# what zero-copy saves (2-CPU box, SmolLM2 shapes, ratio to a plain send: 128 KiB regions
# packed 0.57 vs runs 0.49; 256 KiB runs 0.65 vs 0.56; 512 KiB runs 0.73 vs 0.57). SmolLM2
# regions are 4 KiB per block, so 256 KiB at 1k tokens.
MIN_RUN_BYTES = 256 << 10
# Run-mode messages in flight (1 without pipelining). A gloo send waits for its receive to be
# posted, so receives must be posted ahead; posting all of them at once beat a window of 64 by
# ~10-20% at 1k tokens. Sends and direct receives cost no memory, scratch receives one chunk
# each; the cap only bounds outstanding work objects.
RUN_WINDOW = 4096
# NCCL launches a kernel per posted send/recv; past ~1k pending launches posting blocks in the
# driver where no deadline applies, so NCCL pairs keep at most this many in flight.
NCCL_RUN_WINDOW = 64
SCRATCH_WINDOW = 8


def fits(
    kv_cache: Sequence[torch.Tensor], desc: TransferDescriptor, max_runs: int, min_run_bytes: int
) -> bool:
    """Whether desc's blocks go in this mode from kv_cache: they form 1..max_runs runs whose
    regions average at least min_run_bytes, and the cache is head-major."""
    if not (max_runs and desc.num_blocks and is_head_major(kv_cache, desc.layers)):
        return False
    num_runs = len(runs(*wire_order(desc)))
    block_size, _, head_dim = desc.block_shape
    region_bytes = desc.num_blocks * block_size * head_dim * desc.torch_dtype.itemsize
    return num_runs <= max_runs and region_bytes >= num_runs * min_run_bytes


def send(
    ch: Channel, kv_cache: Sequence[torch.Tensor], desc: TransferDescriptor
) -> tuple[int, int]:
    """Zero-copy: each (layer, k/v, head, run) region of the cache is one message."""
    group, timeout = ch.group, ch.timeout
    limit = window(group) if ch.pipeline else 1
    inflight: deque[Any] = deque()  # send works, message order
    payload = count = 0
    with blocking(group, f"sending request {desc.request_id}", timeout, store=False):
        for wire in run_slices(kv_cache, desc, runs(*wire_order(desc)), 0):
            if len(inflight) >= limit:
                wait(inflight.popleft(), timeout)
            inflight.append(ch.send(wire))
            payload += wire.numel()
            count += 1
        while inflight:
            wait(inflight.popleft(), timeout)
    return count, payload


def recv(
    ch: Channel, kv_cache: Sequence[torch.Tensor], frame: Announcement, *, drain: bool
) -> tuple[int, int]:
    """Receive a "runs" payload: straight into a head-major cache, else (or when draining)
    into SCRATCH_WINDOW scratch chunks of one staging slot, copying each into the cache."""
    group, timeout = ch.group, ch.timeout
    desc = frame.descriptor
    messages = list(run_messages(desc))
    block_size, _, head_dim = desc.block_shape
    block_bytes = block_size * head_dim * desc.torch_dtype.itemsize  # one head, K or V
    direct = not drain and is_head_major(kv_cache, desc.layers)
    limit = (window(group) if direct else SCRATCH_WINDOW) if ch.pipeline else 1
    chunk = max(n for _, _, _, (_, _, n) in messages) * block_bytes if messages else 0
    scratch = None if direct else staging(group).raw(0, limit * chunk)
    # Direct: the cache's own regions, taken in message order as receives are posted.
    regions = run_slices(kv_cache, desc, runs(*wire_order(desc)), 1) if direct else None
    posted: deque[tuple[torch.Tensor, Any]] = deque()  # (buffer, recv work), message order
    payload = 0

    def post(i: int) -> None:
        if regions is not None:
            buf = next(regions)  # post(i) runs for i = 0, 1, 2, ... in order
        else:
            if scratch is None:  # set whenever the receive is not direct
                raise RuntimeError("a staged receive without scratch memory")
            _, _, _, (_, _, n) = messages[i]
            offset = (i % limit) * chunk
            buf = scratch[offset : offset + n * block_bytes]
        posted.append((buf, ch.recv(buf)))

    with blocking(group, f"receiving request {desc.request_id}", timeout, store=False):
        for i in range(min(limit, len(messages))):
            post(i)
        for i, (layer, k, head, (_, d0, n)) in enumerate(messages):
            buf, work = posted.popleft()
            wait(work, timeout)
            if scratch is not None and not drain:
                run_region(kv_cache[layer], k, head, d0, n).copy_(
                    buf.view(desc.torch_dtype).view(n, block_size, head_dim)
                )
            payload += buf.numel()
            if i + limit < len(messages):
                post(i + limit)  # reuses buf's chunk: stream-ordered after the copy
    return len(messages), payload


def run_messages(
    desc: TransferDescriptor,
) -> Iterator[tuple[int, int, int, tuple[int, int, int]]]:
    """(layer, k/v, kv head, (src start, dst start, n)) of each "runs" message, in wire order."""
    spans = runs(*wire_order(desc))
    for layer in range(*desc.layers):
        for k in range(2):
            for head in range(desc.block_shape[1]):
                for span in spans:
                    yield layer, k, head, span


def window(group: PeerGroup) -> int:
    """How many run-mode messages may be in flight on this pair's backend."""
    return NCCL_RUN_WINDOW if group.backend == "nccl" else RUN_WINDOW
