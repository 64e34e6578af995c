"""Shared fixtures: tiny random checkpoints, built once per test session."""

from __future__ import annotations

import os
from pathlib import Path

# The suite is the CPU reference (gloo, fp32, the torch attention path; Triton under its
# interpreter): on a machine with a GPU it stays on the CPU unless BATON_TEST_GPU=1, since
# "auto" devices would otherwise pick CUDA + bf16 and two workers would share one GPU.
if os.environ.get("BATON_TEST_GPU") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest  # noqa: E402
import torch  # noqa: E402

# Tests run on 2 shared cores: keep torch to one thread unless told otherwise.
torch.set_num_threads(int(os.environ.get("BATON_TEST_THREADS", "1")))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    from benchmarks.checkpoints import make_checkpoint

    return str(make_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama"))


@pytest.fixture(scope="session")
def tiny_llama_tok(tmp_path_factory) -> str:
    """tiny_llama's weights with a byte-level BPE tokenizer (structured outputs need one)."""
    from benchmarks.checkpoints import make_checkpoint

    return str(make_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", tokenizer=True))


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> str:
    from benchmarks.checkpoints import make_checkpoint

    return str(make_checkpoint(tmp_path_factory.mktemp("ckpt"), "qwen2"))


@pytest.fixture(scope="session")
def quantized_llama(tmp_path_factory) -> Path:
    """A tiny Llama written as a Q4_1/Q8_0 GGUF and converted to HF (blocks kept beside the
    float32 weights), as SmolLM2's GGUF is: the GGUF-block and int8 tests' checkpoint."""
    from engine.weights.gguf_convert import convert_gguf_to_hf
    from tests.engine.test_gguf_blocks import write_quantized_llama_gguf

    root = tmp_path_factory.mktemp("gguf")
    write_quantized_llama_gguf(root / "tiny.gguf")
    convert_gguf_to_hf(root / "tiny.gguf", root / "hf")
    return root / "hf"


@pytest.fixture(scope="session")
def quantized_llama_one_head(tmp_path_factory) -> Path:
    """quantized_llama with one query and one KV head: head_dim 64, the size (a multiple of
    32) whose prompt windows the fused step attends on AMX."""
    from engine.weights.gguf_convert import convert_gguf_to_hf
    from tests.engine.test_gguf_blocks import write_quantized_llama_gguf

    root = tmp_path_factory.mktemp("gguf_one_head")
    write_quantized_llama_gguf(root / "tiny.gguf", heads=1, kv_heads=1)
    convert_gguf_to_hf(root / "tiny.gguf", root / "hf")
    return root / "hf"


@pytest.fixture(scope="session")
def quantized_llama_long(tmp_path_factory) -> Path:
    """quantized_llama with 1,024 positions: prompts whose rows reach five or more of the
    fused step's windows of 128 keys."""
    from engine.weights.gguf_convert import convert_gguf_to_hf
    from tests.engine.test_gguf_blocks import write_quantized_llama_gguf

    root = tmp_path_factory.mktemp("gguf_long")
    write_quantized_llama_gguf(root / "tiny.gguf", context=1024)
    convert_gguf_to_hf(root / "tiny.gguf", root / "hf")
    return root / "hf"


@pytest.fixture(scope="session")
def hf_models():
    """Cache of transformers models by checkpoint dir (fp32, eval)."""
    from transformers import AutoModelForCausalLM

    cache: dict[str, object] = {}

    def get(path: str):
        if path not in cache:
            cache[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return cache[path]

    return get
