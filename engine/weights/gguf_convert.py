"""Convert a llama.cpp GGUF checkpoint (llama architecture) into a Hugging Face model directory.

The output directory holds config.json, generation_config.json, model.safetensors (float32,
dequantized), gguf_blocks.safetensors (the raw Q4_1 / Q8_0 blocks of the same matrices, for
the CPU engine's block matmul) and, when the GGUF carries a tokenizer, the files transformers'
own GGUF tokenizer conversion writes (tokenizer.json, tokenizer_config.json,
chat_template.jinja).
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

SUPPORTED_GGUF_ARCHITECTURES = ("llama",)


class UnsupportedGGUFError(ValueError):
    """The GGUF file uses an architecture or feature this converter does not handle."""


# llama.cpp per-layer tensor name (without "blk.N." and ".weight/.bias") -> HF module name.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def _f32(value: float) -> float:
    """Shortest decimal that rounds to the same float32 (GGUF stores 1e-5 as 9.99999974e-06)."""
    return float(str(np.float32(value)))


def _field(reader: Any, key: str, default: Any = None) -> Any:
    """Decoded value of a GGUF metadata key (scalars as Python values), or default."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def hf_tensor_name(gguf_name: str) -> str:
    """HF Llama parameter name for a llama.cpp tensor name; raises for unknown tensors."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name == "rope_freqs.weight":
        # llama.cpp stores Llama-3.x rope scaling as precomputed per-frequency factors; the
        # HF rope_parameters they came from cannot be recovered reliably.
        raise UnsupportedGGUFError(
            "GGUF has rope_freqs.weight (Llama-3 style rope scaling), "
            "which this converter does not support"
        )
    m = _LAYER_TENSOR.match(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise UnsupportedGGUFError(f"unexpected tensor {gguf_name!r} in a llama GGUF")
    layer, kind, suffix = m.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (its convert_hf_to_gguf `permute`) for n_heads.

    llama.cpp reorders each head's rows from HF's rotate-half layout [x0..x(d/2-1), y0..]
    to the interleaved pairs layout [x0, y0, x1, y1, ...] its rope kernel expects:
    hf.reshape(h, 2, d/2, ...).swapaxes(1, 2). This is the inverse. Works for weights [out, in]
    and for biases [out].
    """
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise UnsupportedGGUFError(f"{rows} rows do not split into {n_heads} heads of even size")
    half = rows // n_heads // 2
    return np.ascontiguousarray(
        w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def hf_row_order(name: str, rows: np.ndarray, cfg: dict[str, Any]) -> np.ndarray:
    """A tensor's rows (weights, or a row's raw blocks) in HF order: q and k projections are
    un-permuted (see unpermute_rope_rows), everything else is returned as is."""
    if ".self_attn.q_proj." in name:
        return unpermute_rope_rows(rows, cfg["num_attention_heads"])
    if ".self_attn.k_proj." in name:
        return unpermute_rope_rows(rows, cfg["num_key_value_heads"])
    return rows


def llama_config_from_gguf(reader: Any) -> dict[str, Any]:
    """HF LlamaConfig dict (as config.json holds it) built from the GGUF metadata."""
    from transformers import LlamaConfig

    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UnsupportedGGUFError(
            f"GGUF architecture {arch!r} is not supported; supported: "
            f"{list(SUPPORTED_GGUF_ARCHITECTURES)}"
        )

    def need(key: str) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise UnsupportedGGUFError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    rope_dim = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise UnsupportedGGUFError(
            f"partial rotary (rope dim {rope_dim} != head dim "
            f"{head_dim}) is not supported for llama"
        )
    theta = _f32(_field(reader, f"{arch}.rope.freq_base", 10000.0))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        rope = {
            "rope_type": "linear",
            "rope_theta": theta,
            "factor": _f32(need("rope.scaling.factor")),
        }
    elif scaling != "none":
        raise UnsupportedGGUFError(f"rope scaling type {scaling!r} is not supported")

    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise UnsupportedGGUFError("GGUF has neither llama.vocab_size nor a token list")
        vocab = len(tokens.data)
    names = {t.name for t in reader.tensors}
    config = LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_hidden_layers=int(need("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=int(need("context_length")),
        rms_norm_eps=_f32(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_parameters=rope,
        # No output.weight means llama.cpp ties the LM head to the token embedding.
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        mlp_bias="blk.0.ffn_up.bias" in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
        dtype="float32",
    )
    # The diff dict drops generic PretrainedConfig defaults (id2label, return_dict, ...).
    cfg = config.to_diff_dict()
    # Legacy keys (transformers 4.x readers and other tools look for them at top level).
    cfg["rope_theta"] = theta
    cfg["torch_dtype"] = "float32"
    return cfg


def _expected_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor name a float32 HF Llama checkpoint with this config must hold, and shape."""
    e, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, e),
        "model.norm.weight": (e,),
    }
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, e)
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        layer = {
            "input_layernorm.weight": (e,),
            "post_attention_layernorm.weight": (e,),
            "self_attn.q_proj.weight": (q, e),
            "self_attn.k_proj.weight": (kv, e),
            "self_attn.v_proj.weight": (kv, e),
            "self_attn.o_proj.weight": (e, q),
            "mlp.gate_proj.weight": (i, e),
            "mlp.up_proj.weight": (i, e),
            "mlp.down_proj.weight": (e, i),
        }
        if cfg["attention_bias"]:
            layer.update(
                {
                    "self_attn.q_proj.bias": (q,),
                    "self_attn.k_proj.bias": (kv,),
                    "self_attn.v_proj.bias": (kv,),
                    "self_attn.o_proj.bias": (e,),
                }
            )
        if cfg["mlp_bias"]:
            layer.update(
                {"mlp.gate_proj.bias": (i,), "mlp.up_proj.bias": (i,), "mlp.down_proj.bias": (e,)}
            )
        shapes.update({p + k: s for k, s in layer.items()})
    return shapes


def llama_tensors_from_gguf(reader: Any, cfg: dict[str, Any]) -> dict[str, np.ndarray]:
    """All weights dequantized to float32 under HF names, with q/k rows un-permuted."""
    from gguf.quants import dequantize

    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        # dequantize returns [rows, cols] (numpy order, i.e. GGUF's ne reversed) float32.
        w = hf_row_order(name, np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32), cfg)
        # Own the memory (dequantize may hand back a view into the read-only mmap).
        tensors[name] = np.array(w, dtype=np.float32, order="C", copy=True)
    expected = _expected_shapes(cfg)
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise UnsupportedGGUFError(
            f"GGUF tensors do not form a llama checkpoint: missing "
            f"{missing[:6]}, unexpected {extra[:6]}"
        )
    for name, shape in expected.items():
        if tensors[name].shape != shape:
            raise UnsupportedGGUFError(f"{name}: shape {tensors[name].shape} != {shape}")
    return tensors


# Quantized tensors kept as raw GGUF blocks beside the float32 weights: GGML type id -> bytes
# per 32 weights. The CPU engine multiplies small batches straight from them.
KEPT_BLOCK_TYPES = {3: 20, 8: 34}  # Q4_1, Q8_0
BLOCKS_FILE = "gguf_blocks.safetensors"


def llama_blocks_from_gguf(
    reader: Any, cfg: dict[str, Any]
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The raw blocks of every Q4_1 / Q8_0 matrix under HF names, rows in HF order (q/k rows
    un-permuted like the float32 weights: a row's blocks move with it), and their type ids."""
    blocks: dict[str, np.ndarray] = {}
    types: dict[str, str] = {}
    for t in reader.tensors:
        block_bytes = KEPT_BLOCK_TYPES.get(int(t.tensor_type))
        data = np.asarray(t.data)
        if block_bytes is None or data.ndim != 2 or data.shape[1] % block_bytes:
            continue
        name = hf_tensor_name(t.name)
        blocks[name] = np.array(hf_row_order(name, data, cfg), dtype=np.uint8, order="C", copy=True)
        types[name] = str(int(t.tensor_type))
    return blocks, types


def _save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """Let transformers build the tokenizer (and chat template) from the GGUF and save it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
    )
    tokenizer.save_pretrained(str(out_dir))


def convert_gguf_to_hf(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> None:
    """Write a Hugging Face Llama checkpoint directory (float32) converted from a GGUF file."""
    from gguf import GGUFReader
    from safetensors.numpy import save_file
    from transformers import GenerationConfig

    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    reader = GGUFReader(gguf_path)
    cfg = llama_config_from_gguf(reader)
    tensors = llama_tensors_from_gguf(reader, cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    blocks, types = llama_blocks_from_gguf(reader, cfg)
    if blocks:
        save_file(blocks, str(out_dir / BLOCKS_FILE), metadata=types)
    del blocks
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    GenerationConfig(
        bos_token_id=cfg["bos_token_id"],
        eos_token_id=cfg["eos_token_id"],
        pad_token_id=cfg["pad_token_id"],
    ).save_pretrained(str(out_dir))
    has_tokenizer = "tokenizer.ggml.model" in reader.fields
    del reader  # release the mmap before transformers opens the file again
    if has_tokenizer:
        _save_tokenizer(gguf_path, out_dir)
    else:
        logger.warning("%s carries no tokenizer; %s has no tokenizer files", gguf_path, out_dir)
