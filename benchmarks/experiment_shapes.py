"""What an experiment is: the cluster shapes it compares, its runs and its workload."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Shape:
    """A cluster shape: pool sizes, the router's policy and threshold, engine overrides."""

    prefill: int
    decode: int
    policy: str = "cache_aware"
    local_prefill_tokens: int = 0
    engine: Mapping[str, object] = field(default_factory=dict)

    def manifest(self, base: dict, name: str) -> dict:
        """The base manifest with this shape applied (free ports, a name per run)."""
        data = copy.deepcopy(base)
        spec = data["spec"]
        data["metadata"]["name"] = name
        spec["prefill"]["replicas"] = self.prefill
        spec["decode"]["replicas"] = self.decode
        spec["router"].update(
            policy=self.policy, local_prefill_tokens=self.local_prefill_tokens, port=0, http_port=0
        )
        spec["engine"].update(self.engine)
        if "chunk_size" in self.engine:  # a step must fit one chunk
            budget = spec["engine"].get("max_num_batched_tokens") or 0
            spec["engine"]["max_num_batched_tokens"] = max(budget, self.engine["chunk_size"])
        return data


@dataclass(frozen=True)
class Run:
    name: str
    shape: Shape
    options: Mapping[str, object] = field(default_factory=dict)  # over the experiment's


@dataclass(frozen=True)
class Experiment:
    name: str
    question: str
    workload: str
    options: Mapping[str, object]  # workload options (full size)
    quick_options: Mapping[str, object]  # --quick: sizes for a tiny model
    num_requests: int
    request_rate: float
    slo: str
    runs: tuple[Run, ...]
    verdict: Callable[[dict[str, dict]], list[str]]  # run name -> summary => lines
    max_concurrency: int | None = None  # 1: one request at a time (no queueing anywhere)
