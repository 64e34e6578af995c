"""Linear layers that also keep their weight as GGUF blocks, for small batches on CPU.

A decode step of one to a few requests is bound by memory bandwidth: it reads every weight
once per step. Reading SmolLM2's Q4_1 blocks (20 bytes per 32 weights) instead of float32
(128 bytes) makes those products ~2.5x faster on this project's 2-core CPU (measured:
all matrices of a token at one row, 9.9 ms vs 24.3 ms with oneDNN's prepacked float32). The
weights are the checkpoint's own: the float32 tensors were dequantized from the same blocks,
and the arithmetic is float32. Above QUANT_MAX_ROWS rows the dense float32 layer is faster
(it reuses each weight across rows better) and takes over.

With int8_activations (opt-in) the products of up to QUANT_MAX_ROWS rows quantize x to int8
per 32 values and sum integer dot products (gguf_matmul_int8, llama.cpp's arithmetic): not
the float32 model's numbers any more; above QUANT_MAX_ROWS rows the dense float32 layer still
takes over (so a long prefill stays exact float32).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from torch import nn

from engine.model.gguf_kernel import (
    check_blocks,
    gemv_isa,
    gguf_matmul,
    gguf_matmul_int8,
    int8_isa,
    load_kernel,
    q8_0_rows_avx512,
)

if TYPE_CHECKING:
    from engine.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

# Measured, every matrix of SmolLM2 once (blocks vs oneDNN float32): 1 row 9.9 vs 24.3 ms,
# 4 rows 15.3 vs 30.8, 8 rows 28.6 vs 37.6, 12 rows 42.4 vs 43.7, 16 rows 58.4 vs 50.7.
QUANT_MAX_ROWS = 8


class GGUFBlockLinear(nn.Module):
    """y = x W^T + b: from the GGUF blocks up to QUANT_MAX_ROWS rows, else the dense layer."""

    def __init__(
        self,
        dense: nn.Module,
        blocks: torch.Tensor,
        block_type: int,
        in_features: int,
        lib: ctypes.CDLL,
        int8_activations: bool = False,
        isa: str | None = None,
        q8_0_avx512: bool | None = None,
    ) -> None:
        """isa: the instruction set of its kernel (gguf_kernel.gemv_isa's or, with
        int8_activations, int8_isa's answer); q8_0_avx512: whether one row of Q8_0 weights takes
        the AVX-512 kernel too (q8_0_rows_avx512's answer); None: theirs for gguf_isa auto."""
        super().__init__()
        check_blocks(blocks, blocks.shape[0], in_features, block_type)
        self.dense = dense  # PackedLinear or nn.Linear holding the same float32 weight
        self.blocks = blocks  # [N, K / 32 * block bytes] uint8
        self.block_type = block_type
        self.bias = getattr(dense, "bias", None)
        self._lib = lib
        self.int8_activations = int8_activations
        self.isa = isa or (int8_isa(lib) if int8_activations else gemv_isa(lib))
        self.q8_0_avx512 = q8_0_rows_avx512(lib) if q8_0_avx512 is None else q8_0_avx512

    @property
    def weight(self) -> torch.Tensor:
        weight = self.dense.weight
        if not isinstance(weight, torch.Tensor):  # nn.Linear and PackedLinear hold one
            raise TypeError(f"{type(self.dense).__name__} has no weight tensor")
        return weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= QUANT_MAX_ROWS and x.dtype == torch.float32:
            if self.int8_activations:
                y = gguf_matmul_int8(self._lib, x, self.blocks, self.block_type, self.isa)
            else:
                y = gguf_matmul(
                    self._lib, x, self.blocks, self.block_type, self.isa, self.q8_0_avx512
                )
            return y if self.bias is None else y.add_(self.bias)
        return self.dense(x)


def read_blocks(path: Path) -> dict[str, tuple[torch.Tensor, int]]:
    """HF tensor name -> (uint8 blocks, GGML type id) from a converter's blocks file."""
    out = {}
    with safe_open(str(path), framework="pt", device="cpu") as f:
        types = f.metadata() or {}
        for name in f.keys():
            out[name] = (f.get_tensor(name), int(types[name]))
    return out


def _head(model: LlamaForCausalLM) -> nn.Module:
    """The output projection as a layer (a tied model without oneDNN has none of its own)."""
    if model.lm_head is not None:
        return model.lm_head
    head = nn.Linear(model.args.hidden_size, model.args.vocab_size, bias=False, device="meta")
    head.weight = model.embed_tokens.weight
    return head


def attach_gguf_blocks(
    model: LlamaForCausalLM,
    blocks_file: Path,
    target: Callable,
    int8_activations: bool = False,
    gguf_isa: str = "auto",
) -> int:
    """Wrap every linear of `model` whose whole weight the blocks file holds (fused q/k/v and
    gate/up: every part, all of one type) in a GGUFBlockLinear (with int8 activations if
    asked), its kernels on the instruction set the gguf_isa option picks (InvalidRequestError
    where this CPU lacks it). `target` maps an HF name to (our parameter name, shard index or
    None) like the float32 loader does. Returns how many layers were wrapped; 0 where the
    kernel cannot run here."""
    lib = load_kernel()
    if lib is None:
        return 0
    isa = int8_isa(lib, gguf_isa) if int8_activations else gemv_isa(lib, gguf_isa)
    q8_0_avx512 = q8_0_rows_avx512(lib, gguf_isa)  # gguf_isa=amx without AMX: the error here
    parts: dict[str, dict[int | None, tuple[torch.Tensor, int]]] = {}
    for name, (blocks, block_type) in read_blocks(blocks_file).items():
        where = target(model, name)
        if where is not None:
            ours, shard = where
            parts.setdefault(ours, {})[shard] = (blocks, block_type)
    wrapped = 0
    for param_name, shards in parts.items():
        owner_name = param_name.removesuffix(".weight")
        if param_name == "embed_tokens.weight":  # tied: the lm_head multiplies by it
            if model.args.tie_word_embeddings:
                owner_name = "lm_head"
            else:
                continue
        layer = model.get_submodule(owner_name) if owner_name != "lm_head" else _head(model)
        shard_order = sorted(shards, key=lambda s: -1 if s is None else s)
        if len({t for _, t in shards.values()}) != 1:
            continue  # mixed block types in one fused matrix: keep it dense
        blocks = torch.cat([shards[s][0] for s in shard_order])
        weight = layer.weight
        if not isinstance(weight, torch.Tensor):  # every projection is a linear layer
            raise TypeError(f"{owner_name} has no weight tensor")
        if blocks.shape[0] != weight.shape[0]:
            continue  # not every part of a fused matrix is quantized
        if owner_name.endswith("qkv_proj"):  # the rows as the float32 weight has them
            rows = model.qk_row_order().cpu()
            blocks = torch.cat((blocks[rows], blocks[len(rows) :]))
        wrapped_layer = GGUFBlockLinear(
            layer,
            blocks.contiguous(),
            shards[shard_order[0]][1],
            weight.shape[1],
            lib,
            int8_activations,
            isa,
            q8_0_avx512,
        )
        parent_name, _, attr = owner_name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, wrapped_layer)
        wrapped += 1
    logger.info(
        "%d linear layers multiply small batches from GGUF blocks (%s%s)",
        wrapped,
        isa,
        ", int8 activations" if int8_activations else "",
    )
    return wrapped
