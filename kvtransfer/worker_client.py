"""Typed clients of the worker contract (kvtransfer.worker_api) over a generic transport.

A transport runs a worker method by name and raises the contract's errors as themselves:
kvtransfer.control.RpcClient between processes, cluster.ray_peer.RayPeer for Ray actors.
PrefillClient and DecodeClient put the typed PrefillAPI / DecodeAPI methods in front of one,
so callers never name a method by string. An in-process worker needs no client.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from kvtransfer.control import RpcClient
from kvtransfer.output_feed import OutputFeed
from kvtransfer.worker_api import (
    DecodeAPI,
    KVEvent,
    PrefillAPI,
    PrefillResult,
    PromptRequest,
    PullResult,
    Reservation,
    Role,
    TokenOutput,
    WorkerInfo,
    WorkerStats,
)

PEER_RPC_TIMEOUT_S = 30.0  # a worker's calls to its peer (ack, abort, renew) are short
CALL_MARGIN_S = 30.0  # a prefill call's wait beyond the prefill's own timeout


@runtime_checkable
class Transport(Protocol):
    """Runs one remote worker method."""

    def call(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """The method's return value, waiting up to `timeout` seconds (None: the transport's
        default); contract errors (worker_api.ERRORS) raised as themselves."""


class _Client:
    """The methods both roles answer."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    def info(self) -> WorkerInfo:
        return self.transport.call("info")

    def stats(self) -> WorkerStats:
        return self.transport.call("stats")

    def kv_events(self) -> list[KVEvent]:
        return self.transport.call("kv_events")

    def abort(self, request_id: str, propagate: bool = True) -> bool:
        return self.transport.call("abort", request_id, propagate)

    def check_integrity(self) -> None:
        self.transport.call("check_integrity")

    def metrics(self) -> list[dict]:
        return self.transport.call("metrics")


class PrefillClient(_Client):
    """PrefillAPI over a transport."""

    def connect_decode(self, decode_id: str, peer: Any = None) -> dict:
        return self.transport.call("connect_decode", decode_id, peer)

    def disconnect_decode(self, decode_id: str) -> None:
        self.transport.call("disconnect_decode", decode_id)

    def prefill(
        self,
        request: PromptRequest,
        decode_id: str | None = None,
        reservation: Reservation | None = None,
        timeout: float = 600.0,
    ) -> PrefillResult:
        # A long prompt behind others may take minutes: the call waits as long as the prefill
        # may take (its own timeout) plus a margin, not the transport's default.
        return self.transport.call(
            "prefill", request, decode_id, reservation, timeout, timeout=timeout + CALL_MARGIN_S
        )

    def ack(self, request_id: str) -> bool:
        return self.transport.call("ack", request_id)

    def pull_blocks(
        self,
        decode_id: str,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        timeout: float = 30.0,
    ) -> PullResult:
        return self.transport.call(
            "pull_blocks",
            decode_id,
            list(token_ids),
            cache_salt,
            timeout,
            timeout=timeout + CALL_MARGIN_S,
        )


class DecodeClient(_Client):
    """DecodeAPI over a transport. poll() reads from this client's OutputFeed: one poll_many
    call at a time carries the outputs of every request streamed through this client."""

    def __init__(self, transport: Transport) -> None:
        super().__init__(transport)
        self.feed = OutputFeed(self.poll_many, self.wake_polls, name="output-feed")

    def connect_prefill(self, prefill_id: str, address: dict, peer: Any = None) -> None:
        self.transport.call("connect_prefill", prefill_id, address, peer)

    def disconnect_prefill(self, prefill_id: str) -> None:
        self.transport.call("disconnect_prefill", prefill_id)

    def reserve(self, request: PromptRequest, prefill_id: str | None = None) -> Reservation:
        self.feed.reset(request.request_id)  # a new stream: nothing of an earlier attempt's
        return self.transport.call("reserve", request, prefill_id)

    def local_generate(self, request: PromptRequest) -> None:
        self.feed.reset(request.request_id)
        self.transport.call("local_generate", request)

    def poll(self, request_id: str, timeout: float = 1.0) -> list[TokenOutput]:
        return self.feed.poll(request_id, timeout)

    def poll_many(
        self, request_ids: Sequence[str], timeout: float = 1.0
    ) -> tuple[list[TokenOutput], list[str]]:
        outs, unknown = self.transport.call("poll_many", list(request_ids), timeout)
        return list(outs), list(unknown)

    def wake_polls(self) -> None:
        self.transport.call("wake_polls")

    def renew(self, request_id: str) -> bool:
        return self.transport.call("renew", request_id)


def client(role: Role, transport: Transport) -> PrefillClient | DecodeClient:
    """The typed client of a worker in `role` behind `transport`."""
    return PrefillClient(transport) if role is Role.PREFILL else DecodeClient(transport)


def as_worker(peer: Any, role: Role) -> PrefillAPI | DecodeAPI:
    """A peer worker in `role` as its typed API: an RPC address dict or a bare transport gets
    a client; a worker object (in process, or already a client) is used as is."""
    if isinstance(peer, dict) and {"host", "port", "authkey"} <= peer.keys():
        peer = RpcClient(peer, default_timeout=PEER_RPC_TIMEOUT_S)
    if isinstance(peer, Transport):
        return client(role, peer)
    return peer
