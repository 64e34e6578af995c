"""benchmarks/product_paths.py on tiny counts: a line per (product, rows) with each path's
GFLOP/s and lanes / panels from the same timings."""

import pytest

from benchmarks import product_paths
from engine.model.gguf_kernel import load_kernel

lib = load_kernel()
pytestmark = pytest.mark.skipif(
    lib is None or not lib.baton_cpu_has_avx512(), reason="needs the kernels and AVX-512"
)


def test_prints_every_path_for_every_shape_and_row_count(capsys):
    product_paths.main(["--rows", "9,33", "--rounds", "1", "--threads", "1"])
    lines = capsys.readouterr().out.splitlines()
    amx = ["amx", "amx/lanes"] if lib.baton_cpu_has_amx() else []
    head = ["product", "rows", "panels", "lanes", "torch", "lanes/panels"]
    assert lines[1].split() == head + amx
    rows = [line.split()[:6] for line in lines[2:]]
    if amx:  # the AMX rate, and amx / lanes within the rounding of the printed rates
        for line in lines[2:]:
            fields = line.split()
            lanes, amx_rate, amx_ratio = float(fields[3]), float(fields[6]), float(fields[7][:-1])
            assert amx_rate > 0
            low, high = (amx_rate - 0.5) / (lanes + 0.5), (amx_rate + 0.5) / (lanes - 0.5)
            assert low - 0.005 <= amx_ratio <= high + 0.005
    assert [(r[0], r[1]) for r in rows] == [
        (name, rows) for name, _, _ in product_paths.SHAPES for rows in ("9", "33")
    ]
    for _, _, panels, lanes, torch_rate, ratio in rows:
        assert float(panels) > 0 and float(lanes) > 0 and float(torch_rate) > 0
        # the ratio is of the unrounded rates: within the rounding of the printed ones
        low = (float(lanes) - 0.5) / (float(panels) + 0.5)
        high = (float(lanes) + 0.5) / (float(panels) - 0.5)
        assert low - 0.005 <= float(ratio.rstrip("x")) <= high + 0.005
