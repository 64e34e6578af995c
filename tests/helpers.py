"""Helpers that several test modules use: prompts, HF greedy reference, engine runs."""

from __future__ import annotations

import numpy as np
import torch

from engine import LLMEngine


def random_prompts(lengths: list[int], seed: int = 1, vocab: int = 512) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    out = hf.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt)),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def run_to_completion(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for rid, out in engine.step().outputs.items():
            tokens.setdefault(rid, []).extend(out.new_token_ids)
    return tokens


def llamacpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to HF q/k rows (written out independently)."""
    d = w.shape[0] // n_heads
    out = np.empty_like(w)
    for h in range(n_heads):
        for i in range(d // 2):
            out[h * d + 2 * i] = w[h * d + i]  # first half of each head -> even rows
            out[h * d + 2 * i + 1] = w[h * d + d // 2 + i]  # second half -> odd rows
    return out
