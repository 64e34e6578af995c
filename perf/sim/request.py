"""A simulated request: what the router and the workers need of a prompt (its block hashes,
not its tokens), and what the client records of it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.block_pool import KVBlock

PREFILL, FULL, DECODE = "prefill", "full", "decode"  # a job's part on one worker


@dataclass(slots=True, eq=False)
class SimRequest:
    """One request through the cluster; times are simulated seconds from the first arrival."""

    request_id: str
    hashes: list[int]  # chained hashes of the prompt's full blocks (engine.block_hash or trace)
    prompt_tokens: int
    max_tokens: int
    send_s: float
    kind: str = "chat"
    tenant: str = ""
    cached_tokens: int = 0
    oracle_cached_tokens: int = 0
    prefill_worker: str = ""
    decode_worker: str = ""
    chunks: list[tuple[float, int]] = field(default_factory=list)
    end_s: float = 0.0
    on_done: Callable[[SimRequest], object] | None = None  # called when the last token is out


@dataclass(slots=True, eq=False)
class Job:
    """A request's part on one worker: prefill only (P), prefill then decode (local or
    aggregated), or decode of KV that arrived. num_tokens = prompt + tokens sampled so far;
    the worker computes until num_computed == num_tokens, then samples."""

    request: SimRequest
    mode: str
    num_tokens: int
    num_computed: int = 0
    blocks: list[KVBlock] = field(default_factory=list)
    hit_blocks: int = 0  # blocks found in this worker's cache at admission
    stored: int = 0  # leading full prompt blocks registered in the cache so far
    output: int = 0  # tokens sampled on this worker (a DECODE job starts at 1: P's)
    peer: Job | None = None  # a PREFILL job's DECODE job on the decode worker

    def decode_job(self) -> Job:
        """A PREFILL job's DECODE job (its peer)."""
        if self.peer is None:
            raise RuntimeError(f"{self.request.request_id}: a prefill job without its decode job")
        return self.peer

    queued: int = 0  # the prefill tokens the router counted as queued (LoadTracker)
