"""Test helper: the tiny random Llama with a real tokenizer (byte-level BPE trained here in
milliseconds, vocabulary = the model's 512 ids), so that text, chat templates, tool calls and
grammars go through the real code paths; nothing is downloaded."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tests.checkpoints import make_checkpoint

VOCAB = 512
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 (config eos is 2)
_WORDS = (
    "weather city Paris London Tokyo name arguments temperature unit celsius fahrenheit "
    "function tool call result the a is of and to in hello world user assistant system red "
    "green blue true false null count items query search answer yes no color ok get_weather"
).split()


def _corpus() -> list[str]:
    rng = random.Random(0)
    lines = []
    for _ in range(400):
        lines.append(" ".join(rng.choice(_WORDS) for _ in range(12)))
        lines.append(json.dumps({rng.choice(_WORDS): rng.choice(_WORDS), "n": rng.randint(0, 999)}))
    lines += ["<tool_call>\n", "</tool_call>", "<tool_response>", "</tool_response>"] * 20
    return lines


def make_tokenizer(directory: Path, chat_template: str | None = None):
    """Train and save the tokenizer into `directory`; returns it (PreTrainedTokenizerFast)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    assert tok.get_vocab_size() == VOCAB
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    if chat_template is not None:
        hf.chat_template = chat_template
    hf.save_pretrained(directory)
    return hf


def make_tokenized_llama(root: Path) -> Path:
    """The tiny Llama checkpoint with the tokenizer beside its weights."""
    path = make_checkpoint(root, "llama")
    make_tokenizer(path)
    return path
