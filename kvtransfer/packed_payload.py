"""The "packed" payload mode: the moving blocks gathered into messages of consecutive layers.

A transfer is len(plan_messages(...)) messages, in layer order. Double-buffered (when the
channel pipelines): the sender packs message m + 1 into the other staging slot while m is on
the wire; the receiver has two receives posted and unpacks one while the next arrives. Each
side returns (number of messages, payload bytes).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from kvtransfer.announcement import Announcement
from kvtransfer.descriptor import TransferDescriptor
from kvtransfer.packing import pack, plan_messages, unpack, wire_order
from kvtransfer.wire import Channel, blocking, staging, wait


def message_plan(desc: TransferDescriptor, lpm: int) -> list[tuple[int, int]]:
    """Message layer ranges; none when no block moves (the announcement alone suffices)."""
    return plan_messages(desc, lpm) if desc.num_blocks else []


def send(
    ch: Channel, kv_cache: Sequence[torch.Tensor], desc: TransferDescriptor, lpm: int
) -> tuple[int, int]:
    """Pack desc's src blocks, `lpm` layers per message, and send the messages in order."""
    group, timeout = ch.group, ch.timeout
    buffers = staging(group)
    src = torch.tensor(wire_order(desc)[0], dtype=torch.long, device=group.device)
    plan = message_plan(desc, lpm)
    slots = 2 if ch.pipeline else 1
    inflight: list[Any] = [None] * slots  # send work per staging slot
    payload = 0
    with blocking(group, f"sending request {desc.request_id}", timeout, store=False):
        for m, layers in enumerate(plan):
            slot = m % slots
            if inflight[slot] is not None:
                wait(inflight[slot], timeout)  # the slot's previous message has left
            buf = buffers.view(slot, desc, layers[1] - layers[0])
            pack(kv_cache, layers, src, buf)
            wire = buf.view(-1).view(torch.uint8)
            inflight[slot] = ch.send(wire)
            payload += wire.numel()
        for work in inflight:
            if work is not None:
                wait(work, timeout)
    return len(plan), payload


def recv(
    ch: Channel, kv_cache: Sequence[torch.Tensor], frame: Announcement, *, drain: bool
) -> tuple[int, int]:
    """Receive the frame's messages and unpack each into its dst blocks (`drain`: receive and
    drop them, the cache untouched)."""
    group, timeout = ch.group, ch.timeout
    desc = frame.descriptor
    buffers = staging(group)
    dst = torch.tensor(wire_order(desc)[1], dtype=torch.long, device=group.device)
    plan = message_plan(desc, frame.layers_per_message)
    slots = 2 if ch.pipeline else 1
    posted: deque[tuple[torch.Tensor, Any]] = deque()  # (buffer, recv work), message order
    payload = 0

    def post(m: int) -> None:
        a, b = plan[m]
        buf = buffers.view(m % slots, desc, b - a)
        posted.append((buf, ch.recv(buf.view(-1).view(torch.uint8))))

    with blocking(group, f"receiving request {desc.request_id}", timeout, store=False):
        for m in range(min(slots, len(plan))):
            post(m)
        for m, layers in enumerate(plan):
            buf, work = posted.popleft()
            wait(work, timeout)
            if not drain:
                unpack(buf, kv_cache, layers, dst)
            payload += buf.numel() * buf.element_size()
            if m + slots < len(plan):
                post(m + slots)  # reuses buf's slot: on CUDA the recv is stream-ordered
                # after the unpack above, on CPU the unpack is already done
    return len(plan), payload
