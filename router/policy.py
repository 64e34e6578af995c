"""Choosing the prefill and the decode worker for one request (pure logic, no RPC).

Prefill policies are chosen by name from POLICIES; "cache_aware" is the default. Every
policy sees only healthy workers; choose_prefill / choose_decode raise NoWorkerAvailable
when there are none.
"""

from __future__ import annotations

import random
import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

from engine.block_hash import BlockHash
from kvtransfer.worker_api import Role
from router.kv_cost import CostBook, WorkerRates
from router.kv_index import KVIndex, PrefixHits, WorkerId
from router.policy_names import DEFAULT_POLICY, POLICY_NAMES


class NoWorkerAvailable(RuntimeError):
    """No healthy worker of the needed role is registered."""


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A prefill worker's load as the router sees it."""

    worker_id: WorkerId
    queued_prefill_tokens: int = 0  # dispatched to it and not yet prefilled (see LoadTracker)
    running_requests: int = 0
    healthy: bool = True


@dataclass(frozen=True, slots=True)
class DecodeLoad:
    """A decode worker's load as the router sees it."""

    worker_id: WorkerId
    free_blocks: int  # free + evictable cached blocks (BlockPool.num_free_blocks)
    running_requests: int = 0
    healthy: bool = True
    total_blocks: int | None = None  # the worker's whole KV cache (None: unknown)


class PrefillChoice(NamedTuple):
    """The chosen prefill worker and the prompt tokens it is expected to find cached."""

    worker_id: WorkerId
    cached_tokens: int


class DecodeChoice(NamedTuple):
    """The chosen decode worker, its own prefix-hit blocks, whether the prompt fits now, and
    whether it could ever fit on some worker (once its running requests finish)."""

    worker_id: WorkerId
    hit_blocks: int
    fits: bool
    can_fit_later: bool = True


