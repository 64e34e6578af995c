"""Tiny random Hugging Face checkpoints for tests (built once per session, seconds)."""

from __future__ import annotations

from pathlib import Path

import torch


def make_checkpoint(root: Path, kind: str = "llama", tokenizer: bool = False, **overrides) -> Path:
    """Save a tiny random `kind` (llama | mistral | qwen2) model; return its directory.

    tokenizer: also save a byte-level BPE tokenizer of the model's 512 ids (make_tokenizer).
    """
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
    out = root / (f"{kind}-tok" if tokenizer else kind)
    model.save_pretrained(out)
    if tokenizer:
        make_tokenizer(out, common["vocab_size"])
    return out


def make_tokenizer(out: Path, vocab_size: int = 512) -> None:
    """A byte-level BPE tokenizer of exactly vocab_size ids (<unk> 0, <s> 1, </s> 2, the 256
    bytes, merges learned from JSON-like text), saved into `out`: every string encodes."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [
        json.dumps({"name": f"item{i}", "count": i * 7, "ok": i % 2 == 0, "tags": ["red", "b"]})
        for i in range(200)
    ] + ["yes no maybe hello world the quick brown fox jumps over the lazy dog 0123456789"] * 5
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} ids, wanted {vocab_size}")
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(out)
