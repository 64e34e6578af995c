"""benchmarks/shared_prefix_attention.py on tiny shapes: the three ways of reading a shared
prompt head (grouped, one call per row, copied blocks) use the tables they claim and agree."""

from __future__ import annotations

import pytest

from benchmarks.shared_prefix_attention import BLOCK, one_case, parse_args, tables_for
from engine.attention.cpu_backend import load_kernel


def test_shared_tables_name_the_heads_blocks_once_and_copied_tables_their_own():
    shared, used_shared = tables_for(3, 2 * BLOCK, 5, shared=True)
    copied, used_copied = tables_for(3, 2 * BLOCK, 5, shared=False)
    # 2 head blocks + 1 block of own tokens a row
    assert shared.tolist() == [[0, 1, 2], [0, 1, 3], [0, 1, 4]] and used_shared == 5
    assert copied.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]] and used_copied == 9


def test_the_three_ways_give_the_same_attention():
    lib = load_kernel()
    if lib is None:
        pytest.skip("the CPU kernel cannot run here (no AVX2/FMA or C compiler)")
    args = parse_args(["--prefix", "40", "--own", "7", "--calls", "2", "--rounds", "1"])
    # one_case compares every way's output with the grouped one's (assert_close)
    result = one_case(lib, 3, args)
    assert result["rows"] == 3
    # 32 shared tokens (the head cut to whole blocks) + 3 x 7 own, K and V, 2 layers
    per_token = 3 * 64 * 8 * 2 / 2**20
    assert result["kv_mib_shared"] == pytest.approx((32 + 3 * 7) * per_token)
    assert result["kv_mib_copied"] == pytest.approx(3 * 39 * per_token)
