"""EngineConfig: the engine options (defined in engine/options.py) and their torch side."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.errors import InvalidRequestError
from engine.options import DTYPE_NAMES, EngineOptions

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


@dataclass(frozen=True, slots=True)
class EngineConfig(EngineOptions):
    """Options of one engine (fields, defaults and checks: EngineOptions), with their torch
    device and dtype."""

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
