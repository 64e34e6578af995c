"""Fixtures of the router tests: the tiny Llama's tokenizer (tests/conftest.py's
tiny_llama_tok, a real byte-level BPE of the model's 512 ids)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer(tiny_llama_tok):
    from engine.tokenizer import load_tokenizer

    return load_tokenizer(tiny_llama_tok)