@dataclass(frozen=True, slots=True)
class PromptInfo:
    """What a policy may know about the prompt; `hits` reads the index, `cost` the rates.

    affinity: prompt tokens a worker is credited for holding the prompt's session (the
    worker its previous turn ran on, router/sessions.py); empty without a session."""

    block_hashes: Sequence[BlockHash]
    block_size: int
    num_tokens: int
    index: KVIndex
    costs: CostBook | None = None  # None: the default rates (router/kv_cost.py)
    affinity: Mapping[WorkerId, int] = field(default_factory=dict)

    @property
    def max_hit_blocks(self) -> int:
        """Blocks an engine may take from cache: its last token is always computed."""
        return min(len(self.block_hashes), (self.num_tokens - 1) // self.block_size)

    def hits(self, worker_id: WorkerId) -> PrefixHits:
        """The worker's leading cached blocks of the prompt: KV cache, then KV tier."""
        return self.index.hits(worker_id, self.block_hashes[: self.max_hit_blocks])

    def cached_tokens(self, worker_id: WorkerId) -> int:
        """Prompt tokens the worker need not compute (its KV cache's and its tier's)."""
        return self.hits(worker_id).blocks * self.block_size

    def rates(self, worker_id: WorkerId) -> WorkerRates:
        return self.costs.rates(worker_id) if self.costs is not None else WorkerRates()

    def cost_tokens(self, worker_id: WorkerId) -> float:
        """The prompt's prefill on the worker in prefill tokens: the uncached tokens, each
        tier-hit token at its tier cost (router/kv_cost.py), less the session affinity."""
        h = self.hits(worker_id)
        uncached = self.num_tokens - h.blocks * self.block_size
        tier = (
            h.tier
            * self.block_size
            * self.rates(worker_id).tier_token_cost(h.medium, self.block_size)
        )
        return uncached + tier - self.affinity.get(worker_id, 0)


class Policy(ABC):
    """Picks one prefill worker; called with a non-empty list of healthy workers."""

    # True when choices depend on earlier calls: such a policy must be built once
    # (make_policy) and reused, not named afresh on every call.
    stateful: ClassVar[bool] = False

    @abstractmethod
    def choose(self, prompt: PromptInfo, loads: list[WorkerLoad]) -> WorkerLoad:
        """One of `loads`; does not modify the index or the loads."""


class CacheAware(Policy):
    """The worker that would finish this prompt's prefill soonest.

    score = (PromptInfo.cost_tokens + queued prefill tokens) x the worker's prefill seconds
    per token: uncached tokens count whole, tier hits at their tier cost (between a device
    hit's 0 and 1), so the longest cached prefix wins unless that worker's queue is longer
    than what its cache saves. Ties go to the shorter queue, then to the worker caching fewer
    blocks (a new prompt family goes where it displaces least and spreads the families over
    the pool), then the lower worker id.
    """

    def choose(self, prompt: PromptInfo, loads: list[WorkerLoad]) -> WorkerLoad:
        def key(w: WorkerLoad) -> tuple[float, int, int, str]:
            cost = prompt.cost_tokens(w.worker_id) + w.queued_prefill_tokens
            return (
                cost * prompt.rates(w.worker_id).prefill_token_s,
                w.queued_prefill_tokens,
                prompt.index.num_blocks(w.worker_id),
                w.worker_id,
            )

        return min(loads, key=key)


class RoundRobin(Policy):
    """Healthy workers in worker-id order, one after the other, skipping absent ones."""

    stateful = True

    def __init__(self) -> None:
        self._last: WorkerId | None = None
        self._lock = threading.Lock()

    def choose(self, prompt: PromptInfo, loads: list[WorkerLoad]) -> WorkerLoad:
        ordered = sorted(loads, key=lambda w: w.worker_id)
        with self._lock:
            # The first id after the last one chosen; wrap around to the lowest.
            nxt = next(
                (w for w in ordered if self._last is None or w.worker_id > self._last), ordered[0]
            )
            self._last = nxt.worker_id
        return nxt


class LeastLoaded(Policy):
    """Fewest queued prefill tokens, then fewest running requests, then lowest id."""

    def choose(self, prompt: PromptInfo, loads: list[WorkerLoad]) -> WorkerLoad:
        return min(loads, key=lambda w: (w.queued_prefill_tokens, w.running_requests, w.worker_id))


class RandomChoice(Policy):
    """A uniformly random healthy worker; reproducible for a given seed and call sequence."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def choose(self, prompt: PromptInfo, loads: list[WorkerLoad]) -> WorkerLoad:
        ordered = sorted(loads, key=lambda w: w.worker_id)  # independent of input order
        with self._lock:
            return self._rng.choice(ordered)


# one class per name of POLICY_NAMES (what the manifest accepts), in that order
POLICIES: dict[str, type[Policy]] = dict(
    zip(POLICY_NAMES, (CacheAware, RoundRobin, LeastLoaded, RandomChoice), strict=True)
)


def make_policy(name: str = DEFAULT_POLICY, **options) -> Policy:
    """Build the policy registered under `name` (options e.g. seed= for "random")."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)}"
        ) from None
    return cls(**options)


def _healthy(loads: Sequence[WorkerLoad | DecodeLoad], role: str) -> list:
    ids = [w.worker_id for w in loads]
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate {role} worker ids in {ids}")
    healthy = [w for w in loads if w.healthy]
    if not healthy:
        detail = f"all {len(loads)} are unhealthy: {sorted(ids)}" if loads else "none registered"
        raise NoWorkerAvailable(f"no healthy {role} worker ({detail})")
    return healthy


def _check_prompt(block_hashes: Sequence[BlockHash], block_size: int, num_tokens: int) -> None:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    full = num_tokens // block_size
    if len(block_hashes) > full:  # fewer is fine: the router may hash only a leading part
        raise ValueError(
            f"num_prompt_tokens={num_tokens} makes {full} full blocks of "
            f"{block_size}, but {len(block_hashes)} block hashes were given"
        )


