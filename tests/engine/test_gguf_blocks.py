"""The GGUF block matmul: exact weights, float32 results, and the engine's greedy tokens with it
equal transformers' on the same converted checkpoint."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file

from engine import LLM, SamplingParams
from engine.model.gguf_kernel import gguf_dequantize, gguf_matmul, load_kernel
from engine.model.gguf_linear import QUANT_MAX_ROWS, GGUFBlockLinear
from engine.weights.gguf_convert import BLOCKS_FILE, convert_gguf_to_hf
from tests.helpers import hf_greedy, llamacpp_permute, random_prompts

Q4_1, Q8_0 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0
LAYERS, E, HEADS, KV_HEADS, FF, VOCAB = 2, 64, 4, 2, 96, 128  # head_dim 16

lib = load_kernel()
pytestmark = pytest.mark.skipif(lib is None, reason="no x86-64 AVX2/FMA/F16C CPU or C compiler")


def quantized(rows: int, cols: int, qtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random weights as GGUF blocks [rows, bytes] and the float32 weights they hold."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    blocks = quantize(w, qtype)
    return torch.from_numpy(blocks), torch.from_numpy(dequantize(blocks, qtype).copy())


@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
def test_dequantize_is_bit_exact_and_matmul_matches_dense(qtype):
    blocks, weight = quantized(37, 96, qtype, seed=1)
    assert torch.equal(gguf_dequantize(lib, blocks, 96, int(qtype)), weight)
    for rows in range(1, 10):  # every remainder of the kernel's 4-row tile
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(
            gguf_matmul(lib, x, blocks, int(qtype)), x @ weight.T, rtol=1e-5, atol=1e-5
        )


def test_layer_uses_blocks_up_to_the_row_limit_then_the_dense_weight():
    blocks, weight = quantized(40, 64, Q4_1, seed=2)
    dense = torch.nn.Linear(64, 40)
    with torch.no_grad():
        dense.weight.copy_(weight)
    layer = GGUFBlockLinear(dense, blocks, int(Q4_1), 64, lib)
    with torch.no_grad():
        dense.weight.zero_()  # from now on only the blocks still hold the weights
        small = torch.randn(QUANT_MAX_ROWS, 64)
        torch.testing.assert_close(layer(small), small @ weight.T + dense.bias)
        big = torch.randn(QUANT_MAX_ROWS + 1, 64)
        torch.testing.assert_close(layer(big), dense.bias.expand(QUANT_MAX_ROWS + 1, 40))


def test_bad_blocks_are_refused():
    blocks, _ = quantized(8, 64, Q4_1, seed=3)
    with pytest.raises(ValueError, match="not a multiple of 32"):
        GGUFBlockLinear(torch.nn.Linear(48, 8), blocks, int(Q4_1), 48, lib)
    with pytest.raises(ValueError, match="blocks must be contiguous uint8"):
        GGUFBlockLinear(torch.nn.Linear(64, 8), blocks, int(Q8_0), 64, lib)
    with pytest.raises(ValueError, match="block type 2 is not supported"):
        GGUFBlockLinear(torch.nn.Linear(64, 8), blocks, 2, 64, lib)


def write_quantized_llama_gguf(
    path: Path, v_type=Q4_1, heads: int = HEADS, kv_heads: int = KV_HEADS, context: int = 256
) -> None:
    """A tiny tied-embedding Llama: Q4_1 layer matrices (attn_v: v_type), a Q8_0 embedding,
    float32 norms; head_dim E / heads; `context` positions."""
    w = gguf.GGUFWriter(path, arch="llama")
    for add, value in (
        (w.add_block_count, LAYERS),
        (w.add_context_length, context),
        (w.add_embedding_length, E),
        (w.add_feed_forward_length, FF),
        (w.add_head_count, heads),
        (w.add_head_count_kv, kv_heads),
        (w.add_rope_dimension_count, E // heads),
        (w.add_rope_freq_base, 1e4),
        (w.add_layer_norm_rms_eps, 1e-5),
        (w.add_vocab_size, VOCAB),
    ):
        add(value)
    rng = np.random.default_rng(7)

    def matrix(rows: int, cols: int, qtype, heads: int | None = None) -> tuple:
        m = (rng.standard_normal((rows, cols)) * 0.2).astype(np.float32)
        if heads:
            m = llamacpp_permute(m, heads)
        if qtype == gguf.GGMLQuantizationType.F32:
            return m, None
        return quantize(m, qtype), qtype

    kv = kv_heads * E // heads
    tensors = {
        "token_embd.weight": matrix(VOCAB, E, Q8_0),
        "output_norm.weight": (np.ones(E, np.float32), None),
    }
    for i in range(LAYERS):
        tensors |= {
            f"blk.{i}.attn_norm.weight": (np.ones(E, np.float32), None),
            f"blk.{i}.ffn_norm.weight": (np.ones(E, np.float32), None),
            f"blk.{i}.attn_q.weight": matrix(E, E, Q4_1, heads),
            f"blk.{i}.attn_k.weight": matrix(kv, E, Q4_1, kv_heads),
            f"blk.{i}.attn_v.weight": matrix(kv, E, v_type),
            f"blk.{i}.attn_output.weight": matrix(E, E, Q4_1),
            f"blk.{i}.ffn_gate.weight": matrix(FF, E, Q4_1),
            f"blk.{i}.ffn_up.weight": matrix(FF, E, Q4_1),
            f"blk.{i}.ffn_down.weight": matrix(E, FF, Q4_1),
        }
    for name, (data, qtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_converted_blocks_hold_exactly_the_float32_weights(quantized_llama):
    dense = load_file(str(quantized_llama / "model.safetensors"))
    from engine.model.gguf_linear import read_blocks

    blocks = read_blocks(quantized_llama / BLOCKS_FILE)
    assert len(blocks) == 1 + 7 * LAYERS  # every quantized matrix, q/k rows un-permuted too
    for name, (raw, block_type) in blocks.items():
        cols = dense[name].shape[1]
        assert torch.equal(gguf_dequantize(lib, raw, cols, block_type), dense[name]), name


def test_engine_greedy_with_blocks_equals_dense_and_transformers(quantized_llama, hf_models):
    prompts = random_prompts([5, 9, 17], seed=31, vocab=VOCAB)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    opts = dict(skip_tokenizer_init=True, block_size=4, num_kv_blocks=64)
    with_blocks = LLM(str(quantized_llama), **opts)
    model = with_blocks.engine.runner.model
    assert isinstance(model.layers[0].mlp.gate_up_proj, GGUFBlockLinear)
    assert isinstance(model.lm_head, GGUFBlockLinear)  # the tied Q8_0 embedding
    dense = LLM(str(quantized_llama), use_gguf_blocks=False, **opts)
    assert not isinstance(dense.engine.runner.model.layers[0].mlp.gate_up_proj, GGUFBlockLinear)
    hf = hf_models(str(quantized_llama))
    for prompt in prompts:  # one at a time: every step has a single row, so blocks are used
        ours = with_blocks.generate([prompt], params)[0].token_ids
        assert ours == dense.generate([prompt], params)[0].token_ids
        assert ours == hf_greedy(hf, prompt, 12)


def test_a_fused_matrix_with_a_float_part_stays_dense(tmp_path, hf_models):
    write_quantized_llama_gguf(tmp_path / "mixed.gguf", v_type=gguf.GGMLQuantizationType.F32)
    convert_gguf_to_hf(tmp_path / "mixed.gguf", tmp_path / "hf")
    llm = LLM(str(tmp_path / "hf"), skip_tokenizer_init=True, block_size=4, num_kv_blocks=64)
    layer = llm.engine.runner.model.layers[0]
    assert not isinstance(layer.self_attn.qkv_proj, GGUFBlockLinear)  # v is float32
    assert isinstance(layer.self_attn.o_proj, GGUFBlockLinear)
    prompt = random_prompts([11], seed=32, vocab=VOCAB)[0]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert llm.generate([prompt], params)[0].token_ids == hf_greedy(
        hf_models(str(tmp_path / "hf")), prompt, 8
    )
