"""Token selection: greedy, temperature, top-k, top-p, min-p, with position-derived randomness.

The logits processors (grammar bitmask, min_tokens, logit_bias, penalties) run first, on a
copy: logprobs are computed from the raw logits (vLLM's default, "raw_logprobs").

A sampled request draws its noise from a generator seeded by (seed, position of the token
being sampled), so its tokens do not depend on which other requests share the batch, and a
request moved to another engine continues with exactly the same draws.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.logits_processors import process_logits
from engine.sample_request import SampleRequest
from engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Log-probability of the sampled token and the top-n alternatives (raw model logits)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]

    def to_wire(self) -> list:
        """[token_id, logprob, [[id, logprob], ...top-n]]: plain lists for msgpack / Ray."""
        return [self.token_id, self.logprob, [[t, lp] for t, lp in self.top]]

    @classmethod
    def from_wire(cls, value: list) -> TokenLogprobs:
        """Inverse of to_wire."""
        token_id, logprob, top = value
        return cls(int(token_id), float(logprob), tuple((int(t), float(lp)) for t, lp in top))


def position_seed(seed: int, position: int) -> int:
    """A 63-bit seed for the draw at `position` of a request seeded with `seed`."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request seeded with `seed` (n > 1): choice 0 keeps the
    request's seed, so n == 1 draws exactly as before; the others get their own streams."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:choice:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k, top-p and min-p to one row [V]; masked entries are -inf."""
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p.
        drop_sorted = (probs.cumsum(-1) - probs) >= p.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if p.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def sample(logits: torch.Tensor, requests: list[SampleRequest]) -> list[int]:
    """logits: [N, V] fp32, one row per request -> N token ids (logits is not written)."""
    logits = process_logits(logits, requests)
    tokens = logits.argmax(dim=-1).tolist()
    for row, req in enumerate(requests):
        if req.params.greedy:
            continue
        filtered = _filter_logits(logits[row], req.params)
        probs = filtered.softmax(-1)
        gen = torch.Generator(device=logits.device).manual_seed(
            position_seed(req.seed, req.position)
        )
        # Exponential race (Gumbel-max in disguise): argmax p_i / E_i ~ Categorical(p).
        noise = torch.empty_like(probs).exponential_(generator=gen)
        tokens[row] = int((probs / noise).argmax())
    return tokens


def compute_logprobs(
    logits: torch.Tensor, tokens: list[int], requests: list[SampleRequest]
) -> list[TokenLogprobs | None]:
    """Logprobs for the rows whose params ask for them (None elsewhere)."""
    out: list[TokenLogprobs | None] = [None] * len(tokens)
    top_n = {i: r.params.logprobs for i, r in enumerate(requests) if r.params.logprobs is not None}
    rows = list(top_n)
    if not rows:
        return out
    logp = torch.log_softmax(logits[rows], dim=-1)
    for j, i in enumerate(rows):
        out[i] = top_logprobs(logp[j : j + 1], [tokens[i]], top_n[i])[0]
    return out


def top_logprobs(logp: torch.Tensor, targets: Sequence[int], n: int) -> list[TokenLogprobs]:
    """logp: [M, V] log-softmax rows -> M entries: targets[m]'s logprob and the top n."""
    picked = logp.gather(1, torch.tensor(list(targets), device=logp.device)[:, None])[:, 0]
    if n:
        values, ids = torch.topk(logp, n, dim=-1)
        tops = [
            tuple(zip(i, v, strict=True))
            for i, v in zip(ids.tolist(), values.tolist(), strict=True)
        ]
    else:
        tops = [()] * len(targets)
    return [
        TokenLogprobs(int(t), lp, top)
        for t, lp, top in zip(targets, picked.tolist(), tops, strict=True)
    ]
