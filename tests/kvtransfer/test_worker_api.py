"""The worker contract: its types round-trip msgpack, and its errors cross RPC as themselves."""

from __future__ import annotations

import pytest

from engine.errors import EngineError, NoFreeBlocksError, PromptTooLongError
from kvtransfer.control import RemoteError, RpcClient, RpcServer
from kvtransfer.errors import PeerLost, TransferError
from kvtransfer.lease import LeaseError
from kvtransfer.worker_api import (
    ERRORS,
    KVEvent,
    PrefillResult,
    PromptRequest,
    PullResult,
    Reservation,
    Role,
    TokenOutput,
    WorkerInfo,
    WorkerStats,
    pack,
    unpack,
)
from kvtransfer.worker_client import DecodeClient, as_worker

EXAMPLES = [
    PromptRequest("r1", (1, 2, 3), {"max_tokens": 4, "seed": 7, "stop": ["x"]}, "salt"),
    PromptRequest("r2", (), {}),
    PromptRequest("r3", (1,), {}, None, "chat-7", 120.0),
    Reservation(num_hit_blocks=2, dst_block_ids=(9, 4), num_blocks=4),
    Reservation(num_hit_blocks=3, dst_block_ids=(5,), num_blocks=4, num_tier_blocks=2),
    PullResult(7, 5, 2, 4096, 0.25),
    PrefillResult("prefilled", 11, 7, 8),
    PrefillResult("error", None, 7, 0, "boom"),
    TokenOutput("r1", (5, 6), "hi", False, None, 8),
    TokenOutput("r1", (), "", True, "stop", 8, None, "</s>"),
    TokenOutput("r1", (2,), "", True, "stop", 0, None, 2),
    WorkerInfo("d0", Role.DECODE, 16, "s", 512, 2048, "/m", "gloo"),
    WorkerStats("p0", Role.PREFILL, 1, 0.25, 30, 40, 10, 4, num_held=2, bytes_sent=2**40),
    WorkerStats("d0", Role.DECODE, tier_medium="disk", tier_usage_bytes=2**33, tier_hits=3),
    KVEvent("stored", (2**64 - 1, 3), 17),
    KVEvent("removed", (5,)),
]


@pytest.mark.parametrize("obj", EXAMPLES, ids=lambda o: type(o).__name__)
def test_contract_types_round_trip_msgpack(obj):
    back = unpack(type(obj), pack(obj))
    assert back == obj and type(back) is type(obj)
    for name in type(obj).__dataclass_fields__:
        assert type(getattr(back, name)) is type(getattr(obj, name)), name


def test_stats_hit_rate_and_in_flight():
    stats = WorkerStats("d0", Role.DECODE, num_requests=2, cache_queries=8, cache_hits=6)
    assert stats.hit_rate == 0.75 and WorkerStats("d0", Role.DECODE).hit_rate == 0.0
    assert WorkerStats("p0", Role.PREFILL, num_requests=1, num_held=2).num_in_flight == 3
    assert stats.summary()["cache_hit_rate"] == 0.75 and stats.summary()["role"] == "decode"


def _subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub} | _subclasses(sub)
    return out


def test_every_engine_and_transfer_error_is_registered():
    for cls in {EngineError, TransferError} | _subclasses(EngineError) | _subclasses(TransferError):
        if cls.__module__.startswith(("engine.", "kvtransfer.")):
            assert ERRORS[cls.__name__] is cls


class _Worker:
    """Raises what it is told to; reserve answers with a Reservation."""

    def reserve(self, request: PromptRequest, prefill_id: str | None = None) -> Reservation:
        if request.request_id == "full":
            raise NoFreeBlocksError("not enough free KV blocks for 5 tokens (0 free)")
        if request.request_id == "long":
            raise PromptTooLongError("prompt has 9 tokens; max_model_len is 8")
        if request.request_id == "peer":
            raise PeerLost("prefill worker left")
        if request.request_id == "lease":
            raise LeaseError("no lease for 'x'")
        if request.request_id == "bug":
            raise ZeroDivisionError("division by zero")
        return Reservation(1, (3, 4), 3)


@pytest.fixture
def decode():
    server = RpcServer(_Worker())
    rpc = RpcClient(server.address, default_timeout=10.0)
    yield as_worker(server.address, Role.DECODE), DecodeClient(rpc)
    rpc.close()
    server.close()


def test_typed_client_over_rpc_returns_the_contract_types(decode):
    for worker in decode:
        assert worker.reserve(PromptRequest("ok", (1,), {})) == Reservation(1, (3, 4), 3)


@pytest.mark.parametrize(
    ("request_id", "error", "message"),
    [
        ("full", NoFreeBlocksError, "not enough free KV blocks for 5 tokens (0 free)"),
        ("long", PromptTooLongError, "prompt has 9 tokens; max_model_len is 8"),
        ("peer", PeerLost, "prefill worker left"),
        ("lease", LeaseError, "no lease for 'x'"),
    ],
)
def test_contract_errors_cross_rpc_as_themselves(decode, request_id, error, message):
    _, worker = decode
    with pytest.raises(error) as info:
        worker.reserve(PromptRequest(request_id, (1,), {}))
    assert type(info.value) is error and str(info.value) == message


def test_other_errors_cross_rpc_as_remote_error(decode):
    _, worker = decode
    with pytest.raises(RemoteError) as info:
        worker.reserve(PromptRequest("bug", (1,), {}))
    assert (info.value.kind, info.value.message) == ("ZeroDivisionError", "division by zero")
