"""Baton engine: one process serving a Llama-family model with paged KV.

Public API: LLM (offline), LLMEngine (step loop), SamplingParams.

The names below load on first use (PEP 562), so that importing a light module of the package
(engine.options, engine.block_hash, engine.errors) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.errors import (
        CapacityError,
        EngineError,
        InvalidRequestError,
        ModelNotFoundError,
        NoFreeBlocksError,
        PromptTooLongError,
    )
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine
    from engine.outputs import CompletionOutput, RequestOutput, StepResult
    from engine.sampling_params import SamplingParams

_MODULE_OF = {
    "LLM": "engine.llm",
    "CapacityError": "engine.errors",
    "CompletionOutput": "engine.outputs",
    "EngineConfig": "engine.config",
    "EngineError": "engine.errors",
    "InvalidRequestError": "engine.errors",
    "LLMEngine": "engine.llm_engine",
    "ModelNotFoundError": "engine.errors",
    "NoFreeBlocksError": "engine.errors",
    "PromptTooLongError": "engine.errors",
    "RequestOutput": "engine.outputs",
    "SamplingParams": "engine.sampling_params",
    "StepResult": "engine.outputs",
}
__all__ = [
    "LLM",
    "CapacityError",
    "CompletionOutput",
    "EngineConfig",
    "EngineError",
    "InvalidRequestError",
    "LLMEngine",
    "ModelNotFoundError",
    "NoFreeBlocksError",
    "PromptTooLongError",
    "RequestOutput",
    "SamplingParams",
    "StepResult",
]


def __getattr__(name: str):
    """Import a public name's module when the name is first used."""
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULE_OF[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))
