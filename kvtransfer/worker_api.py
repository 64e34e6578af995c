"""The worker contract: what a router (or a peer worker, or the controller) may ask a prefill or
a decode worker, with typed requests and replies and the errors that cross a transport.

It lives in kvtransfer because both sides already depend on it (the worker roles build on
kvtransfer.endpoint, the router hands requests over with kvtransfer) and it depends on neither
router nor a worker role: importing it adds no edge to the package graph.

The same types travel over every transport: in process (the worker object itself), over
kvtransfer.control RPC and as Ray actor calls (kvtransfer.worker_client wraps both). Every
type is a frozen dataclass of plain values, so `to_wire` / `from_wire` round-trip it through
msgpack. A worker error whose type is in ERRORS arrives at the caller as that type.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from collections.abc import Sequence
from typing import Any, Protocol

import msgpack

from engine.block_pool import KVEvent
from engine.errors import (
    CapacityError,
    EngineError,
    GrammarRejected,
    InvalidRequestError,
    ModelNotFoundError,
    NoFreeBlocksError,
    PromptTooLongError,
)
from engine.retention import Retention
from kvtransfer.errors import (
    AddressError,
    DescriptorError,
    PeerLost,
    TransferError,
    TransferRejected,
    TransferTimeout,
    UnknownPeer,
)
from kvtransfer.lease import LeaseError

__all__ = [
    "ERRORS",
    "DecodeAPI",
    "KVEvent",
    "PrefillAPI",
    "PrefillResult",
    "PromptRequest",
    "PullResult",
    "Reservation",
    "Role",
    "TokenOutput",
    "WorkerAPI",
    "WorkerInfo",
    "WorkerStats",
    "from_wire",
    "remote_error",
    "to_wire",
]


class Role(enum.StrEnum):
    """A worker's role; its value is the plain string used in manifests and stats."""

    PREFILL = "prefill"
    DECODE = "decode"


# ---- requests and replies --------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class PromptRequest:
    """One request as the workers see it. For a disaggregated request the router fixes
    params["seed"], so that prefill and decode draw the same random stream.

    session_id / retention_seconds: the request belongs to a conversation that comes back;
    once it finished, the blocks of its prompt and output are evicted last on every worker
    that held them, for retention_seconds (engine/retention.py; bounded by the engine option
    max_retention_seconds, else InvalidRequestError naming both)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: dict[str, Any]  # SamplingParams keyword arguments (msgpack-able values)
    cache_salt: str | None = None
    session_id: str | None = None
    retention_seconds: float | None = None

    @property
    def seed(self) -> int | None:
        return self.params.get("seed")

    def retention(self) -> Retention | None:
        """The engine's retention of this request (InvalidRequestError on bad fields)."""
        return Retention.of(self.session_id, self.retention_seconds)


@dataclasses.dataclass(frozen=True, slots=True)
class Reservation:
    """Blocks a decode worker reserved for a prompt: it holds the first num_hit_blocks
    already (its KV cache's, then its KV tier's: loading while the prefill runs); the
    prefill worker fills dst_block_ids with the rest, in prompt order."""

    num_hit_blocks: int
    dst_block_ids: tuple[int, ...]
    num_blocks: int  # the whole prompt's
    num_tier_blocks: int = 0  # of num_hit_blocks, those loading from the KV tier


@dataclasses.dataclass(frozen=True, slots=True)
class PrefillResult:
    """A prefill's outcome; first_token is set only when finish_reason is "prefilled"."""

    finish_reason: str | None
    first_token: int | None
    seed: int
    num_cached_tokens: int  # prompt tokens the prefill worker's prefix cache served
    error: str | None = None

    @property
    def prefilled(self) -> bool:
        return self.finish_reason == "prefilled"


@dataclasses.dataclass(frozen=True, slots=True)
class PullResult:
    """What a pull left in a prefill worker's KV cache: of the token run's num_blocks full
    blocks it held num_present already (leading ones), and num_pulled more (those after
    them) arrived from the decode worker and are cached now; a prefill computes the rest."""

    num_blocks: int
    num_present: int
    num_pulled: int
    payload_bytes: int = 0
    seconds: float = 0.0  # the exchange with the decode worker (ask -> blocks in place)

    @property
    def num_cached(self) -> int:
        """Leading blocks of the run in the prefill worker's KV cache now."""
        return self.num_present + self.num_pulled


