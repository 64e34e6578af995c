"""benchmarks/isa_steps.py on a tiny quantized engine: a line per (measurement, gguf_isa) with
its best time and its fused step's parts, and on the others' lines their time over the base's."""

from __future__ import annotations

import re

from benchmarks import isa_steps
from engine.model.fused_decode import PARTS


def test_prints_each_measurement_for_each_isa(quantized_llama, capsys):
    isa_steps.main(
        ["--model", str(quantized_llama), "--threads", "1", "--isas", "auto,avx2"]
        + ["--rows", "2,3", "--prompt-len", "20", "--context", "6", "--rounds", "1"]
    )
    lines = capsys.readouterr().out.splitlines()[1:]
    names = ["prompt of 20", "decode, 2 rows", "decode, 3 rows"]
    assert [line.strip().split("  ")[0] for line in lines] == [n for n in names for _ in "ab"]
    for base, other in zip(lines[::2], lines[1::2], strict=True):
        ms = [float(re.search(r"(auto|avx2)\s+([\d.]+)", line).group(2)) for line in (base, other)]
        assert all(m > 0 for m in ms)
        assert (
            "time " not in base
            and float(re.search(r"time avx2 / auto: ([\d.]+)x", other).group(1)) > 0
        )
        short = [isa_steps.PART_LABELS[part] for part in PARTS]
        assert short[2:4] == ["attention", "o"]  # rope + attention; the product after it
        for line in (base, other):  # every fused part by its short name, in order
            detail = line[line.index("(") + 1 : -1]
            assert [item.rsplit(" ", 1)[0] for item in detail.split(", ")] == short
