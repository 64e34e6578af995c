"""SampleRequest: one logits row to sample and what the logits processors read of it
(its own module: the sampler and the logits processors both need it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class SampleRequest:
    """One logits row to sample: its parameters, its seed, the position it fills and what
    the logits processors (engine/logits_processors.py) read."""

    params: SamplingParams
    seed: int  # the choice's seed (choice_seed of the request's)
    position: int
    token_ids: Sequence[int] = ()  # prompt + generated tokens; needed only with penalties
    num_output_tokens: int = 0  # generated so far (a migrated request's earlier ones included)
    min_tokens_mask: frozenset[int] = frozenset()  # EOS (unless ignore_eos) + stop_token_ids
    bitmask: torch.Tensor | None = None  # [ceil(V / 32)] int32: the grammar's allowed tokens
