"""Fixtures of the router tests: the tiny Llama with a real tokenizer."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenized_llama(tmp_path_factory) -> str:
    from tests.router.agent_checkpoint import make_tokenized_llama

    return str(make_tokenized_llama(tmp_path_factory.mktemp("tokenized")))


@pytest.fixture(scope="session")
def tokenizer(tokenized_llama):
    from engine.tokenizer import load_tokenizer

    return load_tokenizer(tokenized_llama)
