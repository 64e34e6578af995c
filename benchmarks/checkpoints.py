"""Tiny random Hugging Face checkpoints (seconds to build): the test suite's models and the
soak benchmark's --tiny one."""

from __future__ import annotations

from pathlib import Path

import torch


def make_checkpoint(root: Path, kind: str = "llama", **overrides) -> Path:
    """Save a tiny random `kind` (llama | mistral | qwen2) model; return its directory."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
    )
    common.update(overrides)
    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(
            LlamaConfig(tie_word_embeddings=True, rope_theta=10000.0, **common)
        )
    elif kind == "mistral":
        model = MistralForCausalLM(
            MistralConfig(tie_word_embeddings=False, rope_theta=1e4, sliding_window=96, **common)
        )
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=False, rope_theta=1e6, **common))
    else:
        raise ValueError(kind)
    # Larger-than-default init so logits are well separated (greedy ties are unlikely).
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    out = root / kind
    model.save_pretrained(out)
    return out
