"""RoPE on rotation pairs (q/k rows reordered at load) equals transformers' rotate-half RoPE."""

from __future__ import annotations

import pytest
import torch

from engine.model.llama import apply_rope, interleaved_rope_order


def test_pair_order_interleaves_each_heads_halves():
    assert interleaved_rope_order(2, 4).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_pairs_rope_equals_rotate_half_after_reordering(dtype, tol):
    # imported here: transformers' modeling code imports triton, which must not happen before
    # test_triton_attention sets TRITON_INTERPRET=1 (collection imports every test module)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    t, heads, d, theta, scaling = 7, 3, 8, 1e4, 0.9
    g = torch.Generator().manual_seed(0)
    x = torch.randn(t, heads, d, generator=g)
    pos = torch.tensor([0, 1, 2, 5, 100, 4095, 33])
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    freqs = torch.outer(pos.float(), inv_freq)  # [T, D / 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    ref, _ = apply_rotary_pos_emb(
        x.transpose(0, 1)[None],
        x.transpose(0, 1)[None],
        emb.cos()[None] * scaling,
        emb.sin()[None] * scaling,
    )
    ref = ref[0].transpose(0, 1)  # [T, heads, D], rotate-half layout

    order = interleaved_rope_order(heads, d).view(heads, d)[0]  # the same within every head
    if dtype == torch.float32:
        rope = (torch.polar(torch.full_like(freqs, scaling), freqs)[:, None],)
    else:
        rope = tuple((f(freqs) * scaling).to(dtype)[:, None] for f in (torch.cos, torch.sin))
    got = apply_rope(x[..., order].to(dtype), rope).float()
    torch.testing.assert_close(got, ref[..., order], rtol=tol, atol=tol)
