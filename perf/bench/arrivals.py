"""Request arrival times, with vLLM's semantics.

Gaps between arrivals are gamma-distributed with shape = burstiness and
scale = 1 / (rate * burstiness): the mean gap is always 1 / rate; burstiness 1 is a Poisson
process, below 1 burstier, above 1 more regular. rate = inf sends everything at once. The first
request arrives at 0. The concurrency cap (`--max-concurrency`) is applied on top by the
driver: an arrival that finds the cap reached waits for a slot, and its latency counts from
when it is actually sent.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np


def arrival_times(rate: float, burstiness: float = 1.0, seed: int = 0) -> Iterator[float]:
    """Endless arrival offsets in seconds (0, then cumulative gamma gaps), reproducible from
    the seed."""
    if rate <= 0 or math.isnan(rate):
        raise ValueError(f"request rate must be > 0 (inf: all at once), got {rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    rng = np.random.default_rng(seed)
    t = 0.0
    while True:
        yield t
        if not math.isinf(rate):
            t += float(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness)))
