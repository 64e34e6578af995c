"""Zero-copy "runs" mode: two real OS processes on CPU (gloo), head-major sender cache.

When the moving blocks form at most `max_runs` runs (src and dst ids both consecutive, in wire
order) and the sender's cache is head-major, every (layer, k/v, kv head, run) region of the
cache travels as its own message, with no staging buffer on either head-major side.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgpack
import pytest
import torch

from kvtransfer import GroupRegistry, KVTransfer, TransferRejected
from kvtransfer.announcement import ANNOUNCEMENT_VERSION, MODE_PACKED, MODE_RUNS, Announcement
from kvtransfer.errors import DescriptorError
from kvtransfer.packing import is_head_major, runs, wire_order
from tests.kvtransfer.peer import (
    BLOCK_SHAPE,
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

BLOCK_SIZE, KV_HEADS, HEAD_DIM = BLOCK_SHAPE
LAYER_BLOCK_BYTES = 2 * BLOCK_SIZE * KV_HEADS * HEAD_DIM * 4  # fp32
REGION_BYTES = BLOCK_SIZE * HEAD_DIM * 4  # one block of one head's K or V, fp32


@pytest.fixture(scope="module")
def sender() -> Iterator[SenderProcess]:
    proc = SenderProcess(
        seed=21, num_blocks=SENDER_BLOCKS, message_bytes=MESSAGE_BYTES, head_major=True
    )
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def receiver(sender) -> Iterator[tuple[GroupRegistry, KVTransfer]]:
    with joined_receiver(sender) as pair:
        yield pair


def transfer(sender, receiver, desc, kv, accept=None):
    registry, rx = receiver
    sender.start_send("decode-0", desc)
    got, stats = rx.recv("prefill-0", kv, wait=10.0, accept=accept)
    status, *info = sender.result()
    assert status == "sent", info
    return got, stats, info[0]


def staging_bytes(registry: GroupRegistry) -> int:
    staging = registry.get("prefill-0").staging
    return 0 if staging is None else staging.nbytes


def run_messages(desc, num_runs: int) -> int:
    return desc.num_layers * 2 * KV_HEADS * num_runs


# ---- pure helpers ------------------------------------------------------------------------------
def test_runs_follow_wire_order():
    assert runs([], []) == []
    assert runs([3, 4, 5], [10, 11, 12]) == [(3, 10, 3)]
    assert runs([3, 4, 9], [10, 11, 12]) == [(3, 10, 2), (9, 12, 1)]
    assert runs([3, 4, 5], [10, 11, 13]) == [(3, 10, 2), (5, 13, 1)]
    desc = make_descriptor("r", src=[5, 4, 3], dst=[9, 8, 7])  # descending: one run on the wire
    assert runs(*wire_order(desc)) == [(3, 7, 3)]


def test_head_major_detection():
    assert is_head_major(make_cache(4, 0, head_major=True), (0, LAYERS))
    assert not is_head_major(make_cache(4, 0), (0, LAYERS))


def test_frame_carries_the_mode():
    desc = make_descriptor("f", src=[1], dst=[2])
    for mode in (MODE_PACKED, MODE_RUNS):
        raw = Announcement(3, 2, desc, mode).encode()
        ann = Announcement.decode(raw)
        assert (ann.epoch, ann.layers_per_message, ann.descriptor, ann.nbytes, ann.mode) == (
            3,
            2,
            desc,
            len(raw),
            mode,
        )
    obj = msgpack.unpackb(Announcement(0, 1, desc, MODE_RUNS).encode())
    assert obj["v"] == ANNOUNCEMENT_VERSION
    with pytest.raises(DescriptorError, match="unknown payload mode"):
        Announcement.decode(msgpack.packb({**obj, "mode": "bogus"}))
    with pytest.raises(DescriptorError, match="version"):  # an old-build frame is refused
        Announcement.decode(msgpack.packb({**obj, "v": 1}))


# ---- two processes -----------------------------------------------------------------------------
def test_one_run_head_major_both_sides_is_zero_copy(sender, receiver):
    registry, _ = receiver
    kv = make_cache(RECEIVER_BLOCKS, seed=31, head_major=True)
    before = [t.clone() for t in kv]
    desc = make_descriptor("run-1", src=list(range(3, 9)), dst=list(range(10, 16)))
    staged = staging_bytes(registry)
    got, stats, sent = transfer(sender, receiver, desc, kv)

    assert got == desc
    assert_exact(kv, before, sender.cache(), desc)
    assert all(t.permute(0, 3, 1, 2, 4).is_contiguous() for t in kv)  # still the same storage
    assert sent["num_messages"] == stats.num_messages == run_messages(desc, 1)
    assert sent["payload_bytes"] == stats.payload_bytes == 6 * LAYERS * LAYER_BLOCK_BYTES
    assert stats.payload_bytes == desc.payload_bytes
    assert staging_bytes(registry) == staged  # the receiver allocated no staging buffer


def test_mixed_runs_in_a_layer_range(sender, receiver):
    kv = make_cache(RECEIVER_BLOCKS, seed=32, head_major=True)
    before = [t.clone() for t in kv]
    # Wire order (ascending dst): src 10,11 -> dst 0,1 | src 0,1,2 -> dst 5,6,7 | 20 -> 12.
    desc = make_descriptor(
        "run-3", src=[0, 1, 2, 10, 11, 20], dst=[5, 6, 7, 0, 1, 12], layers=(1, 3)
    )
    assert len(runs(*wire_order(desc))) == 3
    _, stats, sent = transfer(sender, receiver, desc, kv)

    assert_exact(kv, before, sender.cache(), desc)
    assert sent["num_messages"] == stats.num_messages == run_messages(desc, 3) == 24
    assert sent["payload_bytes"] == stats.payload_bytes == 6 * 2 * LAYER_BLOCK_BYTES


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs(sender, receiver, dtype):
    kv = make_cache(RECEIVER_BLOCKS, seed=33, dtype=dtype, head_major=True)
    before = [t.clone() for t in kv]
    desc = make_descriptor(f"run-{dtype}", src=[7, 6, 5, 4], dst=[3, 2, 1, 0], dtype=dtype)
    _, stats, sent = transfer(sender, receiver, desc, kv)
    assert_exact(kv, before, sender.cache(dtype), desc)
    assert sent["num_messages"] == stats.num_messages == run_messages(desc, 1)
    assert sent["payload_bytes"] == stats.payload_bytes == 4 * LAYERS * LAYER_BLOCK_BYTES // 2


def test_receiver_without_head_major_cache_copies_in(sender, receiver):
    kv = make_cache(RECEIVER_BLOCKS, seed=34)  # plain contiguous logical layout
    before = [t.clone() for t in kv]
    desc = make_descriptor("run-plain", src=[0, 1, 2, 3, 15, 16], dst=[12, 13, 14, 15, 2, 3])
    _, stats, sent = transfer(sender, receiver, desc, kv)
    assert_exact(kv, before, sender.cache(), desc)
    assert sent["num_messages"] == stats.num_messages == run_messages(desc, 2)
    assert sent["payload_bytes"] == stats.payload_bytes == 6 * LAYERS * LAYER_BLOCK_BYTES


@pytest.mark.parametrize("head_major", [True, False])
def test_rejected_run_transfer_is_drained_and_the_next_one_lands(sender, receiver, head_major):
    registry, _ = receiver
    kv = make_cache(RECEIVER_BLOCKS, seed=35, head_major=head_major)
    before = [t.clone() for t in kv]
    refused = make_descriptor("run-aborted", src=[2, 3, 4, 5], dst=[4, 5, 6, 7])
    sender.start_send("decode-0", refused)
    with pytest.raises(TransferRejected, match="run-aborted"):
        receiver[1].recv("prefill-0", kv, wait=10.0, accept=lambda d: False)
    status, *info = sender.result()
    assert status == "sent" and info[0]["num_messages"] == run_messages(refused, 1)
    for layer in range(LAYERS):
        assert torch.equal(kv[layer], before[layer])  # nothing written
    group = registry.get("prefill-0")
    pg, epoch = group.pg, group.pg_epoch

    desc = make_descriptor("run-after", src=[8, 9, 10], dst=[1, 2, 3])
    _, stats, _ = transfer(sender, receiver, desc, kv)
    assert_exact(kv, before, sender.cache(), desc)
    assert stats.payload_bytes == 3 * LAYERS * LAYER_BLOCK_BYTES
    assert group.pg is pg and group.pg_epoch == epoch  # the stream stayed in step


def test_out_of_range_dst_is_drained_in_run_mode(sender, receiver):
    kv = make_cache(8, seed=36, head_major=True)  # too small for dst block 10
    before = [t.clone() for t in kv]
    desc = make_descriptor("run-oob", src=[0, 1, 2], dst=[8, 9, 10])
    sender.start_send("decode-0", desc)
    with pytest.raises(TransferRejected, match="out of range"):
        receiver[1].recv("prefill-0", kv, wait=10.0)
    assert sender.result()[0] == "sent"
    for layer in range(LAYERS):
        assert torch.equal(kv[layer], before[layer])


def test_too_many_runs_fall_back_to_packed(sender, receiver):
    kv = make_cache(RECEIVER_BLOCKS, seed=37, head_major=True)
    before = [t.clone() for t in kv]
    ids = list(range(0, 18, 2))  # 9 single-block runs > MAX_RUNS
    desc = make_descriptor("run-scattered", src=ids, dst=ids)
    _, stats, sent = transfer(sender, receiver, desc, kv)
    assert_exact(kv, before, sender.cache(), desc)
    # Packed: 9 blocks x 512 B = 4608 B per layer > 4096 B, so one layer per message.
    assert sent["num_messages"] == stats.num_messages == LAYERS
    assert sent["payload_bytes"] == stats.payload_bytes == 9 * LAYERS * LAYER_BLOCK_BYTES


def test_sender_mode_choice():
    registry = GroupRegistry("cpu", timeout=5.0)
    try:
        tx = KVTransfer(registry, min_run_bytes=0)
        hm, plain = make_cache(24, 0, head_major=True), make_cache(24, 0)
        one_run = make_descriptor("m", src=[1, 2, 3], dst=[4, 5, 6])
        assert tx.payload_mode(hm, one_run) == MODE_RUNS
        assert tx.payload_mode(plain, one_run) == MODE_PACKED  # sender not head-major
        assert KVTransfer(registry, max_runs=0).payload_mode(hm, one_run) == MODE_PACKED
        eight = make_descriptor("m8", src=list(range(0, 16, 2)), dst=list(range(0, 16, 2)))
        assert tx.payload_mode(hm, eight) == MODE_RUNS
        nine = make_descriptor("m9", src=list(range(0, 18, 2)), dst=list(range(0, 18, 2)))
        assert tx.payload_mode(hm, nine) == MODE_PACKED
        with pytest.raises(ValueError):
            KVTransfer(registry, max_runs=-1)
        with pytest.raises(ValueError):
            KVTransfer(registry, min_run_bytes=-1)
    finally:
        registry.close()


def test_small_regions_go_packed():
    registry = GroupRegistry("cpu", timeout=5.0)
    try:
        hm = make_cache(24, 0, head_major=True)
        one_run = make_descriptor("m", src=[1, 2, 3], dst=[4, 5, 6])  # 3 x 128 B regions
        assert KVTransfer(registry).payload_mode(hm, one_run) == MODE_PACKED  # floor: 256 KiB
        assert (
            KVTransfer(registry, min_run_bytes=REGION_BYTES * 3).payload_mode(hm, one_run)
            == MODE_RUNS
        )
        assert (
            KVTransfer(registry, min_run_bytes=REGION_BYTES * 3 + 1).payload_mode(hm, one_run)
            == MODE_PACKED
        )
        # The floor is on the average region: runs of 4 and 2 blocks average 3 blocks.
        two_runs = make_descriptor("m2", src=[0, 1, 2, 3, 10, 11], dst=[0, 1, 2, 3, 8, 9])
        assert (
            KVTransfer(registry, min_run_bytes=REGION_BYTES * 3).payload_mode(hm, two_runs)
            == MODE_RUNS
        )
        assert (
            KVTransfer(registry, min_run_bytes=REGION_BYTES * 3 + 1).payload_mode(hm, two_runs)
            == MODE_PACKED
        )
    finally:
        registry.close()


# ---- the region floor, two processes: same sender cache, mode picked per transfer ------------
FLOOR_BLOCKS = 8  # min_run_bytes of the sender below, in blocks per region


@pytest.fixture(scope="module")
def floor_pair() -> Iterator[tuple[SenderProcess, tuple[GroupRegistry, KVTransfer]]]:
    proc = SenderProcess(
        seed=22,
        num_blocks=SENDER_BLOCKS,
        message_bytes=MESSAGE_BYTES,
        head_major=True,
        min_run_bytes=FLOOR_BLOCKS * REGION_BYTES,
    )
    try:
        with joined_receiver(proc) as pair:
            yield proc, pair
    finally:
        proc.close()


@pytest.mark.parametrize(
    "case, src, dst, layers, messages",
    [
        # 4 blocks: regions under the floor -> packed; 2048 B per layer, 2 layers per message
        ("small-consecutive", list(range(4)), list(range(6, 10)), (0, LAYERS), 2),
        # 12 blocks, one run -> zero-copy, one message per (layer, k/v, head)
        ("large-consecutive", list(range(2, 14)), list(range(5, 17)), (0, LAYERS), LAYERS * 4),
        # runs of 10 + 4 blocks average 7 < 8 -> packed; 14 x 512 B per layer: 1 layer per message
        ("mixed-small", [*range(10), 20, 21, 22, 23], [*range(6, 16), 0, 1, 2, 3], (1, 4), 3),
        # runs of 12 + 6 blocks average 9 -> zero-copy, 2 messages per (layer, k/v, head)
        (
            "mixed-large",
            [*range(12), *range(16, 22)],
            [*range(8, 20), *range(6)],
            (1, 3),
            2 * 4 * 2,
        ),
        # scattered ids -> packed whatever the size; 9 blocks: 1 layer per message
        (
            "scattered",
            [23, 1, 17, 4, 9, 12, 0, 20, 6],
            [3, 19, 0, 11, 7, 15, 5, 9, 13],
            (0, LAYERS),
            LAYERS,
        ),
    ],
)
def test_mode_by_region_size_lands_exactly(floor_pair, case, src, dst, layers, messages):
    sender, receiver = floor_pair
    kv = make_cache(RECEIVER_BLOCKS, seed=40, head_major=True)
    before = [t.clone() for t in kv]
    desc = make_descriptor(f"floor-{case}", src=src, dst=dst, layers=layers)
    _, stats, sent = transfer(sender, receiver, desc, kv)
    assert_exact(kv, before, sender.cache(), desc)
    assert sent["num_messages"] == stats.num_messages == messages
    assert sent["payload_bytes"] == stats.payload_bytes == desc.payload_bytes
