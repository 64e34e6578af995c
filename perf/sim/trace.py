"""Trace prompts as block hashes without drawing their tokens (the fast path for long traces).

TraceWorkload's prompt is its hash ids' token blocks (block_len tokens each, equal ids give
equal tokens) cut to input_length, padded with request-unique tokens. So engine block j
(block_size tokens) of a prompt is sub-block j % (block_len / block_size) of hash id
hash_ids[j // (block_len / block_size)], or padding: chaining (parent, id, sub) gives two
prompts equal hashes exactly where engine.block_hash would (block_len a multiple of
block_size), at a fraction of the cost.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from perf.bench.workloads import OneShot, TraceWorkload


@dataclass(frozen=True, slots=True)
class HashedSpec:
    """A RequestSpec whose prompt is given by its block hashes and length."""

    session: str
    turn: int
    num_prompt_tokens: int
    block_hashes: tuple[int, ...]
    max_tokens: int
    kind: str = "trace"
    tenant: str = ""
    cache_salt: str | None = None
    arrival_s: float | None = None

    @property
    def request_id(self) -> str:
        return f"{self.session}-{self.turn}"


def trace_hashes(row: dict, index: int, block_len: int, block_size: int, seed: int) -> tuple:
    """The chained block hashes of trace row `index` (see the module docstring)."""
    if block_len % block_size:
        raise ValueError(f"trace block_len {block_len} is not a multiple of {block_size}")
    per = block_len // block_size
    ids = row.get("hash_ids", ())
    out, parent = [], hash(("trace", seed))
    for j in range(int(row["input_length"]) // block_size):
        k = j // per
        source = ids[k] if k < len(ids) else -1 - index  # padding is unique per request
        parent = hash((parent, source, j % per if k < len(ids) else j))
        out.append(parent)
    return tuple(out)


def trace_sessions(
    workload: TraceWorkload, block_size: int, seed: int
) -> Iterator[OneShot[HashedSpec]]:
    """TraceWorkload.sessions, as HashedSpecs."""
    lines = workload.rows()
    start = min((r["timestamp"] for r in lines if "timestamp" in r), default=0)
    for i, row in enumerate(lines):
        arrival = None
        if "timestamp" in row:
            arrival = (row["timestamp"] - start) / 1000 * workload.time_scale
        yield OneShot(
            HashedSpec(
                f"t{i}",
                0,
                int(row["input_length"]),
                trace_hashes(row, i, workload.block_len, block_size, seed),
                int(row["output_length"]),
                arrival_s=arrival,
            )
        )