@dataclasses.dataclass(frozen=True, slots=True)
class TokenOutput:
    """New tokens of one choice of a request since its last poll.

    finish_reason is set on the output that ends choice `index`; finished=True only on the
    request's last output (every choice done; with n == 1 the two coincide).
    logprobs: one entry per new token, [token_id, logprob, [[id, logprob], ...top-n]] (raw
    model log-softmax), or None when not asked for. prompt_logprobs: on the first output of
    choice 0 only, one entry per prompt token (None for the first, else as logprobs).
    """

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    error: str | None = None
    stop_reason: int | str | None = None
    index: int = 0
    logprobs: list | None = None
    prompt_logprobs: list | None = None

    def to_dict(self) -> dict:
        """The dict the router streams to its front doors (plain lists, ints, floats)."""
        return {
            "request_id": self.request_id,
            "token_ids": list(self.token_ids),
            "text": self.text,
            "finished": self.finished,
            "finish_reason": self.finish_reason,
            "num_cached_tokens": self.num_cached_tokens,
            "error": self.error,
            "stop_reason": self.stop_reason,
            "index": self.index,
            "logprobs": self.logprobs,
            "prompt_logprobs": self.prompt_logprobs,
        }


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What does not change while a worker runs: identity, cache geometry, model."""

    worker_id: str
    role: Role
    block_size: int
    hash_seed: str
    num_kv_blocks: int
    max_model_len: int
    model: str
    backend: str  # the KV transfer backend (gloo, nccl)


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerStats:
    """A worker's load and counters now; a counter of the other role stays 0."""

    worker_id: str
    role: Role
    num_requests: int = 0  # unfinished in the engine (queued or running)
    kv_usage: float = 0.0
    free_blocks: int = 0
    num_blocks: int = 0
    cache_queries: int = 0  # prefix-cache blocks looked up since start-up
    cache_hits: int = 0
    num_held: int = 0  # prefill: requests whose blocks wait for the decode side's ack
    bytes_sent: int = 0
    blocks_sent: int = 0
    num_waiting_for_kv: int = 0  # decode: reservations whose KV has not arrived
    bytes_received: int = 0
    blocks_received: int = 0
    blocks_pulled: int = 0  # prefill: blocks pulled from decode workers (PrefillAPI.pull_blocks)
    blocks_served: int = 0  # decode: blocks sent to prefill workers' pulls
    # The KV tier below the KV cache (engine/kv_tier); tier_medium "" without one.
    tier_medium: str = ""
    tier_capacity_bytes: int = 0
    tier_usage_bytes: int = 0
    tier_blocks: int = 0  # blocks the tier holds
    tier_queries: int = 0  # blocks looked up in the tier past the KV cache's hits
    tier_hits: int = 0
    tier_blocks_read: int = 0  # blocks loaded back into the KV cache
    tier_bytes_read: int = 0  # their bytes
    tier_load_seconds: float = 0.0  # summed over loads (start -> blocks in place)
    # What the router's cost model needs of the engine (router/kv_cost.py; 0: unknown).
    kv_block_bytes: int = 0  # one KV block's bytes across layers, keys and values
    prefill_token_seconds: float = 0.0  # the step-time profile's prefill seconds per token

    @property
    def hit_rate(self) -> float:
        """Prefix-cache hits / lookups (0.0 before the first lookup)."""
        return self.cache_hits / self.cache_queries if self.cache_queries else 0.0

    @property
    def tier_hit_rate(self) -> float:
        """KV tier hits / lookups (0.0 before the first lookup or without a tier)."""
        return self.tier_hits / self.tier_queries if self.tier_queries else 0.0

    @property
    def num_in_flight(self) -> int:
        """Requests that still need this worker: running, held for a transfer or waiting
        for KV. A draining worker may leave once it is 0."""
        return self.num_requests + self.num_held + self.num_waiting_for_kv

    def summary(self) -> dict:
        """Every field as a plain value, plus cache_hit_rate and tier_hit_rate (for status
        output)."""
        return {
            **to_wire(self),
            "cache_hit_rate": self.hit_rate,
            "tier_hit_rate": self.tier_hit_rate,
        }


# ---- the interfaces ------------------------------------------------------------------------
class WorkerAPI(Protocol):
    """What both roles answer."""

    def info(self) -> WorkerInfo:
        """Identity and cache geometry; constant while the worker runs."""

    def stats(self) -> WorkerStats:
        """Load and counters now."""

    def kv_events(self) -> list[KVEvent]:
        """Take the stored/removed block-hash events since the last call, oldest first."""

    def abort(self, request_id: str, propagate: bool = True) -> bool:
        """Free what this worker holds for the request; with propagate, tell its peer too."""

    def check_integrity(self) -> None:
        """Raise unless the block pool's accounting adds up (tests, debugging)."""

    def metrics(self) -> list[dict]:
        """This process's metric families as engine.metrics.snapshot() plain values."""


