"""Paged attention in Triton: a cache-write kernel and one unified prefill/decode kernel.

`reshape_and_cache` scatters this step's keys and values into the paged cache.
`unified_attention` then runs causal attention for every query token of the step in a single
launch: prefill chunks (with or without cached context) and decode tokens alike, reading K/V
through the block tables, with an online (flash-attention style) softmax in fp32.

Work decomposition of the attention kernel: a program owns one (query tile, kv head) pair.
A query tile is up to BLOCK_Q consecutive query tokens of ONE sequence, times the GROUP query
heads that share the kv head (GQA), flattened into BLOCK_M = BLOCK_Q * GROUP_P2 rows, so a
decode token still fills GROUP rows of the tile and K/V are read once per group.
Sequence s owns tile ids [tile_start(s), tile_start(s + 1)) with
tile_start(s) = query_start_loc[s] // BLOCK_Q + s, which is strictly increasing and leaves
room for cdiv(query_len, BLOCK_Q) tiles; a program finds its sequence by binary search, and
the grid (T // BLOCK_Q + S, num_kv_heads) needs only host-side sizes (no device sync).

On a machine without a GPU the kernels run on CPU tensors under the Triton interpreter, which
must be enabled (TRITON_INTERPRET=1) before triton is first imported.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - exercised only without triton installed
    raise ImportError(
        "the triton attention backend needs triton: pip install 'baton[triton]'"
    ) from exc

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata

_LOG2E = tl.constexpr(1.4426950408889634)  # softmax runs in base 2: exp(x) == exp2(x * log2 e)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,  # [T, KVH, D] this step's keys / values (any strides)
    key_cache_ptr,
    value_cache_ptr,  # [num_blocks, block_size, KVH, D] each, same strides
    slot_mapping_ptr,  # [T] int64 cache slot per token; < 0 means "do not write"
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    num_kv_heads,
    head_dim,
    block_size,
    BLOCK_H: tl.constexpr,  # power of two >= num_kv_heads
    BLOCK_D: tl.constexpr,  # power of two >= head_dim
):
    # One program per token: copies its [KVH, D] key and value rows into one cache slot.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return  # padding token
    block = slot // block_size
    offset = slot % block_size
    # int64: with the head-major cache, head * stride_ch can pass 2**31 on large caches
    heads = tl.arange(0, BLOCK_H)[:, None].to(tl.int64)  # [BLOCK_H, 1]
    dims = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    mask = (heads < num_kv_heads) & (dims < head_dim)

    key = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims * stride_kd, mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims * stride_vd, mask=mask)
    dst = block * stride_cb + offset * stride_cs + heads * stride_ch + dims * stride_cd
    tl.store(key_cache_ptr + dst, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dst, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


# num_seqs changes every step: without this Triton would compile a variant for num_seqs == 1
# and for multiples of 16 (its integer specialization) while serving.
@triton.jit(do_not_specialize=["num_seqs"])
def _unified_attention_kernel(
    q_ptr,  # [T, H, D]
    key_cache_ptr,
    value_cache_ptr,  # [num_blocks, block_size, KVH, D] each, same strides
    out_ptr,  # [T, H, D]
    block_tables_ptr,  # [S, max_blocks] int32
    seq_lens_ptr,  # [S] int32: context length after this step (cached + new)
    query_start_loc_ptr,  # [S + 1] int32
    scale,  # fp32 softmax scale
    num_seqs,
    num_queries_per_kv,
    head_dim,
    block_size,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    stride_bt,
    BLOCK_Q: tl.constexpr,  # query tokens per tile (power of two)
    GROUP_P2: tl.constexpr,  # power of two >= num_queries_per_kv
    BLOCK_N: tl.constexpr,  # keys per inner-loop step
    BLOCK_D: tl.constexpr,  # power of two >= head_dim
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no tf32), else the default
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P2
    tile = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)  # kv_head * stride_ch can pass 2**31

    # Binary search for the last sequence s with tile_start(s) <= tile (tile_start(0) == 0).
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        ok = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    seq = lo

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_tile = tile - (q_start // BLOCK_Q + seq)  # tile index within the sequence
    if q_tile * BLOCK_Q >= q_len:
        return  # spare tile id: this sequence needs fewer tiles than its id range holds
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # keys cached before this step

    # Row r of the tile is query token q_tile * BLOCK_Q + r // GROUP_P2, head slot r % GROUP_P2.
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // GROUP_P2  # [BLOCK_M] query index within the sequence
    group = rows % GROUP_P2
    head = kv_head * num_queries_per_kv + group
    row_valid = (q_idx < q_len) & (group < num_queries_per_kv)
    q_pos = ctx_len + q_idx  # [BLOCK_M] absolute position; the row attends keys 0 ..= q_pos
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < head_dim

    q_rows = (q_start + q_idx).to(tl.int64)
    q_offs = q_rows[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd
    io_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(q_ptr + q_offs, mask=io_mask, other=0.0)  # [BLOCK_M, BLOCK_D]

    # Invariant that keeps the softmax NaN-free: every row sees key 0 in the first step (valid
    # rows have q_pos >= 0; padded rows have q_pos >= seq_len or copy a valid row's q_pos), so
    # m_i is finite after it and fully masked later steps contribute exp2(-inf) == 0.
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of scaled logits
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(logit - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # running sum of p @ V
    qk_scale = scale * _LOG2E  # exp(x * scale) == exp2(x * qk_scale)

    # Keys needed by the tile: positions 0 .. (position of its last query token).
    kv_end = ctx_len + tl.minimum(q_len, (q_tile + 1) * BLOCK_Q)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for n_start in range(0, kv_end, BLOCK_N):
        pos = n_start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        pos_valid = pos < kv_end
        block = tl.load(table_row + pos // block_size, mask=pos_valid, other=0).to(tl.int64)
        kv_offs = block * stride_cb + (pos % block_size) * stride_cs + kv_head * stride_ch
        k = tl.load(
            key_cache_ptr + kv_offs[None, :] + dims[:, None] * stride_cd,
            mask=pos_valid[None, :] & dim_valid[:, None],
            other=0.0,
        )  # [BLOCK_D, BLOCK_N]
        v = tl.load(
            value_cache_ptr + kv_offs[:, None] + dims[None, :] * stride_cd,
            mask=pos_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]

        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N] fp32
        attend = (pos[None, :] <= q_pos[:, None]) & pos_valid[None, :]
        s = tl.where(attend, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)  # rescales the old partial sums to the new max
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    o_offs = q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=io_mask)


def _pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, triton.next_power_of_2(n))


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [T, KVH, D] into caches [num_blocks, block_size, KVH, D] at slot_mapping."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key_cache.stride() == value_cache.stride(), "key and value caches must share layout"
    assert slot_mapping.shape[0] == num_tokens
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *key_cache.stride(),
        num_kv_heads,
        head_dim,
        key_cache.shape[1],
        BLOCK_H=_pow2(num_kv_heads),
        BLOCK_D=_pow2(head_dim),
    )


def unified_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    block_m: int = 64,
    block_n: int = 64,
) -> None:
    """Causal paged attention of q [T, H, D] over the caches into out [T, H, D], one launch.

    block_m bounds the tile rows (query tokens x GQA group) of prefill steps; decode-only steps
    use the minimum, 16 rows (one group if that is larger). block_n: keys per inner-loop step.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    if num_tokens == 0:
        return
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of kv heads"
    assert key_cache.stride() == value_cache.stride(), "key and value caches must share layout"
    group = num_heads // num_kv_heads
    group_p2 = _pow2(group)
    # Tile rows (block_q tokens x group_p2 heads) are >= 16, the tl.dot minimum: up to block_m
    # for prefill steps (fewer when every query is short), 16 for decode-only steps.
    rows = 16 if meta.max_query_len <= 1 else max(16, block_m)
    block_q = max(1, min(rows // group_p2, _pow2(meta.max_query_len)))
    block_q = max(block_q, 16 // group_p2)
    num_tiles = num_tokens // block_q + meta.num_seqs  # == tile_start(S), see module docstring
    dot_precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _unified_attention_kernel[(num_tiles, num_kv_heads)](
        q,
        key_cache,
        value_cache,
        out,
        meta.block_tables,
        meta.seq_lens_tensor,
        meta.query_start_loc,
        float(scale),
        meta.num_seqs,
        group,
        head_dim,
        key_cache.shape[1],
        *q.stride(),
        *out.stride(),
        *key_cache.stride(),
        meta.block_tables.stride(0),
        BLOCK_Q=block_q,
        GROUP_P2=group_p2,
        BLOCK_N=_pow2(block_n, 16),
        BLOCK_D=_pow2(head_dim, 16),
        DOT_PRECISION=dot_precision,
    )


class TritonAttentionBackend(AttentionBackend):
    """Paged attention with Triton kernels: cache write, then one unified prefill/decode launch."""

    name = "triton"

    def __init__(self, block_m: int = 64, block_n: int = 64) -> None:
        self.block_m = block_m  # max tile rows (query tokens x GQA group) for prefill steps
        self.block_n = block_n  # keys per inner-loop step

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Write k, v into kv_cache at meta.slot_mapping, then return attention [T, H, D]."""
        key_cache, value_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, KVH, D]
        reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        unified_attention(
            q, key_cache, value_cache, out, meta, scale, block_m=self.block_m, block_n=self.block_n
        )
        return out
