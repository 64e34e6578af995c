"""benchmarks/attention_paths.py on tiny counts: one line per (keys, query vectors), each
path's time and their ratio, from passes the kernel accepted."""

import pytest

from benchmarks import attention_paths
from engine.attention.cpu_backend import load_kernel

lib = load_kernel()
pytestmark = pytest.mark.skipif(
    lib is None or not lib.baton_paged_decode_has_avx512(), reason="needs the kernel and AVX-512"
)


def test_prints_both_paths_and_their_ratio(capsys):
    attention_paths.main(["--vectors", "3,33", "--keys", "40,128", "--calls", "3", "--rounds", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["keys", "vectors", "tiles", "us", "lanes", "us", "lanes/tiles"]
    rows = [line.split() for line in lines[1:]]
    assert [(r[0], r[1]) for r in rows] == [("40", "3"), ("40", "33"), ("128", "3"), ("128", "33")]
    for _, _, tiles_us, lanes_us, ratio in rows:
        tiles, lanes = float(tiles_us), float(lanes_us)  # printed to 0.1 us
        assert tiles > 0 and lanes > 0
        low, high = (lanes - 0.05) / (tiles + 0.05), (lanes + 0.05) / max(tiles - 0.05, 1e-9)
        assert low - 0.005 <= float(ratio.rstrip("x")) <= high + 0.005


def test_a_shape_the_kernel_refuses_is_an_error():
    with pytest.raises(RuntimeError, match="refused"):
        attention_paths.timed_pass(lib, attention_paths.LANES, 65, 40, calls=1, rounds=1)
