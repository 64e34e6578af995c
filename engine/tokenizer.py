"""Tokenizer and end-of-sequence ids of a checkpoint directory."""

from __future__ import annotations

import json
from pathlib import Path


def load_tokenizer(model_dir: Path):
    """The checkpoint's Hugging Face tokenizer (fast), with its chat template."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def eos_token_ids(model_dir: Path, hf_config: dict, tokenizer=None) -> set[int]:
    """Every id that ends generation: generation_config, config.json and tokenizer eos."""
    ids: set[int] = set()

    def add(value) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))

    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        add(json.loads(gen.read_text()).get("eos_token_id"))
    add(hf_config.get("eos_token_id"))
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    return ids
