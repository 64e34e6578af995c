"""benchmarks/model_flops.py counts a step's floating-point work as PyTorch's FLOP counter
counts transformers' forward of the same checkpoint; benchmarks/serving_bounds.py runs on a
tiny engine."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM

from benchmarks import serving_bounds
from benchmarks.model_flops import Shape


def counted_flops(model, input_ids, past=None, logits_to_keep=1):
    with FlopCounterMode(display=False) as counter:
        out = model(
            input_ids=input_ids,
            past_key_values=past,
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
    return counter.get_total_flops(), out.past_key_values


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation="eager").eval()
    shape = Shape.of(json.loads((Path(tiny_llama) / "config.json").read_text()))
    return model, shape


def test_a_decode_row_is_what_transformers_computes(hf_model):
    model, shape = hf_model
    prompt = torch.tensor([[5, 9, 3, 7, 11, 2, 4]])
    with torch.no_grad():
        _, past = counted_flops(model, prompt)
        # one new token over the 7 cached: 8 keys, one query row, logits for it
        flops, _ = counted_flops(model, torch.tensor([[6]]), past)
    assert flops == shape.decode_row_flops(8)
    assert flops == shape.row_flops() + shape.head_flops() + shape.attention_flops(8)


def test_prefill_products_and_the_last_rows_logits(hf_model):
    model, shape = hf_model
    with torch.no_grad():
        # 3 rows, no cache: the products of 3 rows and one row of logits, plus attention,
        # over the full 3 x 3 scores (eager attention multiplies them all, then masks)
        flops, _ = counted_flops(model, torch.tensor([[5, 9, 3]]))
    full_square = shape.attention_flops(3) * 3
    assert flops == 3 * shape.row_flops() + shape.head_flops() + full_square
    # Baton's count keeps only the causal half: 1 + 2 + 3 keys
    assert shape.prefill_flops(0, 3) == 3 * shape.row_flops() + shape.head_flops() + (
        shape.attention_flops(1 + 2 + 3)
    )


def test_a_layers_tail_is_what_transformers_computes_past_its_attention(hf_model):
    """The pruned prefill leaves out, for every row but the last, the last layer's output
    projection and MLP: tail_flops, as PyTorch counts them on transformers' modules."""
    model, shape = hf_model
    layer = model.model.layers[-1]
    attn_out = torch.randn(1, 1, shape.heads * shape.head_dim)
    hidden = torch.randn(1, 1, shape.hidden)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        layer.self_attn.o_proj(attn_out)
        layer.mlp(hidden)
    assert counter.get_total_flops() == shape.tail_flops()
    assert shape.prefill_flops(0, 3, pruned=True) == shape.prefill_flops(0, 3) - 2 * (
        shape.tail_flops()
    )


def test_runs_on_a_tiny_engine(tiny_llama, monkeypatch, capsys):
    monkeypatch.setattr(
        sys,
        "argv",
        ["serving_bounds", "--model", tiny_llama, "--threads", "1", "--rounds", "1"],
    )
    monkeypatch.setattr(serving_bounds, "reference_rate", lambda shape, threads: 1e9)
    monkeypatch.setattr(serving_bounds, "peak_rate", lambda threads: 2e9)
    serving_bounds.main()
    out = capsys.readouterr().out
    for workload in ("shared-prefix: 2000 cached + 64 new", "short-prompt: 0 cached + 256 new"):
        assert workload in out
    assert out.count("tokens/s, 4 streams vs 1") == 2
    assert out.count("disaggregated (a prefill and a decode worker of 1 threads each)") == 2
    assert "peak float32 rate (fused multiply-adds only): 2 GFLOP/s" in out


def test_the_peak_rate_is_what_a_core_can_do():
    """One thread's peak float32 rate is at least 8 lanes x 2 FLOP a cycle of a 1 GHz core (any
    x86-64 with AVX2 and FMA) and at most 2 FMA units x 16 lanes x 2 FLOP a cycle at 6 GHz."""
    one = serving_bounds.peak_rate(1, repeats=3)
    if one is None:
        pytest.skip("no C compiler or no AVX2/FMA here")
    assert 16e9 <= one <= 384e9


def test_disaggregated_rounds_are_the_decode_steps_or_the_prefill_workers_load():
    # decode-bound: one stream 0.2 + 63 x 0.02 = 1.46 s a round; four 0.2 + 63 x 0.035 = 2.405
    ratio = serving_bounds.disaggregated_ratio(4, 63, 0.2, 0.02, 0.2, 0.035)
    assert ratio == pytest.approx(4 * 1.46 / 2.405)
    # prefill-bound: four prefills of 1 s (4 s) outlast 1 + 63 x 0.012 = 1.756 s of decoding
    ratio = serving_bounds.disaggregated_ratio(4, 63, 1.0, 0.01, 1.0, 0.012)
    assert ratio == pytest.approx(4 * (1.0 + 0.63) / 4.0)
    # faster prefills on the S streams' side only raise it while the decode steps allow
    slow = serving_bounds.disaggregated_ratio(4, 63, 0.3, 0.02, 0.3, 0.03)
    fast = serving_bounds.disaggregated_ratio(4, 63, 0.3, 0.02, 0.1, 0.03)
    assert fast == pytest.approx(4 * (0.3 + 1.26) / (0.1 + 1.89)) and fast > slow
