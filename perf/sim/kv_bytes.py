"""KV bytes per block from the model's shape: layers x 2 (k, v) x kv_heads x head_dim x dtype
bytes x block_size. The shape comes from the profile JSON's `model_shape` when it has one,
else from this table (by the profile's key.model)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What a token's KV costs: per layer one key and one value of kv_heads x head_dim."""

    layers: int
    kv_heads: int
    head_dim: int


MODEL_SHAPES = {
    "smollm2-135m-instruct": ModelShape(layers=30, kv_heads=3, head_dim=64),
    "tiny": ModelShape(layers=2, kv_heads=2, head_dim=16),  # the test suite's tiny random Llama
}
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1}


def shape_of(profile_json: dict) -> ModelShape:
    """The profile's model shape: its own `model_shape`, else MODEL_SHAPES[key.model]."""
    if "model_shape" in profile_json:
        return ModelShape(**profile_json["model_shape"])
    model = profile_json.get("key", {}).get("model", "")
    if model not in MODEL_SHAPES:
        raise ValueError(
            f"no model shape for {model!r}: add model_shape {{layers, kv_heads, head_dim}} to "
            f"the profile or an entry to perf/sim/kv_bytes.py MODEL_SHAPES "
            f"({', '.join(MODEL_SHAPES)})"
        )
    return MODEL_SHAPES[model]


def block_bytes(shape: ModelShape, dtype: str, block_size: int) -> int:
    """Bytes of one KV block in every layer."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown KV dtype {dtype!r}; one of {', '.join(DTYPE_BYTES)}")
    return shape.layers * 2 * shape.kv_heads * shape.head_dim * DTYPE_BYTES[dtype] * block_size
