"""The fused batch-1 decode step (decode_step.c): the whole decoder stack for one decode token,
and the logits, in one C call.

The model runner takes it for a step that is exactly one token of one request (batch-1
decode) on a model it can run: CPU float32, every layer matrix held as GGUF blocks
(GGUFBlockLinear), the cpu attention backend. Anything else (several requests, a prefill
chunk, other devices or dtypes, dense layers) keeps the unfused path. Both compute the same
float32 operations on the same weights (see decode_step.c), so greedy tokens do not change.

    BATON_FUSED_DECODE=0   turns it off (the unfused path for every step), e.g. for A/B runs.

Weight pointers, KV cache pointers and strides are gathered once (FusedDecoder.build); per step
only the token, its block table and the sequence length go to C.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch

from engine.attention.kv_layout import head_major
from engine.model.gguf_kernel import INT8_ISA_IDS, ISA_ENV, _gemv_isa_for, _int8_isa_for
from engine.model.gguf_kernel import load_kernel as load_gguf_kernel
from engine.model.gguf_linear import GGUFBlockLinear
from engine.native import load_kernel_library

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_step.c")
ENV = "BATON_FUSED_DECODE"  # "0" turns the fused step off
BLOCK_TYPES = (3, 8)  # GGML Q4_1, Q8_0: what decode_step.c multiplies
# The parts decode_step.c times (its enum, in order), as profile labels.
PARTS = (
    "norms, residuals, block sums",
    "qkv product",
    "rope + KV write",
    "attention",
    "attention output product",
    "gate/up product + SwiGLU",
    "down product",
    "output projection (logits)",
)


class Matrix(ctypes.Structure):
    """ds_matrix: one weight matrix in GGUF blocks."""

    _fields_ = [
        ("blocks", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("type", ctypes.c_int32),
    ]


class Layer(ctypes.Structure):
    """ds_layer: one decoder layer's matrices, norm weights and KV cache."""

    _fields_ = [
        ("qkv", Matrix),
        ("o", Matrix),
        ("gate_up", Matrix),
        ("down", Matrix),
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("kv_cache", ctypes.c_void_p),
    ]


class Model(ctypes.Structure):
    """ds_model: shapes, cache strides (elements) and pointers of the whole model."""

    _fields_ = [
        *(
            (name, ctypes.c_int64)
            for name in (
                "num_layers",
                "hidden",
                "intermediate",
                "num_heads",
                "num_kv_heads",
                "head_dim",
                "block_size",
                "stride_kv",
                "stride_head",
                "stride_block",
                "stride_token",
                "max_positions",
                "vocab",
            )
        ),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("avx512", ctypes.c_int32),
        ("layers", ctypes.POINTER(Layer)),
        ("final_norm", ctypes.c_void_p),
        ("embed", ctypes.c_void_p),
        ("rope", ctypes.c_void_p),
        ("head", Matrix),
        ("int8_isa", ctypes.c_int32),  # 0, or BATON_I8_* (set per step, as gguf_matmul_int8)
    ]


def load_kernel() -> ctypes.CDLL | None:
    """The compiled step with its signature set, or None where it cannot run here."""
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    return load_kernel_library(
        SOURCE, baton_decode_step=[ctypes.POINTER(Model), i64, ptr, i64, ptr, ptr, ptr]
    )