class PrefillAPI(WorkerAPI, Protocol):
    """The prefill role: prompt in, first token out, KV shipped to a decode worker."""

    def connect_decode(self, decode_id: str, peer: Any = None) -> dict:
        """Host the pair group with a decode worker; returns the address it must join."""

    def disconnect_decode(self, decode_id: str) -> None:
        """Tear down the pair group with a decode worker that left."""

    def prefill(
        self,
        request: PromptRequest,
        decode_id: str | None = None,
        reservation: Reservation | None = None,
        timeout: float = 600.0,
    ) -> PrefillResult:
        """Prefill and sample the first token; with decode_id, send the reserved blocks."""

    def ack(self, request_id: str) -> bool:
        """The decode side has the KV: release the held blocks (they stay cached)."""

    def pull_blocks(
        self,
        decode_id: str,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        timeout: float = 30.0,
    ) -> PullResult:
        """Obtain from paired decode worker decode_id the KV of the full blocks of token_ids
        (a prompt and its output: the next turn's prefix) that this worker's KV cache lacks,
        from its first miss on, and cache it: the next prefill of a prompt starting with
        these tokens computes only the rest. The decode worker sends the leading blocks it
        holds from there (re-checked against the tokens). Raises UnknownPeer (not paired),
        InvalidRequestError (bad token ids) or a TransferError (lost peer, timeout: nothing
        was cached and every block it took is free again; prefill as without it)."""


class DecodeAPI(WorkerAPI, Protocol):
    """The decode role: reserve, receive KV, decode with continuous batching, stream."""

    def connect_prefill(self, prefill_id: str, address: dict, peer: Any = None) -> None:
        """Join the pair group a prefill worker hosts at `address`."""

    def disconnect_prefill(self, prefill_id: str) -> None:
        """Tear down the pair group with a prefill worker that left."""

    def reserve(self, request: PromptRequest, prefill_id: str | None = None) -> Reservation:
        """Reserve blocks for the prompt (NoFreeBlocksError: not now, CapacityError: never)."""

    def local_generate(self, request: PromptRequest) -> None:
        """Prefill here (short uncached tail, no transfer), then decode; poll for outputs."""

    def poll(self, request_id: str, timeout: float = 1.0) -> list[TokenOutput]:
        """Outputs since the last poll; waits up to timeout for the first (KeyError: unknown)."""

    def poll_many(
        self, request_ids: Sequence[str], timeout: float = 1.0
    ) -> tuple[list[TokenOutput], list[str]]:
        """poll() of many requests in one call: (their outputs since their last poll, each
        request's in order; the ids this worker does not know). Returns once any of them has
        an output or is unknown, when wake_polls() is called, or after timeout."""

    def wake_polls(self) -> None:
        """End every poll_many call waiting now (its caller has new requests to add)."""

    def renew(self, request_id: str) -> bool:
        """The prefill worker is still computing the request's KV: its reservation's lease
        starts again. False when there is no live lease (lapsed, aborted or done)."""


# ---- errors ----------------------------------------------------------------------------------
# Errors that cross a transport as themselves (by class name over RPC, unwrapped over Ray); any
# other error arrives as the transport's own (kvtransfer.control.RemoteError, RayTaskError).
# Each takes its message as its only argument.
ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        EngineError,
        InvalidRequestError,
        GrammarRejected,
        PromptTooLongError,
        CapacityError,
        NoFreeBlocksError,
        ModelNotFoundError,
        TransferError,
        TransferTimeout,
        PeerLost,
        TransferRejected,
        UnknownPeer,
        DescriptorError,
        AddressError,
        LeaseError,
    )
}


def remote_error(kind: str, message: str) -> Exception | None:
    """The contract error named `kind` with `message`, or None if `kind` is not in ERRORS."""
    cls = ERRORS.get(kind)
    return None if cls is None else cls(message)


def is_contract_error(exc: BaseException) -> bool:
    """True if `exc` crosses transports as itself (its exact type is in ERRORS)."""
    return ERRORS.get(type(exc).__name__) is type(exc)


# ---- wire form -----------------------------------------------------------------------------
def to_wire(obj: Any) -> dict:
    """A contract dataclass as plain msgpack-able values (tuples become lists)."""
    return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}


def from_wire(cls: type, data: dict) -> Any:
    """Inverse of to_wire: rebuild `cls` from plain values (lists back to tuples, roles)."""
    hints = _hints(cls)
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if value is not None and hint is Role:
            value = Role(value)
        elif isinstance(value, list) and typing.get_origin(hint) is tuple:
            value = tuple(value)
        kwargs[name] = value
    return cls(**kwargs)


def pack(obj: Any) -> bytes:
    """msgpack bytes of to_wire(obj)."""
    return msgpack.packb(to_wire(obj), use_bin_type=True)


def unpack(cls: type, data: bytes) -> Any:
    """Inverse of pack."""
    return from_wire(cls, msgpack.unpackb(data, raw=False))


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    # Optional fields (X | None) are unwrapped to X: only tuples and Role need converting.
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
            hint = args[0]
        out[name] = hint
    return out
