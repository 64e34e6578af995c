"""Two real OS processes on CPU (gloo): a spawned sender and this process as the receiver."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvtransfer import GroupRegistry, KVTransfer
from tests.kvtransfer.peer import (
    LAYERS,
    MESSAGE_BYTES,
    RECEIVER_BLOCKS,
    SENDER_BLOCKS,
    SenderProcess,
    assert_exact,
    joined_receiver,
    make_cache,
    make_descriptor,
)


@pytest.fixture(scope="module")
def sender() -> Iterator[SenderProcess]:
    proc = SenderProcess(seed=11, num_blocks=SENDER_BLOCKS, message_bytes=MESSAGE_BYTES)
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def receiver(sender) -> Iterator[tuple[GroupRegistry, KVTransfer]]:
    with joined_receiver(sender) as pair:
        yield pair


def transfer(sender, receiver, desc, kv):
    registry, rx = receiver
    sender.start_send("decode-0", desc)
    got, stats = rx.recv("prefill-0", kv, wait=10.0)
    status, *info = sender.result()
    assert status == "sent", info
    return got, stats, info[0]


def test_noncontiguous_blocks_for_a_layer_range(sender, receiver):
    kv = make_cache(RECEIVER_BLOCKS, seed=99)
    before = [t.clone() for t in kv]
    desc = make_descriptor("req-a", src=[21, 3, 14, 8, 0], dst=[19, 2, 11, 5, 7], layers=(1, 4))
    got, stats, sent = transfer(sender, receiver, desc, kv)

    assert got == desc and got.first_token == 7 and got.sampling["seed"] == 1234
    assert_exact(kv, before, sender.cache(), desc)
    block_layer_bytes = 2 * 4 * 2 * 8 * 4  # K and V, bs=4, kvh=2, d=8, fp32
    assert sent["num_blocks"] == stats.num_blocks == 5
    assert sent["payload_bytes"] == stats.payload_bytes == 5 * 3 * block_layer_bytes
    assert sent["wire_bytes"] == sent["payload_bytes"] + sent["control_bytes"]
    assert sent["control_bytes"] == stats.control_bytes > 0
    # 5 blocks x 512 B = 2560 B per layer: one layer per 4096-byte message.
    assert sent["num_messages"] == stats.num_messages == 3


def test_delta_only_the_missing_blocks_move(sender, receiver):
    # A 6-block prompt (23 tokens); the receiver already caches blocks 0-2 (its ids 0, 1, 2).
    kv = make_cache(RECEIVER_BLOCKS, seed=5)
    before = [t.clone() for t in kv]
    desc = make_descriptor(
        "req-delta", src=[9, 4, 17], dst=[12, 13, 6], missing=[3, 4, 5], num_prompt_tokens=23
    )
    assert len(desc.block_hashes) == 5  # full blocks only; block 5 is partial
    got, stats, sent = transfer(sender, receiver, desc, kv)

    assert got.missing == (3, 4, 5)
    assert_exact(kv, before, sender.cache(), desc)
    assert sent["num_blocks"] == 3
    assert sent["payload_bytes"] == stats.payload_bytes == 3 * LAYERS * desc.layer_block_bytes
    for layer in range(LAYERS):  # the cached prefix is untouched
        assert torch.equal(kv[layer][:, [0, 1, 2]], before[layer][:, [0, 1, 2]])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_caches(sender, receiver, dtype):
    kv = make_cache(RECEIVER_BLOCKS, seed=6, dtype=dtype)
    before = [t.clone() for t in kv]
    desc = make_descriptor(f"req-{dtype}", src=[1, 23, 12], dst=[0, 18, 9], dtype=dtype)
    _, stats, sent = transfer(sender, receiver, desc, kv)
    assert_exact(kv, before, sender.cache(dtype), desc)
    assert sent["payload_bytes"] == 3 * LAYERS * 2 * 4 * 2 * 8 * 2


def test_many_transfers_reuse_one_group(sender, receiver):
    registry, _ = receiver
    kv = make_cache(RECEIVER_BLOCKS, seed=7)
    transfer(sender, receiver, make_descriptor("warm", src=[0], dst=[0]), kv)
    group = registry.get("prefill-0")
    pg, epoch = group.pg, group.pg_epoch
    expected = sender.cache()
    for i in range(5):
        before = [t.clone() for t in kv]
        desc = make_descriptor(f"req-{i}", src=[i, 10 + i], dst=[2 * i, 2 * i + 1])
        transfer(sender, receiver, desc, kv)
        assert_exact(kv, before, expected, desc)
    assert group.pg is pg and group.pg_epoch == epoch


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_nccl_between_two_gpus():
    # Same code path as above; only the backend (auto -> nccl) and the devices differ.
    proc = SenderProcess(
        seed=12, num_blocks=SENDER_BLOCKS, message_bytes=MESSAGE_BYTES, device="cuda:0"
    )
    registry = GroupRegistry("cuda:1", timeout=30.0)
    try:
        assert registry.backend == "nccl"
        registry.join("prefill-0", proc.host("decode-0"))
        desc = make_descriptor(
            "req-gpu", src=[21, 3, 14, 8, 0], dst=[19, 2, 11, 5, 7], layers=(1, 4), dtype="bfloat16"
        )
        kv = make_cache(RECEIVER_BLOCKS, seed=99, dtype="bfloat16", device="cuda:1")
        before = [t.cpu() for t in kv]
        got, stats, sent = transfer(proc, (registry, KVTransfer(registry)), desc, kv)
        assert got == desc and sent["payload_bytes"] == stats.payload_bytes
        assert_exact([t.cpu() for t in kv], before, proc.cache("bfloat16"), desc)
    finally:
        registry.close()
        proc.close()
