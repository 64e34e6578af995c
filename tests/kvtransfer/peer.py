"""Test helpers: deterministic KV caches, descriptors, and a sender process driven over a Pipe.

The pytest process plays the decode side (receiver, rank 1); each `SenderProcess` is a real
spawned OS process playing the prefill side (host, rank 0) with a seeded random KV cache, so
the test can rebuild the sender's exact cache locally and compare block by block.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from contextlib import contextmanager
from typing import Any

import torch

from kvtransfer import GroupRegistry, KVTransfer, TransferDescriptor, TransferError

LAYERS, BLOCK_SHAPE = 4, (4, 2, 8)  # (block_size, num_kv_heads, head_dim)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_cache(
    num_blocks: int,
    seed: int,
    dtype: str = "float32",
    layers: int = LAYERS,
    device: str = "cpu",
    head_major: bool = False,
) -> list[torch.Tensor]:
    """Per layer [2, num_blocks, bs, kvh, d] of seeded random values (same on any device).

    `head_major`: the same values, stored like the engine's cache (engine.attention.kv_layout:
    [2, kvh, num_blocks, bs, d] storage under the logical view); else plain contiguous.
    """
    g = torch.Generator().manual_seed(seed)
    shape = (2, num_blocks, *BLOCK_SHAPE)
    out = [
        torch.randn(shape, generator=g).to(device=device, dtype=DTYPES[dtype])
        for _ in range(layers)
    ]
    if head_major:
        out = [t.permute(0, 3, 1, 2, 4).contiguous().permute(0, 2, 3, 1, 4) for t in out]
    return out


def make_descriptor(
    request_id: str,
    src: list[int],
    dst: list[int],
    *,
    missing: list[int] | None = None,
    num_prompt_tokens: int | None = None,
    layers: tuple[int, int] = (0, LAYERS),
    dtype: str = "float32",
    first_token: int = 7,
) -> TransferDescriptor:
    """A descriptor for a prompt whose blocks `missing` (default: all) move src -> dst."""
    block_size = BLOCK_SHAPE[0]
    if missing is None:
        missing = list(range(len(src)))
    if num_prompt_tokens is None:
        num_prompt_tokens = (max(missing) + 1) * block_size - 1  # last block partial
    num_full = num_prompt_tokens // block_size
    return TransferDescriptor(
        request_id=request_id,
        block_hashes=[(0x9E3779B97F4A7C15 * (i + 1)) % (1 << 64) for i in range(num_full)],
        missing=missing,
        src_block_ids=src,
        dst_block_ids=dst,
        layers=layers,
        dtype=dtype,
        block_shape=BLOCK_SHAPE,
        first_token=first_token,
        num_prompt_tokens=num_prompt_tokens,
        sampling={"seed": 1234, "temperature": 0.7, "top_p": 0.9, "max_tokens": 16},
    )


def _sender_main(conn: Any, cfg: dict[str, Any]) -> None:
    """Child process: host peers and send transfers on command until told to exit."""
    torch.set_num_threads(1)
    device = cfg["device"]
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    registry = GroupRegistry(device, timeout=cfg["timeout"])  # gloo on CPU, NCCL on CUDA
    caches = {
        dtype: make_cache(
            cfg["num_blocks"], cfg["seed"], dtype, device=device, head_major=cfg["head_major"]
        )
        for dtype in DTYPES
    }
    transfer = KVTransfer(
        registry,
        message_bytes=cfg["message_bytes"],
        pipeline=cfg["pipeline"],
        max_runs=cfg["max_runs"],
        min_run_bytes=cfg["min_run_bytes"],
    )
    conn.send(("ready", os.getpid()))
    while True:
        cmd, *args = conn.recv()
        if cmd == "exit":
            registry.close()
            conn.send(("bye",))
            return
        if cmd == "host":
            conn.send(("address", registry.host(args[0])))
        elif cmd == "send":
            peer_id, desc_dict, timeout = args
            desc = TransferDescriptor.from_dict(desc_dict)
            try:
                stats = transfer.send(peer_id, caches[desc.dtype], desc, timeout=timeout)
                conn.send(
                    (
                        "sent",
                        {
                            "payload_bytes": stats.payload_bytes,
                            "control_bytes": stats.control_bytes,
                            "wire_bytes": stats.wire_bytes,
                            "num_blocks": stats.num_blocks,
                            "num_messages": stats.num_messages,
                        },
                    )
                )
            except TransferError as e:
                conn.send(("error", type(e).__name__, str(e)))


class SenderProcess:
    """Handle on a spawned sender (prefill-side) process."""

    def __init__(
        self,
        *,
        seed: int = 1,
        num_blocks: int = 32,
        timeout: float = 5.0,
        message_bytes: int = 32 << 20,
        pipeline: bool = True,
        device: str = "cpu",
        head_major: bool = False,
        max_runs: int = 8,
        min_run_bytes: int = 0,
    ) -> None:
        # min_run_bytes 0: test caches are tiny (128 B regions per block), so any run qualifies.
        self.seed, self.num_blocks = seed, num_blocks
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        cfg = {
            "seed": seed,
            "num_blocks": num_blocks,
            "timeout": timeout,
            "message_bytes": message_bytes,
            "pipeline": pipeline,
            "device": device,
            "head_major": head_major,
            "max_runs": max_runs,
            "min_run_bytes": min_run_bytes,
        }
        self.proc = ctx.Process(target=_sender_main, args=(child, cfg), daemon=True)
        self.proc.start()
        self._ready = False

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until the child has imported torch and built its caches."""
        if not self._ready:
            self._expect("ready", timeout)
            self._ready = True

    def host(self, peer_id: str) -> dict[str, Any]:
        """Ask the child to host a pair with `peer_id`; returns the address."""
        self.wait_ready()
        self.conn.send(("host", peer_id))
        return self._expect("address", 10.0)[1]

    def start_send(self, peer_id: str, desc: TransferDescriptor, timeout: float = 5.0) -> None:
        """Ask the child to send `desc`; collect the outcome with `result()`."""
        self.conn.send(("send", peer_id, desc.to_dict(), timeout))

    def result(self, timeout: float = 20.0) -> tuple[Any, ...]:
        """("sent", stats dict) or ("error", exception class name, message)."""
        if not self.conn.poll(timeout):
            raise TimeoutError("sender process did not report in time")
        return self.conn.recv()

    def cache(self, dtype: str = "float32") -> list[torch.Tensor]:
        """An exact CPU copy of the child's KV cache for `dtype`."""
        return make_cache(self.num_blocks, self.seed, dtype)

    def freeze(self) -> None:
        """SIGSTOP the child and wait until it is actually stopped (delivery is asynchronous)."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5.0
        while _proc_state(self.proc.pid) not in ("T", "t"):
            if time.monotonic() > deadline:
                raise TimeoutError("sender process did not stop")
            time.sleep(0.001)

    def thaw(self) -> None:
        """SIGCONT the child."""
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the child and reap it."""
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self) -> None:
        """Ask the child to exit; kill it if it does not."""
        if self.proc.is_alive():
            try:
                self.conn.send(("exit",))
                if self.conn.poll(5):
                    self.conn.recv()
            except (OSError, EOFError):
                pass
            self.proc.join(5)
        self.kill()

    def _expect(self, tag: str, timeout: float) -> tuple[Any, ...]:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"sender process sent no {tag!r} in {timeout}s")
        msg = self.conn.recv()
        if msg[0] != tag:
            raise RuntimeError(f"sender process answered {msg!r}, expected {tag!r}")
        return msg


def _proc_state(pid: int) -> str:
    """One-letter scheduler state of `pid` from /proc (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@contextmanager
def joined_receiver(sender: SenderProcess, timeout: float = 5.0):
    """The decode side of a pair with `sender`: (registry, KVTransfer), closed afterwards."""
    from kvtransfer import GroupRegistry, KVTransfer

    registry = GroupRegistry("cpu", timeout=timeout)
    registry.join("prefill-0", sender.host("decode-0"))
    try:
        yield registry, KVTransfer(registry)
    finally:
        registry.close()


SENDER_BLOCKS, RECEIVER_BLOCKS = 24, 20


MESSAGE_BYTES = 4096  # small on purpose: 4 blocks x 2 layers fill one message


def assert_exact(kv, before, expected, desc):
    """dst blocks of the layer range equal the sender's src blocks; everything else unchanged."""
    start, end = desc.layers
    moved = dict(zip(desc.dst_block_ids, desc.src_block_ids, strict=True))
    for layer in range(LAYERS):
        for block in range(kv[layer].shape[1]):
            if start <= layer < end and block in moved:
                want = expected[layer][:, moved[block]]
            else:
                want = before[layer][:, block]
            assert torch.equal(kv[layer][:, block], want), (layer, block)
