"""Logits processors: what changes a row's logits before temperature, top-k/p and min-p.

Applied per row, in this order (vLLM's): the grammar's token bitmask, min_tokens (EOS and
stop_token_ids masked until that many tokens are generated), logit_bias, then the penalties:
repetition (over prompt + generated tokens, Hugging Face semantics), frequency and presence
(over generated tokens, OpenAI semantics). A row that nothing applies to is left alone, and
the input tensor is never written: the caller keeps the raw logits for logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.sample_request import SampleRequest


def needs_processing(req: SampleRequest) -> bool:
    """Whether any processor changes this row."""
    p = req.params
    return (
        req.bitmask is not None
        or bool(p.logit_bias)
        or p.has_penalties
        or (bool(req.min_tokens_mask) and req.num_output_tokens < p.min_tokens)
    )


def process_logits(logits: torch.Tensor, requests: Sequence[SampleRequest]) -> torch.Tensor:
    """logits: [N, V] fp32, one row per request -> the processed logits (the same tensor
    when no row needs processing, else a copy)."""
    rows = [i for i, r in enumerate(requests) if needs_processing(r)]
    if not rows:
        return logits
    out = logits.clone()
    _apply_bitmasks(out, requests)
    for i in rows:
        _process_row(out[i], requests[i])
    return out


def _apply_bitmasks(logits: torch.Tensor, requests: Sequence[SampleRequest]) -> None:
    """Mask (-inf) the tokens each constrained row's grammar forbids, in one batched call."""
    bitmasks = {i: r.bitmask for i, r in enumerate(requests) if r.bitmask is not None}
    constrained = list(bitmasks)
    if not constrained:
        return
    import xgrammar as xgr

    first = bitmasks[constrained[0]]
    masks = torch.full((len(requests), first.shape[-1]), -1, dtype=first.dtype)
    for i, bitmask in bitmasks.items():
        masks[i] = bitmask
    xgr.apply_token_bitmask_inplace(
        logits, masks.to(logits.device), vocab_size=logits.shape[-1], indices=constrained
    )


def _process_row(row: torch.Tensor, req: SampleRequest) -> None:
    """min_tokens, logit_bias and penalties on one row [V], in place."""
    p = req.params
    vocab = row.shape[-1]
    if req.min_tokens_mask and req.num_output_tokens < p.min_tokens:
        ids = torch.tensor(
            [t for t in req.min_tokens_mask if t < vocab], dtype=torch.long, device=row.device
        )
        kept = row[ids].clone()
        row[ids] = float("-inf")
        if not torch.isfinite(row).any():  # the grammar allows only a stop token: it wins
            row[ids] = kept
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long, device=row.device)
        bias = torch.tensor([b for _, b in p.logit_bias], dtype=row.dtype, device=row.device)
        row.index_add_(0, ids, bias)
    if not p.has_penalties:
        return
    tokens = torch.tensor(list(req.token_ids), dtype=torch.long, device=row.device)
    if p.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=row.device)
        seen[tokens] = True
        values = row[seen]
        row[seen] = torch.where(
            values > 0, values / p.repetition_penalty, values * p.repetition_penalty
        )
    if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
        generated = tokens[len(tokens) - req.num_output_tokens :]
        counts = torch.bincount(generated, minlength=vocab)[:vocab].to(row.dtype)
        row -= p.frequency_penalty * counts
        row -= p.presence_penalty * (counts > 0).to(row.dtype)
