"""benchmarks.decode_batch on the tiny GGUF-converted checkpoint: per batch size, the decode
steps of all rows timed on an engine with the fused step and one without, as ratios (the
figures themselves are not checked: no timing in tests)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import decode_batch as bench
from engine.model import fused_decode


@pytest.fixture(autouse=True)
def keep_threads():
    """--threads sets torch's thread count for the process: restored after each test."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.skipif(fused_decode.load_kernel() is None, reason="no fused decode step here")
def test_rows_per_batch_with_the_fused_step_on_and_off(quantized_llama, tmp_path, monkeypatch):
    fused_rows: list[int] = []  # rows of each fused step, of either engine
    engines = []
    timed = bench.decode_step_s

    def spy(llm, prompts, steps, tag):
        runner = llm.engine.runner
        if llm not in engines:
            engines.append(llm)
            if runner.fused is not None:
                rows = runner.fused.step_rows
                monkeypatch.setattr(
                    runner.fused,
                    "step_rows",
                    lambda t, *a, **k: fused_rows.append(len(t)) or rows(t, *a, **k),
                )
        return timed(llm, prompts, steps, tag)

    monkeypatch.setattr(bench, "decode_step_s", spy)
    out = tmp_path / "rows.json"
    args = ["--model", str(quantized_llama), "--batches", "1,3", "--prompt-len", "6"]
    args += ["--steps", "2", "--rounds", "1", "--threads", "1", "--json", str(out)]
    assert bench.main(args) == 0
    assert [llm.engine.runner.fused is not None for llm in engines] == [True, False]
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 3] and all(r["fused_runs"] for r in rows)
    for r in rows:
        assert r["fused_tok_s"] == pytest.approx(1e3 * r["batch"] / r["fused_ms_per_step"])
        assert r["speedup"] == pytest.approx(r["unfused_ms_per_step"] / r["fused_ms_per_step"])
    # warm-up (2 rows, 2 steps), then per batch its 2 decode steps of all rows
    assert fused_rows == [2, 2, 1, 1, 3, 3]
