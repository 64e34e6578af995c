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

# Modules that start a local Ray cluster: `pytest -m "not ray"` is the fast inner loop.
RAY_MODULES = (
    "tests/cluster/test_chaos.py",
    "tests/cluster/test_grpc_on_ray.py",
    "tests/cluster/test_http_on_ray.py",
    "tests/cluster/test_controller_restart.py",
    "tests/cluster/test_local_cluster.py",
    "tests/cluster/test_multinode.py",
    "tests/cluster/test_ray_cluster.py",
    "tests/cluster/test_router_restart.py",
    "tests/cluster/test_serve_cli.py",
    "tests/deploy/test_deploy_on_ray.py",
    "tests/deploy/test_replace_at_capacity.py",
    "tests/bench/test_experiments_on_ray.py",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = item.path.as_posix()
        if any(f"/{m}" in path or path.endswith(m) for m in RAY_MODULES):
            item.add_marker(pytest.mark.ray)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    from tests.checkpoints import make_checkpoint

    return str(make_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama"))


@pytest.fixture(scope="session")
def tiny_llama_tok(tmp_path_factory) -> str:
    """tiny_llama's weights with a byte-level BPE tokenizer (structured outputs need one)."""
    from tests.checkpoints import make_checkpoint

    return str(make_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", tokenizer=True))


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> str:
    from tests.checkpoints import make_checkpoint

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
def hf_models():
    """Cache of transformers models by checkpoint dir (fp32, eval)."""
    from transformers import AutoModelForCausalLM

    cache: dict[str, object] = {}

    def get(path: str):
        if path not in cache:
            cache[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return cache[path]

    return get
