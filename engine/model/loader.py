"""Build a Llama-family model on the meta device and load a Hugging Face checkpoint into it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from engine.errors import InvalidRequestError, ModelNotFoundError
from engine.model.gguf_linear import attach_gguf_blocks
from engine.model.llama import LlamaArgs, LlamaForCausalLM
from engine.weights.gguf_convert import BLOCKS_FILE

SUPPORTED_ARCHITECTURES = {"llama", "mistral", "qwen2"}


def read_hf_config(model_dir: Path) -> dict:
    """config.json of a checkpoint directory as a dict."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelNotFoundError(f"{model_dir} has no config.json")
    return json.loads(path.read_text())


def llama_args(cfg: dict) -> LlamaArgs:
    """Architecture numbers from an HF config dict; rejects unsupported model types."""
    model_type = cfg.get("model_type", "llama")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"model_type {model_type!r} is not supported; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    heads = cfg["num_attention_heads"]
    return LlamaArgs(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
        o_bias=model_type != "qwen2" and bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
    )


def rope_inv_freq(model_dir: Path, cfg: dict, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [D / 2] and attention scaling, honouring rope_scaling/parameters."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if rope_type == "default":
        exps = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (theta**exps), 1.0
    # Scaled variants (linear, dynamic, yarn, llama3, longrope): transformers' own tables.
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope type {rope_type!r} is not supported")
    hf_config = AutoConfig.from_pretrained(model_dir)
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq, float(scaling)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# HF name suffix -> (our parameter suffix, shard index within the fused parameter)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def _target(model: LlamaForCausalLM, name: str) -> tuple[str, int | None] | None:
    """Our parameter name and fused shard index for an HF tensor name (None: skip it)."""
    if name.startswith("model.embed_tokens."):
        return name.removeprefix("model."), None
    if name.startswith("model.norm."):
        return name.removeprefix("model."), None
    if name.startswith("lm_head."):
        return (name, None) if model.lm_head is not None else None
    m = _LAYER.match(name)
    if not m:
        return None
    layer, rest = m.groups()
    module, _, kind = rest.rpartition(".")
    if module in _FUSED:
        ours, shard = _FUSED[module]
        return f"layers.{layer}.{ours}.{kind}", shard
    return f"layers.{layer}.{rest}", None


def _shard_rows(model: LlamaForCausalLM, param_name: str, shard: int) -> slice:
    args = model.args
    if "qkv_proj" in param_name:
        q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        return [slice(0, q), slice(q, q + kv), slice(q + kv, q + 2 * kv)][shard]
    i = args.intermediate_size
    return [slice(0, i), slice(i, 2 * i)][shard]


def load_model(
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    use_gguf_blocks: bool = True,
    int8_activations: bool = False,
    gguf_isa: str = "auto",
) -> tuple[LlamaForCausalLM, dict]:
    """Model with weights from model_dir's safetensors, on device, in dtype, in eval mode.
    On CPU in float32, a directory converted from a GGUF also multiplies small batches from
    the GGUF blocks (unless use_gguf_blocks is False) on the instruction set gguf_isa picks,
    with int8 activations if asked (InvalidRequestError where that cannot run: another device
    or dtype, no blocks, no kernel, an instruction set this CPU lacks)."""
    model_dir = Path(model_dir)
    blocks = model_dir / BLOCKS_FILE
    if int8_activations:
        problem = (
            "use_gguf_blocks is off"
            if not use_gguf_blocks
            else f"the device is {device}"
            if device.type != "cpu"
            else f"the dtype is {dtype}"
            if dtype != torch.float32
            else f"{model_dir} was not converted from a GGUF (no {BLOCKS_FILE})"
            if not blocks.is_file()
            else None
        )
        if problem:
            raise InvalidRequestError(
                f"int8_activations needs CPU float32 with GGUF blocks, but {problem}"
            )
    cfg = read_hf_config(model_dir)
    args = llama_args(cfg)
    with torch.device("meta"):
        model = LlamaForCausalLM(args)
    model = model.to_empty(device=device).to(dtype)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    files = sorted(p for p in model_dir.glob("*.safetensors") if p.name != BLOCKS_FILE)
    if not files:
        raise ModelNotFoundError(f"{model_dir} has no *.safetensors weights")
    with torch.no_grad():
        for path in files:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    target = _target(model, name)
                    if target is None:
                        continue
                    ours, shard = target
                    if ours not in params:
                        raise ValueError(f"checkpoint tensor {name} has no place in the model")
                    dest: torch.Tensor = params[ours]
                    if shard is not None:
                        dest = dest[_shard_rows(model, ours, shard)]
                    tensor = f.get_tensor(name)
                    if tensor.shape != dest.shape:
                        raise ValueError(
                            f"{name}: checkpoint shape {tuple(tensor.shape)} != "
                            f"model shape {tuple(dest.shape)}"
                        )
                    dest.copy_(tensor.to(dtype))
                    loaded.add(f"{ours}#{shard}")
    expected = {f"{n}#{s}" for n in params for s in _expected_shards(n)}
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks tensors for: {missing[:8]}")
    inv_freq, scaling = rope_inv_freq(model_dir, cfg, args.head_dim)
    model.set_rope(inv_freq, max_positions, scaling)
    model.interleave_rope_rows()
    if device.type == "cpu":
        model.pack_for_cpu()
        if use_gguf_blocks and dtype == torch.float32 and blocks.is_file():
            wrapped = attach_gguf_blocks(model, blocks, _target, int8_activations, gguf_isa)
            if int8_activations and not wrapped:
                raise InvalidRequestError(
                    "int8_activations: the GGUF block kernels do not run on this machine "
                    "(they need an x86-64 CPU with AVX2/FMA/F16C and a C compiler)"
                )
    return model.eval(), cfg


def _expected_shards(param_name: str) -> list[int | None]:
    if "qkv_proj" in param_name:
        return [0, 1, 2]
    if "gate_up_proj" in param_name:
        return [0, 1]
    return [None]
