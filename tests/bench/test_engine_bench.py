"""benchmarks.engine --ceiling-only on a tiny checkpoint: a round times the throughput run and
its matrix products alone and reports their ratio (wall or CPU clock)."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from benchmarks import engine as bench
from engine import LLM


@pytest.fixture(autouse=True)
def no_tokenizer(monkeypatch):
    """The tiny checkpoint has no tokenizer; the benchmark sends token ids only. --threads
    sets torch's thread count for the process: restored after each test."""
    monkeypatch.setattr(bench, "LLM", functools.partial(LLM, skip_tokenizer_init=True))
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("clock_args", [[], ["--cpu-clock", "--threads", "1"]])
def test_ceiling_only_reports_each_round(tiny_llama, tmp_path, capsys, clock_args, monkeypatch):
    out = tmp_path / "figures.json"
    args = ["--model", tiny_llama, "--ceiling-only", "--rounds", "2", "--num-requests", "3"]
    args += ["--prompt-len", "8", "--new-tokens", "4", "--json", str(out), *clock_args]
    monkeypatch.setattr(bench, "clock", bench.clock)  # --cpu-clock swaps the module's clock
    assert bench.main(args) == 0
    rounds = json.loads(out.read_text())["baton"]["ceiling_rounds"]
    assert len(rounds) == 2
    for r in rounds:
        assert r["run_s"] > 0 and r["gemm_floor_s"] > 0
        assert r["ceiling_ratio"] == pytest.approx(r["gemm_floor_s"] / r["run_s"])
    assert capsys.readouterr().out.count("of the ceiling") == 2


def test_cpu_clock_needs_one_thread(tiny_llama):
    with pytest.raises(SystemExit):
        bench.main(["--model", tiny_llama, "--ceiling-only", "--cpu-clock", "--threads", "2"])
