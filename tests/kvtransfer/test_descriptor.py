"""TransferDescriptor: msgpack round trip and validation with clear errors."""

from __future__ import annotations

import msgpack
import pytest
import torch

from kvtransfer import DescriptorError, TransferDescriptor, dtype_name
from kvtransfer.announcement import Announcement


def make(**overrides) -> TransferDescriptor:
    fields = dict(
        request_id="req-1",
        block_hashes=[1, (1 << 64) - 1, 12345],
        missing=[1, 3],
        src_block_ids=[10, 4],
        dst_block_ids=[0, 7],
        layers=(2, 30),
        dtype="bfloat16",
        block_shape=(16, 3, 64),
        first_token=42,
        num_prompt_tokens=50,
        sampling={"seed": 7, "temperature": 0.5, "stop": ["\n"], "logit_bias": {"3": -1.0}},
    )
    fields.update(overrides)
    return TransferDescriptor(**fields)


def test_round_trip_bytes_and_dict():
    desc = make()
    data = desc.encode()
    assert isinstance(data, bytes)
    back = TransferDescriptor.decode(data)
    assert back == desc
    assert back.block_hashes == (1, (1 << 64) - 1, 12345)
    assert back.layers == (2, 30) and back.block_shape == (16, 3, 64)
    assert back.sampling == {
        "seed": 7,
        "temperature": 0.5,
        "stop": ["\n"],
        "logit_bias": {"3": -1.0},
    }
    assert TransferDescriptor.from_dict(desc.to_dict()) == desc


def test_derived_sizes():
    desc = make()
    assert desc.num_blocks == 2 and desc.num_layers == 28
    assert desc.torch_dtype == torch.bfloat16
    assert desc.layer_block_bytes == 2 * 16 * 3 * 64 * 2
    assert desc.payload_bytes == 2 * 28 * 2 * 16 * 3 * 64 * 2


def test_empty_transfer_is_valid():
    # Every block already cached on the receiver: only the descriptor travels.
    desc = make(missing=[], src_block_ids=[], dst_block_ids=[])
    assert desc.payload_bytes == 0
    assert TransferDescriptor.decode(desc.encode()) == desc


def test_partial_last_block_may_move():
    # 50 tokens / 16 = 3 full blocks (hashed) + 1 partial block (index 3), which also moves.
    assert make(missing=[3], src_block_ids=[1], dst_block_ids=[2]).missing == (3,)
    with pytest.raises(DescriptorError, match=r"missing\[0\] = 4 is out of range \[0, 3\]"):
        make(missing=[4], src_block_ids=[1], dst_block_ids=[2])


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"src_block_ids": [10]}, "src_block_ids has 1 entries but missing has 2"),
        ({"dst_block_ids": [0, 7, 9]}, "dst_block_ids has 3 entries but missing has 2"),
        ({"dst_block_ids": [5, 5]}, "dst_block_ids contains duplicate"),
        ({"block_hashes": [1, 2]}, "block_hashes has 2 entries but a 50-token prompt has 3 full"),
        ({"block_hashes": [1, 2, 1 << 64]}, r"block_hashes\[2\] = .* out of range"),
        ({"block_hashes": [1, 2, -1]}, r"block_hashes\[2\] = -1 is out of range"),
        ({"missing": [3, 1]}, "strictly increasing"),
        ({"dtype": "float64"}, "dtype 'float64' is not supported"),
        ({"dtype": "int8"}, "dtype 'int8' is not supported"),
        ({"layers": (5, 5)}, "start < end"),
        ({"layers": (0, 1, 2)}, "start < end"),
        ({"block_shape": (16, 3)}, "block_shape must be"),
        ({"block_shape": (16, 0, 64)}, r"block_shape\[1\] = 0 is out of range"),
        ({"request_id": ""}, "request_id must be a non-empty str"),
        ({"first_token": -1}, "first_token = -1"),
        ({"first_token": True}, "first_token must be an int"),
        ({"num_prompt_tokens": 0}, "num_prompt_tokens = 0"),
        ({"src_block_ids": [1.0, 2]}, r"src_block_ids\[0\] must be an int"),
        ({"missing": "12"}, "missing must be a list of ints"),
        ({"sampling": [1, 2]}, "sampling must be a dict"),
        ({"sampling": {"seed": object()}}, "sampling.seed holds a object"),
        ({"sampling": {1: 2}}, "non-str key"),
    ],
)
def test_invalid_fields_are_rejected(overrides, message):
    with pytest.raises(DescriptorError, match=message):
        make(**overrides)


def test_decode_rejects_malformed_bytes():
    with pytest.raises(DescriptorError, match="not valid msgpack"):
        TransferDescriptor.decode(b"\xc1")
    with pytest.raises(DescriptorError, match="not valid msgpack"):
        TransferDescriptor.decode(make().encode()[:-3])  # truncated
    with pytest.raises(DescriptorError, match="must be a map"):
        TransferDescriptor.decode(msgpack.packb([1, 2, 3]))
    with pytest.raises(DescriptorError, match="bytes expected"):
        TransferDescriptor.decode("not bytes")


def test_decode_rejects_wrong_version_missing_and_unknown_fields():
    good = make().to_dict()
    with pytest.raises(DescriptorError, match="version 2 is not supported"):
        TransferDescriptor.decode(msgpack.packb({**good, "v": 2}))
    partial = {k: v for k, v in good.items() if k != "dst_block_ids"}
    with pytest.raises(DescriptorError, match=r"missing field\(s\) \['dst_block_ids'\]"):
        TransferDescriptor.decode(msgpack.packb(partial))
    with pytest.raises(DescriptorError, match=r"unknown field\(s\) \['extra'\]"):
        TransferDescriptor.decode(msgpack.packb({**good, "extra": 1}))
    with pytest.raises(DescriptorError, match="dtype 'float8' is not supported"):
        TransferDescriptor.decode(msgpack.packb({**good, "dtype": "float8"}))
    with pytest.raises(DescriptorError, match="src_block_ids has 3 entries"):
        TransferDescriptor.decode(msgpack.packb({**good, "src_block_ids": [1, 2, 3]}))


def test_descriptor_is_immutable():
    desc = make()
    with pytest.raises(AttributeError):
        desc.request_id = "other"


def test_dtype_name():
    assert dtype_name(torch.float32) == "float32"
    assert dtype_name(torch.bfloat16) == "bfloat16"
    with pytest.raises(DescriptorError, match="unsupported KV dtype"):
        dtype_name(torch.int64)


def test_announcement_round_trip_and_errors():
    ann = Announcement(3, 2, make())
    raw = ann.encode()
    back = Announcement.decode(raw)
    assert back == ann and back.nbytes == len(raw)
    with pytest.raises(DescriptorError, match="announcement version 9"):
        Announcement.decode(msgpack.packb({"v": 9}))
    with pytest.raises(DescriptorError, match="bad epoch or layers_per_message"):
        Announcement.decode(msgpack.packb({"v": 2, "epoch": -1, "layers_per_message": 1}))
    with pytest.raises(DescriptorError, match="bytes expected"):
        Announcement.decode(
            msgpack.packb({"v": 2, "epoch": 0, "layers_per_message": 1, "mode": "packed"})
        )
    with pytest.raises(DescriptorError, match="not valid msgpack"):
        Announcement.decode(b"\xc1")