def choose_prefill(
    policy: str | Policy,
    prompt_block_hashes: Sequence[BlockHash],
    block_size: int,
    loads: Sequence[WorkerLoad],
    index: KVIndex,
    *,
    num_prompt_tokens: int | None = None,
    costs: CostBook | None = None,
    affinity: Mapping[WorkerId, int] | None = None,
) -> PrefillChoice:
    """Pick a healthy prefill worker with `policy` (a name in POLICIES or an instance).

    Without num_prompt_tokens the prompt is taken to end in a partial block after its
    full ones; pass it to apply the engine's cap (the last token is never cached). costs:
    the workers' measured rates (None: the defaults); affinity: PromptInfo's.
    """
    if isinstance(policy, str):
        if policy in POLICIES and POLICIES[policy].stateful:
            raise ValueError(
                f"policy {policy!r} keeps state between calls: build it once "
                f"with make_policy({policy!r}) and pass the instance"
            )
        policy = make_policy(policy)
    if num_prompt_tokens is None:
        num_prompt_tokens = len(prompt_block_hashes) * block_size + 1
    _check_prompt(prompt_block_hashes, block_size, num_prompt_tokens)
    prompt = PromptInfo(
        prompt_block_hashes, block_size, num_prompt_tokens, index, costs, affinity or {}
    )
    chosen = policy.choose(prompt, _healthy(loads, Role.PREFILL))
    return PrefillChoice(chosen.worker_id, prompt.cached_tokens(chosen.worker_id))


def choose_decode(
    prompt_block_hashes: Sequence[BlockHash],
    num_prompt_tokens: int,
    block_size: int,
    loads: Sequence[DecodeLoad],
    index: KVIndex,
    *,
    costs: CostBook | None = None,
    affinity: Mapping[WorkerId, int] | None = None,
) -> DecodeChoice:
    """Pick a healthy decode worker: room for the prompt, then the most prefill its own
    cached prefix saves (from the worker's KV events: its KV cache's tokens whole, its tier's
    at 1 - their tier cost, plus the session affinity), then fewer running requests, then
    fewer cached blocks (a new prompt family goes where it displaces least, spreading
    families over the pool, as CacheAware does), then the lower id. In aggregated mode this
    is the only choice made. hit_blocks counts the KV cache's and the tier's blocks (a
    reservation counts both).

    A worker "fits" when its free blocks cover every block of the prompt (its own hits may
    be evictable blocks that the reservation takes off the free queue too). If none fits,
    the best of the rest is returned with fits=False; the caller decides to wait or fail.
    """
    _check_prompt(prompt_block_hashes, block_size, num_prompt_tokens)
    healthy = _healthy(loads, Role.DECODE)
    needed = -(-num_prompt_tokens // block_size)
    prompt = PromptInfo(
        prompt_block_hashes, block_size, num_prompt_tokens, index, costs, affinity or {}
    )
    hits = {w.worker_id: prompt.hits(w.worker_id) for w in healthy}
    # prefill tokens each worker's own cache saves (as PromptInfo.cost_tokens counts them)
    saved = {w: num_prompt_tokens - prompt.cost_tokens(w) for w in hits}
    best = min(
        healthy,
        key=lambda w: (
            w.free_blocks < needed,
            -saved[w.worker_id],
            w.running_requests,
            index.num_blocks(w.worker_id),
            w.worker_id,
        ),
    )
    later = any(w.total_blocks is None or w.total_blocks >= needed for w in healthy)
    return DecodeChoice(
        best.worker_id, hits[best.worker_id].blocks, best.free_blocks >= needed, later
    )


class LoadTracker:
    """Queued prefill tokens per worker, from dispatch until prefilled; thread-safe."""

    def __init__(self) -> None:
        self._queued: dict[WorkerId, int] = {}  # invariant: every value >= 0
        self._lock = threading.Lock()

    def dispatched(self, worker_id: WorkerId, n_tokens: int) -> None:
        """Count n_tokens (the uncached tokens of a prompt) as queued on the worker."""
        if n_tokens < 0:
            raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
        with self._lock:
            self._queued[worker_id] = self._queued.get(worker_id, 0) + n_tokens

    def prefilled(self, worker_id: WorkerId, n_tokens: int) -> None:
        """Take n_tokens off the worker's queue (clamped at zero: never negative)."""
        if n_tokens < 0:
            raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
        with self._lock:
            self._queued[worker_id] = max(0, self._queued.get(worker_id, 0) - n_tokens)

    def queued(self, worker_id: WorkerId) -> int:
        """Tokens dispatched to the worker and not yet prefilled."""
        with self._lock:
            return self._queued.get(worker_id, 0)

    def forget(self, worker_id: WorkerId) -> None:
        """Drop a worker's count (it died; its queue is gone with it)."""
        with self._lock:
            self._queued.pop(worker_id, None)

    def snapshot(self) -> dict[WorkerId, int]:
        """A copy of all counts."""
        with self._lock:
            return dict(self._queued)
