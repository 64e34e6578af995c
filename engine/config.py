"""EngineConfig: every engine option in one validated, frozen place."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.errors import InvalidRequestError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Options of one engine. Unset capacity values are derived from the model at start-up."""

    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto: cuda if available, else cpu
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: derived from kv_cache_memory_gb
    kv_cache_memory_gb: float = 2.0
    chunk_size: int = 1024  # most prefill tokens one request gets in a step
    max_num_batched_tokens: int = 2048  # all tokens in one step
    max_num_seqs: int = 128
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    hash_seed: str = "baton"
    skip_tokenizer_init: bool = False
    seed: int = 0
    attention_backend: str = "auto"  # auto: triton on CUDA; on CPU cpu (C decode), else torch
    num_threads: int | None = None  # torch intra-op threads on CPU; None: leave as is
    # CPU float32, a checkpoint converted from a GGUF: batches of up to 8 rows multiply from
    # its Q4_1 / Q8_0 blocks (the same weights, a fraction of the bytes to read)
    use_gguf_blocks: bool = True

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise InvalidRequestError(f"{name}={value!r} is invalid: must be an integer >= 1")

        for name in (
            "block_size",
            "num_kv_blocks",
            "chunk_size",
            "max_num_batched_tokens",
            "max_num_seqs",
            "max_model_len",
        ):
            positive(name)
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise InvalidRequestError(
                f"dtype={self.dtype!r} is invalid: choose auto, {', '.join(DTYPES)}"
            )
        if self.chunk_size > self.max_num_batched_tokens:
            raise InvalidRequestError(
                f"chunk_size={self.chunk_size} exceeds max_num_batched_tokens="
                f"{self.max_num_batched_tokens}"
            )
        if self.kv_cache_memory_gb <= 0:
            raise InvalidRequestError("kv_cache_memory_gb must be > 0")

    @classmethod
    def from_options(cls, model: str | None = None, **options) -> EngineConfig:
        """Build from keyword options, naming any unknown option in the error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InvalidRequestError(
                f"unknown engine option(s) {unknown}; known options: {sorted(known)}"
            )
        if model is not None:
            options["model"] = model
        return cls(**options)

    def torch_device(self) -> torch.device:
        """The device, with an index on CUDA ("cuda" -> the current device, e.g. cuda:0)."""
        name = self.device
        if name == "auto":
            name = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(name)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return DTYPES[self.dtype]


def use_device(device: torch.device) -> None:
    """Make `device` current for this thread: CUDA kernels (Triton's included) launch on the
    current device, which every new thread starts at cuda:0. A no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
