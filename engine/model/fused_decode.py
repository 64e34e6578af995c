"""The fused step (decode_step.c): the whole decoder stack for a step's rows, and their
logits, in one C call. A row is one token: a decode token of its own sequence, or one of a
prompt chunk's tokens (consecutive rows of one sequence); up to MAX_ROWS rows a step.

The model runner takes it for a step of at most MAX_ROWS tokens, each row drawing at most one
sample and no prompt logprobs, on a model it can run: CPU float32, every layer matrix held as
GGUF blocks (GGUFBlockLinear), the cpu attention backend, the engine option fused_decode on
(with int8_activations: decode rows only, prompts stay float32). Anything else (more tokens,
forks, prompt logprobs, other devices or dtypes, dense layers) keeps the unfused path. Both
compute the same float32 operations on the same weights (see decode_step.c), so greedy tokens
do not change; and a row's numbers in the fused step do not depend on the other rows of its
step (see decode_matrix.c's EXACT_MAX_ROWS for the two arithmetics of the products).

Weight pointers, KV cache pointers, strides and the kernels' instruction set (the one the
layers' own kernels use) are gathered once (FusedDecoder.build); per step only the tokens,
block tables and sequence lengths go to C.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.attention.kv_layout import head_major
from engine.model.gguf_kernel import INT8_ISA_IDS, amx_products
from engine.model.gguf_linear import GGUFBlockLinear
from engine.native import load_kernel_library

if TYPE_CHECKING:
    from engine.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_step.c")
BLOCK_TYPES = (3, 8)  # GGML Q4_1, Q8_0: what decode_step.c multiplies
# Most rows (tokens) a step runs fused with: the engine's default chunk (chunk_size 1024), so a
# long prompt is prefilled fused (a 1,000-token step 1.11x, a 512-token one 1.28x the
# per-operation path's speed: python -m benchmarks.fused_prompt_steps, 2026-12-05, Zen 4 VM).
MAX_ROWS = 1024
# The C step keeps attention states (2 + head_dim floats each) for its merge: a prompt chunk's
# rows about one per query head (their windows of keys merged as they run), a decode row one
# per query head and window of 128 keys. A step whose states would take more than this runs
# the per-operation path (SmolLM2: e.g. 1,024 decode rows over ~5,000 keys each).
MAX_STATE_BYTES = 96 << 20
STATES_REFUSED = -3  # baton_decode_rows' answer to such a step
# The parts decode_step.c times (its enum, in order), as profile labels.
PARTS = (
    "norms, residuals, block sums",
    "qkv product",
    "rope + KV write + attention",
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
        ("max_state_bytes", ctypes.c_int64),
    ]


def load_kernel() -> ctypes.CDLL | None:
    """The compiled step with its signature set, or None where it cannot run here."""
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    # model, rows, tokens, tables, table width, lengths, logit rows, their count, only the
    # logit rows' hidden states, hidden, logits, timings
    rows = [ctypes.POINTER(Model), i64, ptr, ptr, i64, ptr, ptr, i64, ctypes.c_int, ptr, ptr, ptr]
    return load_kernel_library(
        SOURCE,
        baton_decode_rows=rows,
        baton_decode_exact_max_rows=[],
        baton_decode_lanes_min_rows=[],
        baton_decode_amx_min_rows=[],
        baton_cpu_has_amx=[],
    )


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


def _block_layers(model: LlamaForCausalLM) -> list[GGUFBlockLinear]:
    """Every layer matrix of the model (all in blocks once _refusal passed), and its output
    projection where that is in blocks."""
    matrices = [
        lin
        for layer in model.decoder_layers()
        for lin in layer.linears()
        if isinstance(lin, GGUFBlockLinear)
    ]
    if isinstance(model.lm_head, GGUFBlockLinear):
        matrices.append(model.lm_head)
    return matrices


def has_amx() -> bool:
    """Whether the fused step can multiply on AMX tiles here (its library built, the CPU and OS
    with AMX): what gguf_isa amx asks for."""
    lib = load_kernel()
    return lib is not None and bool(lib.baton_cpu_has_amx())


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
        self.int8 = bool(model.int8_isa)  # the products quantize activations to int8
        self.timings: ctypes.Array | None = None  # set by profile(): seconds per part

    @classmethod
    def build(
        cls, model: LlamaForCausalLM, kv_caches: list[torch.Tensor], backend: object, config
    ) -> FusedDecoder | None:
        """The fused step for this model and cache, or None (and why, logged) where the
        unfused path must run every step."""
        reason = cls._refusal(model, kv_caches, backend, config)
        lib = load_kernel() if reason is None else None
        if reason is None and lib is None:
            reason = "decode_step.c could not be built or loaded here"
        if reason is not None or lib is None:  # lib is None only with a reason
            logger.info("fused decode step off: %s", reason)
            return None
        a = model.args
        keep: list = []
        layers = (Layer * a.num_layers)()
        for i, (layer, cache) in enumerate(zip(model.decoder_layers(), kv_caches, strict=True)):
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
        # the instruction set of the layers' own kernels (one for all: _refusal), so that each
        # row is computed as a one-row unfused product computes it
        isa = _block_layers(model)[0].isa
        int8 = bool(getattr(config, "int8_activations", False))
        amx = amx_products(lib, getattr(config, "gguf_isa", "auto"))  # products of many rows
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
            0 if int8 or isa != "avx512" else 2 if amx else 1,
            layers,
            model.norm.weight.data_ptr(),
            model.embed_tokens.weight.data_ptr(),
            rope.data_ptr(),
            head,
            INT8_ISA_IDS[isa] if int8 else 0,
            MAX_STATE_BYTES,
        )
        logger.info(
            "decode steps of up to %d rows run fused in C (%s%s; fused_decode=False turns it off)",
            MAX_ROWS,
            isa,
            ", int8 activations"
            if int8
            else f", AMX for {lib.baton_decode_amx_min_rows()} rows or more"
            if amx
            else "",
        )
        return cls(lib, c_model, layers, keep, list(kv_caches))

    @staticmethod
    def _refusal(
        model: LlamaForCausalLM, kv_caches: list[torch.Tensor], backend: object, config
    ) -> str | None:
        """Why this model cannot run fused (None: it can)."""
        if not getattr(config, "fused_decode", True):
            return "the engine option fused_decode is off"
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
        for i, layer in enumerate(model.decoder_layers()):
            if any(_matrix(lin) is None for lin in layer.linears()):
                return f"layer {i} has a matrix without Q4_1 / Q8_0 blocks"
        int8 = bool(getattr(config, "int8_activations", False))
        matrices = _block_layers(model)
        if any(lin.int8_activations != int8 for lin in matrices):
            return "int8_activations differs between the engine and its layers"
        if len({lin.isa for lin in matrices}) != 1:
            return "the layers' kernels use different instruction sets"
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

    @property
    def max_state_bytes(self) -> int:
        """Most bytes of attention states a step keeps (MAX_STATE_BYTES): step_rows answers
        None for a step that would keep more."""
        return int(self._model.max_state_bytes)

    @max_state_bytes.setter
    def max_state_bytes(self, value: int) -> None:
        self._model.max_state_bytes = value

    def profile(self, on: bool) -> None:
        """Start (zeroed) or stop accumulating thread 0's seconds per part into .timings."""
        self.timings = (ctypes.c_double * len(PARTS))() if on else None

    def step(
        self, token: int, block_ids: list[int], seq_len: int, logits: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """One row: `token` at position seq_len - 1 (its key and value go to that position's
        slot of block_ids). Returns (final hidden [1, E], logits [1, V] or None where the
        model's head is not in blocks or logits is False); None where the C step refused
        (nothing was written: the caller runs the unfused path)."""
        return self.step_rows([token], [block_ids], [seq_len], [0] if logits else [])

    def step_rows(
        self,
        tokens: list[int],
        block_tables: list[list[int]],
        seq_lens: list[int],
        logit_rows: list[int],
        rows_per_table: list[int] | None = None,
        all_hidden: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """R rows: tokens[r] at position seq_lens[r] - 1, its key and value to that position's
        slot of its block table. Each table serves one row, or with rows_per_table, table i
        the next rows_per_table[i] rows: one sequence's consecutive tokens (a prompt's chunk,
        seq_lens one after another). Returns (final hidden [R, E], logits
        [len(logit_rows), V] of the rows logit_rows (increasing), or None where the model's
        head is not in blocks or logit_rows is empty); None where the C step refused (nothing
        was written: the caller runs the unfused path), its attention states past
        max_state_bytes too. all_hidden=False (a caller that reads only the logit rows'
        results): where the head is in blocks, the last layer's products after its attention
        run for the logit rows alone, and the other rows of hidden are zeros; the logit rows'
        numbers, logits and the cache are the same either way."""
        rows = len(tokens)
        counts = [1] * len(block_tables) if rows_per_table is None else rows_per_table
        if (
            not rows
            or sum(counts) != rows
            or len(counts) != len(block_tables)
            or len(seq_lens) != rows
        ):
            raise ValueError(
                f"{rows} tokens need as many lengths and rows of block tables "
                f"(got {len(seq_lens)}, {sum(counts)})"
            )
        last = 0
        for blocks, count in zip(block_tables, counts, strict=True):
            last += count
            if len(blocks) * self.block_size < seq_lens[last - 1]:
                raise ValueError(f"{len(blocks)} blocks cannot hold {seq_lens[last - 1]} tokens")
        width = max(len(blocks) for blocks in block_tables)
        padded = [b for blocks in block_tables for b in (*blocks, *[0] * (width - len(blocks)))]
        table = torch.tensor(padded, dtype=torch.int64).view(len(block_tables), width)
        if rows_per_table is not None:  # [R, width]: each row its sequence's table
            table = table.repeat_interleave(torch.tensor(counts), dim=0)
        ints = torch.tensor([*tokens, *seq_lens, *logit_rows], dtype=torch.int64)
        heads = len(logit_rows) if self.has_head else 0
        hidden = torch.empty(rows, self.hidden_size, dtype=torch.float32)
        out = torch.empty(heads, self.vocab, dtype=torch.float32) if heads else None
        rc = self._lib.baton_decode_rows(
            ctypes.byref(self._model),
            rows,
            ints.data_ptr(),
            table.data_ptr(),
            width,
            ints.data_ptr() + 8 * rows,
            ints.data_ptr() + 16 * rows,
            heads,
            int(not all_hidden and self.has_head),
            hidden.data_ptr(),
            None if out is None else out.data_ptr(),
            self.timings,
        )
        if rc == STATES_REFUSED:
            logger.debug("fused step: attention states past max_state_bytes; unfused path")
            return None
        if rc != 0:
            logger.warning("fused decode step refused (%d); running the unfused path", rc)
            return None
        return hidden, out
