"""Baton engine: one process serving a Llama-family model with paged KV.

Public API: LLM (offline), LLMEngine (step loop), SamplingParams.
"""

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