def enabled() -> bool:
    """False where $BATON_FUSED_DECODE is 0 / false / off."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def _matrix(layer: object) -> Matrix | None:
    """The blocks of a GGUFBlockLinear as a Matrix; None for any other layer or block type."""
    if not isinstance(layer, GGUFBlockLinear) or layer.block_type not in BLOCK_TYPES:
        return None
    bias = layer.bias
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return None
    n, k = layer.weight.shape
    return Matrix(
        layer.blocks.data_ptr(),
        None if bias is None else bias.data_ptr(),
        n,
        k,
        layer.block_type,
    )


class FusedDecoder:
    """One model's fused decode step. Holds references to every tensor whose address the C
    structure keeps (weights, norms, rope table, caches), so none is freed under it."""

    def __init__(
        self, lib: ctypes.CDLL, model: Model, layers: ctypes.Array, keep: list, caches: list
    ) -> None:
        self._lib = lib
        self._model = model
        self._layers = layers  # the Layer array model.layers points into
        self._keep = keep
        self._caches = caches  # the KV cache tensors the pointers are of, per layer
        self.has_head = bool(model.head.blocks)
        self.hidden_size, self.vocab, self.block_size = model.hidden, model.vocab, model.block_size
        self._gguf_lib = load_gguf_kernel()
        self.int8 = False  # the model's products quantize activations to int8 (set by build)
        self.timings: ctypes.Array | None = None  # set by profile(): seconds per part

    @classmethod
    def build(
        cls, model: torch.nn.Module, kv_caches: list[torch.Tensor], backend: object, config
    ) -> FusedDecoder | None:
        """The fused step for this model and cache, or None (and why, logged) where the
        unfused path must run every step."""
        reason = cls._refusal(model, kv_caches, backend, config)
        lib = load_kernel() if reason is None else None
        if reason is None and lib is None:
            reason = "decode_step.c could not be built or loaded here"
        if reason is not None:
            logger.info("fused decode step off: %s", reason)
            return None
        a = model.args
        keep: list = []
        layers = (Layer * a.num_layers)()
        for i, (layer, cache) in enumerate(zip(model.layers, kv_caches, strict=True)):
            storage = head_major(cache)
            keep.append(storage)
            layers[i] = Layer(
                *(_matrix(lin) for lin in layer.linears()),
                layer.input_layernorm.weight.data_ptr(),
                layer.post_attention_layernorm.weight.data_ptr(),
                storage.data_ptr(),
            )
        storage = head_major(kv_caches[0])
        rope = torch.view_as_real(model.rope_tables[0]).contiguous()  # [P, D / 2, 2]
        keep.append(rope)
        head = _matrix(model.lm_head) or Matrix()
        c_model = Model(
            a.num_layers,
            a.hidden_size,
            a.intermediate_size,
            a.num_heads,
            a.num_kv_heads,
            a.head_dim,
            storage.shape[3],
            *storage.stride()[:4],
            rope.shape[0],
            a.vocab_size,
            a.rms_norm_eps,
            a.head_dim**-0.5,  # LlamaAttention.scale
            0,  # avx512: set per step, as gguf_matmul chooses
            layers,
            model.norm.weight.data_ptr(),
            model.embed_tokens.weight.data_ptr(),
            rope.data_ptr(),
            head,
        )
        logger.info("batch-1 decode steps run fused in C (%s=0 turns it off)", ENV)
        fused = cls(lib, c_model, layers, keep, list(kv_caches))
        fused.int8 = bool(getattr(config, "int8_activations", False))
        return fused

    @staticmethod
    def _refusal(
        model: torch.nn.Module, kv_caches: list[torch.Tensor], backend: object, config
    ) -> str | None:
        """Why this model cannot run fused (None: it can)."""
        if not enabled():
            return f"${ENV}=0"
        if getattr(backend, "name", None) != "cpu":
            return "the attention backend is not cpu"
        weight = model.embed_tokens.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            return "not CPU float32"
        if len(model.rope_tables) != 1:
            return "no complex float32 rope table"
        a = model.args
        if a.hidden_size % 8 or a.head_dim % 8 or a.num_heads % a.num_kv_heads:
            return "shapes the C step does not take"
        for i, layer in enumerate(model.layers):
            if any(_matrix(lin) is None for lin in layer.linears()):
                return f"layer {i} has a matrix without Q4_1 / Q8_0 blocks"
        int8 = bool(getattr(config, "int8_activations", False))
        matrices = [lin for layer in model.layers for lin in layer.linears()]
        if isinstance(model.lm_head, GGUFBlockLinear):
            matrices.append(model.lm_head)
        if any(getattr(lin, "int8_activations", False) != int8 for lin in matrices):
            return "int8_activations differs between the engine and its layers"
        if any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
            return "a module has forward hooks (the fused step would skip them)"
        for cache in kv_caches:
            if cache.dtype != torch.float32 or cache.device.type != "cpu":
                return "the KV cache is not CPU float32"
            try:
                head_major(cache)
            except ValueError:
                return "the KV cache is not head-major"
        return None

    def serves(self, kv_caches: list[torch.Tensor]) -> bool:
        """Whether this step was built over these very cache tensors."""
        return len(kv_caches) == len(self._caches) and all(
            a is b for a, b in zip(kv_caches, self._caches, strict=True)
        )

    def profile(self, on: bool) -> None:
        """Start (zeroed) or stop accumulating thread 0's seconds per part into .timings."""
        self.timings = (ctypes.c_double * len(PARTS))() if on else None

    def step(
        self, token: int, block_ids: list[int], seq_len: int, logits: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Run the stack for `token` at position seq_len - 1 (its key and value go to that
        position's slot of block_ids). Returns (final hidden [1, E], logits [1, V] or None
        where the model's head is not in blocks or logits is False); None where the C step
        refused (nothing was written: the caller runs the unfused path)."""
        if len(block_ids) * self.block_size < seq_len:
            raise ValueError(f"{len(block_ids)} blocks cannot hold {seq_len} tokens")
        # Q4_1 rows through AVX-512 exactly when the unfused path's gguf_matmul would
        isa = _gemv_isa_for(self._gguf_lib, os.environ.get(ISA_ENV, ""))
        self._model.avx512 = int(isa == "avx512")
        forced = os.environ.get(ISA_ENV, "")
        self._model.int8_isa = (
            INT8_ISA_IDS[_int8_isa_for(self._gguf_lib, forced)] if self.int8 else 0
        )
        table = (ctypes.c_int64 * len(block_ids))(*block_ids)
        hidden = torch.empty(1, self.hidden_size, dtype=torch.float32)
        out = torch.empty(1, self.vocab, dtype=torch.float32) if logits and self.has_head else None
        rc = self._lib.baton_decode_step(
            ctypes.byref(self._model),
            token,
            table,
            seq_len,
            hidden.data_ptr(),
            None if out is None else out.data_ptr(),
            self.timings,
        )
        if rc != 0:
            logger.warning("fused decode step refused (%d); running the unfused path", rc)
            return None
        return hidden, out
