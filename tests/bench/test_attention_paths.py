"""benchmarks/attention_paths.py on tiny counts: one line per (keys, query vectors), each
path's time and their ratio, from passes the kernel accepted."""

import pytest

from benchmarks import attention_paths
from engine.attention.cpu_backend import load_kernel

lib = load_kernel()
pytestmark = pytest.mark.skipif(
    lib is None or not lib.baton_paged_decode_has_avx512(), reason="needs the kernel and AVX-512"
)


def ratio_fits(a_us: str, b_us: str, ratio: str) -> bool:
    """Whether ratio (printed to 0.01x) is a / b for times printed to 0.1 us."""
    a, b = float(a_us), float(b_us)
    low, high = (a - 0.05) / (b + 0.05), (a + 0.05) / max(b - 0.05, 1e-9)
    return a > 0 and b > 0 and low - 0.005 <= float(ratio.rstrip("x")) <= high + 0.005


def test_prints_each_path_and_their_ratios(capsys):
    argv = ["--vectors", "3,33", "--keys", "40,128,200", "--calls", "3", "--rounds", "1"]
    attention_paths.main(argv)
    lines = capsys.readouterr().out.splitlines()
    amx = attention_paths.amx_library() is not None
    header = ["keys", "vectors", "tiles", "us", "lanes", "us", "lanes/tiles"]
    assert lines[0].split() == header + (["amx", "us", "amx/tiles"] if amx else [])
    rows = [line.split() for line in lines[1:]]
    shapes = [(k, v) for k in ("40", "128", "200") for v in ("3", "33")]
    assert [(r[0], r[1]) for r in rows] == shapes
    for row in rows:
        assert ratio_fits(row[3], row[2], row[4])
        if not amx:
            assert len(row) == 5
        elif int(row[0]) <= attention_paths.WINDOW:
            assert ratio_fits(row[5], row[2], row[6])
        else:  # past one window: the AMX kernel does not take it
            assert row[5:] == ["-", "-"]


def test_a_shape_the_kernel_refuses_is_an_error():
    with pytest.raises(RuntimeError, match="refused"):
        attention_paths.timed_pass(lib, attention_paths.LANES, 65, 40, calls=1, rounds=1)
