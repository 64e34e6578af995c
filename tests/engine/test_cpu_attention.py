"""The CPU backend's C decode kernel equals the torch reference backend on paged caches."""

from __future__ import annotations

import pytest
import torch

from engine.attention import get_attention_backend
from engine.attention.cpu_backend import CpuAttentionBackend, load_kernel
from engine.attention.metadata import build_metadata
from engine.attention.torch_backend import TorchAttentionBackend
from tests.engine.paged_inputs import random_inputs, random_step

CPU = torch.device("cpu")

lib = load_kernel()
pytestmark = pytest.mark.skipif(lib is None, reason="no x86-64 AVX2/FMA/F16C CPU or C compiler")
# Each instruction set this CPU runs (the kernel picks AVX-512 by itself where cpuid has it)
RUNNABLE_ISAS = (
    ["avx2", "avx512"] if lib is not None and lib.baton_paged_decode_has_avx512() else ["avx2"]
)


def step(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = max(64, sum(-(-n // block_size) for n in seq_lens) + 8)
    heads = (num_heads, num_kv_heads, head_dim)
    return random_step(query_lens, seq_lens, *heads, block_size, num_blocks, gen, CPU)


def assert_kernel_equals_torch(q, k, v, cache, meta, scale, isa) -> None:
    """The C kernel's step over a copy of cache equals the torch backend's over another: the
    cache writes exactly, the attention within float32 rounding."""
    ref_cache, cpu_cache = cache.clone(), cache.clone()
    ref = TorchAttentionBackend().forward(q, k, v, ref_cache, meta, scale)
    out = CpuAttentionBackend(lib, isa).forward(q, k, v, cpu_cache, meta, scale)
    assert torch.equal(cpu_cache, ref_cache)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("query_lens", "seq_lens"),
    [
        ([1], [37]),  # one sequence
        ([1, 1, 1, 1], [1, 6, 37, 64]),  # all decode: first token, inside a block, many blocks
        ([7, 1, 20, 1], [7, 9, 29, 50]),  # decodes mixed with a fresh prefill and a chunk
        ([1, 1, 1], [300, 2, 161]),  # long ones: threads' shares cut tasks (merged pieces)
    ],
)
@pytest.mark.parametrize("isa", [None, *RUNNABLE_ISAS])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [
        (9, 3, 64, 8),  # SmolLM2's heads
        (4, 4, 16, 4),  # plain multi-head attention
        (8, 1, 32, 16),  # one KV head for a group of 8
        (2, 1, 96, 8),  # head_dim over 64: the value sums run in two register tiles
        (4, 2, 12, 4),  # head_dim not a multiple of 8: the kernel declines, torch takes over
    ],
)
def test_decode_kernel_equals_torch(
    query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, isa
):
    q, k, v, cache, meta = step(
        query_lens,
        seq_lens,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        seed=len(seq_lens) + head_dim,
    )
    assert_kernel_equals_torch(q, k, v, cache, meta, head_dim**-0.5, isa)


def test_auto_picks_the_cpu_backend_here():
    assert get_attention_backend("auto", torch.device("cpu")).name == "cpu"
    assert get_attention_backend("torch", torch.device("cpu")).name == "torch"


def test_avx512_refused_without_it_or_taken_with_it():
    """The AVX-512 code runs only where cpuid reports AVX-512 F/VL/DQ; elsewhere asking for it
    is an error, never an illegal instruction."""
    q, k, v, cache, meta = step([1, 1], [5, 17], 4, 2, 16, 4, seed=3)
    backend = CpuAttentionBackend(lib, "avx512")
    if lib.baton_paged_decode_has_avx512():
        ref = TorchAttentionBackend().forward(q, k, v, cache.clone(), meta, 0.25)
        torch.testing.assert_close(backend.forward(q, k, v, cache, meta, 0.25), ref)
    else:
        with pytest.raises(RuntimeError, match="AVX-512"):
            backend.forward(q, k, v, cache, meta, 0.25)


def test_fresh_prompts_of_equal_length_batched_equal_one_by_one():
    """Fresh prompts of one length laid end to end run as one SDPA call; each must still attend
    only its own keys, causally (float64 softmax reference, per prompt)."""
    query_lens, seq_lens = [5, 5, 5, 1, 5, 3, 3], [5, 5, 5, 9, 5, 3, 3]
    q, k, v, cache, meta = step(query_lens, seq_lens, 6, 2, 16, 4, seed=11)
    plan = TorchAttentionBackend()._make_plan(meta)
    assert [(p.rows, p.count) for p in plan.prefills] == [
        (slice(0, 15), 3),  # three of length 5
        (slice(16, 21), 1),  # after the decode row: a run of its own
        (slice(21, 27), 2),  # two of length 3
    ]
    out = CpuAttentionBackend(lib).forward(q, k, v, cache, meta, 0.25)
    start = 0
    for q_len in query_lens:
        rows = slice(start, start + q_len)
        start += q_len
        if q_len == 1:
            continue
        qs, ks, vs = (x[rows].double().transpose(0, 1) for x in (q, k, v))  # [heads, n, D]
        ks, vs = ks.repeat_interleave(3, 0), vs.repeat_interleave(3, 0)
        scores = (qs @ ks.transpose(1, 2)) * 0.25
        causal = torch.ones(q_len, q_len, dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        ref = (probs @ vs).transpose(0, 1).float()
        torch.testing.assert_close(out[rows], ref, atol=1e-5, rtol=1e-5)


def shared_prefix_tables(seq_lens, shared_blocks, block_size, num_blocks, gen):
    """Block tables whose sequences start with the blocks of the earliest sequence of their
    prefix group: shared_blocks[b] = (group, how many leading blocks b takes from that group's
    common head); the rest of each table is blocks of its own, all shuffled."""
    perm = iter(torch.randperm(num_blocks, generator=gen).tolist())
    heads: dict[int, list[int]] = {}
    tables = []
    for seq_len, (group, n_shared) in zip(seq_lens, shared_blocks, strict=True):
        n = -(-seq_len // block_size)
        head = heads.setdefault(group, [next(perm) for _ in range(16)])
        tables.append(head[:n_shared] + [next(perm) for _ in range(n - n_shared)])
    return tables


@pytest.mark.parametrize("isa", [None, *RUNNABLE_ISAS])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [
        (9, 3, 64),  # SmolLM2's heads: 21 sequences fit one pass
        (8, 1, 32),  # a group of 8 query heads: 8 sequences a pass, so larger groups split
    ],
)
def test_sequences_sharing_prefix_blocks_equal_torch(num_heads, num_kv_heads, head_dim, isa):
    """Decode rows whose tables share leading blocks (prefix-cache hits on one prompt head)
    read them once for the group: every row must equal the torch reference, whatever it
    shares. Mixed in: a prefill chunk, a row sharing only the first block, rows sharing
    a longer head among themselves, a row of its own, and a row whose every full block is
    shared."""
    block_size = 4
    gen = torch.Generator().manual_seed(5)
    # (group, leading blocks taken from the group's head)
    shared = [(0, 6)] * 12 + [(0, 9), (0, 9), (0, 1), (1, 0), (2, 3), (2, 3), (0, 6)]
    seq_lens = [30 + 3 * i for i in range(12)] + [41, 38, 27, 33, 13, 19, 25]
    query_lens = [1] * len(seq_lens)
    query_lens[3], seq_lens[3] = 5, 34  # a prefill chunk over the shared head
    num_blocks = 512
    tables = shared_prefix_tables(seq_lens, shared, block_size, num_blocks, gen)
    meta = build_metadata(query_lens, seq_lens, tables, block_size, CPU)
    q, k, v, cache = random_inputs(
        sum(query_lens),
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        num_blocks,
        torch.float32,
        gen,
        CPU,
    )
    assert_kernel_equals_torch(q, k, v, cache, meta, head_dim**-0.5, isa)

    # the groups the kernel read once: exact sequences and shared keys
    _, decode_tables, decode_lens = TorchAttentionBackend()._make_plan(meta).decode_tensors()
    rows = [i for i, q_len in enumerate(query_lens) if q_len == 1]  # the decode sequences
    n = len(rows)
    shared_keys, group_of = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
    num_groups = lib.baton_paged_decode_groups(
        decode_tables.data_ptr(),
        decode_tables.shape[1],
        decode_lens.data_ptr(),
        n,
        num_heads // num_kv_heads,
        block_size,
        shared_keys.data_ptr(),
        group_of.data_ptr(),
    )
    groups = {row: g for row, g in zip(rows, group_of.tolist(), strict=True) if g >= 0}
    keys = {row: k for row, k in zip(rows, shared_keys.tolist(), strict=True) if k}
    head_rows = [0, 1, 2, *range(4, 14), 18]  # all share group 0's first 6 blocks
    if num_heads // num_kv_heads == 3:  # 21 rows a pass: one group of 14
        expected = {row: 0 for row in head_rows} | {16: 1, 17: 1}
    else:  # 8 rows a pass: group 0's rows in two groups
        expected = {row: 0 if i < 8 else 1 for i, row in enumerate(head_rows)} | {16: 2, 17: 2}
    assert num_groups == max(expected.values()) + 1
    assert groups == expected  # row 14 shares one block only, row 15 none: by themselves
    assert keys == {row: 24 for row in head_rows} | {16: 12, 17: 12}
