"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) over a paged KV cache.

Shapes: T = tokens in the flattened step batch, H = query heads, KVH = key/value heads,
D = head dim, E = hidden size, I = intermediate size, V = vocab.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.model.rms_norm_kernel import add_rms_norm, rms_norm
from engine.model.swiglu_kernel import swiglu


@dataclass(frozen=True, slots=True)
class LlamaArgs:
    """The architecture numbers a Llama-family checkpoint's config.json carries."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, with fp32 statistics like the reference implementations."""

    # Rows at or below this count go through the C kernel (engine/model/rms_norm.c) on CPU
    # float32: at batch 1 it is ~1 ms of a ~13 ms decode step in six torch ops (61 norms).
    NATIVE_MAX_ROWS = 64

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.dtype == torch.float32
            and x.device.type == "cpu"
            and x.dim() == 2
            and x.shape[0] <= self.NATIVE_MAX_ROWS
        ):
            y = rms_norm(x, self.weight, self.eps)
            if y is not None:
                return y
        # Plain ops, HF's formula (in float32, torch 2.13's F.rms_norm gives the same values in
        # the same time on CPU, measured at 1 to 2,048 rows).
        if x.dtype == torch.float32:  # the same ops without the two no-op casts
            inv_rms = torch.mean(x * x, -1, keepdim=True).add_(self.eps).rsqrt_()
            return self.weight * (x * inv_rms)
        xf = x.float()
        inv_rms = torch.mean(xf * xf, -1, keepdim=True).add_(self.eps).rsqrt_()
        return self.weight * (xf * inv_rms).to(x.dtype)

    def add_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(s, norm(s)) with s = x + delta (delta None: s = x). On CPU float32 the add and the
        norm are one C pass (rms_norm.c), any row count: a 2,048-token prefill step's 60 adds
        and 61 norms in torch were ~4% of its time (2.6 vs 0.9 ms each, 1 thread)."""
        if delta is None:
            return x, self(x)
        if x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2:
            fused = add_rms_norm(x, delta, self.weight, self.eps)
            if fused is not None:
                return fused
        s = x + delta
        return s, self(s)


def interleaved_rope_order(num_heads: int, head_dim: int) -> torch.Tensor:
    """Row order turning each head of a q or k projection from the rotate-half layout of HF
    checkpoints, [x0 .. x(D/2-1), y0 .. y(D/2-1)], into rotation pairs [x0, y0, x1, y1, ...]
    (what llama.cpp stores). RoPE is then one complex multiply per pair, ~40x faster on CPU
    than rotate-half's cat and broadcasts. q and k get the same order, so q . k is unchanged;
    v and the output projection keep theirs. Returns [num_heads * head_dim] row indices."""
    half = head_dim // 2
    within = torch.stack((torch.arange(half), torch.arange(half) + half), dim=1).reshape(-1)
    return (torch.arange(num_heads)[:, None] * head_dim + within).reshape(-1)


def apply_rope(x: torch.Tensor, rope: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """RoPE on rotation pairs. x: [T, heads, D] (pairs layout); rope: (cis,) with cis complex
    [T, 1, D / 2] for float32, else (cos, sin) [T, 1, D / 2] in x's dtype."""
    t, heads, d = x.shape
    pairs = x.reshape(t, heads, d // 2, 2)
    if len(rope) == 1:
        return torch.view_as_real(torch.view_as_complex(pairs) * rope[0]).view(t, heads, d)
    cos, sin = rope
    xs, ys = pairs.unbind(-1)
    return torch.stack((xs * cos - ys * sin, ys * cos + xs * sin), dim=-1).view(t, heads, d)


class LlamaAttention(nn.Module):
    """Fused QKV projection, RoPE, paged attention through the backend, output projection."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            args.num_heads,
            args.num_kv_heads,
            args.head_dim,
        )
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        self.scale = args.head_dim**-0.5
        self.qkv_proj = nn.Linear(
            args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, args.hidden_size, bias=args.o_bias)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, ...],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[T, E] -> [T, E], or [len(rows), E] for just those rows."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2 KVH) D], q and k rows in rotation-pair order
        qk = apply_rope(
            qkv[:, : self.q_size + self.kv_size].view(
                t, self.num_heads + self.num_kv_heads, self.head_dim
            ),
            rope,
        )  # [T, H + KVH, D]
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        out = backend.forward(q, k, v, kv_cache, meta, self.scale).view(t, self.q_size)
        if rows is not None:  # only these rows' outputs are wanted (keys and values are all kept)
            out = out.index_select(0, rows)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused in one matmul."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.intermediate_size = args.intermediate_size
        self.gate_up_proj = nn.Linear(
            args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias
        )
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 I]
        if gate_up.dtype == torch.float32 and gate_up.device.type == "cpu":
            act = swiglu(gate_up)  # one C pass into a contiguous [T, I]
            if act is not None:
                return self.down_proj(act)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        # In place on the projection's output (views with row stride 2 I): no [T, I] temporaries
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention block followed by a pre-norm MLP block, both residual."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = LlamaAttention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = LlamaMLP(args)

    def linears(self) -> tuple[nn.Module, ...]:
        """The layer's four projections in the order a token meets them: qkv, o, gate_up,
        down."""
        attn, mlp = self.self_attn, self.mlp
        return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, ...],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[T, E] -> [T, E]; with rows, [len(rows), E]: every token's keys and values are
        still computed and cached, the attention output and MLP only for those rows."""
        x, mlp = self.forward_pending(x, None, rope, kv_cache, meta, backend, rows)
        return x + mlp

    def forward_pending(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        rope: tuple[torch.Tensor, ...],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward on the hidden state x + delta (delta None: x), returning its output as a
        pair (x', delta') whose sum is it: the residual adds are left to the next norm, which
        does add and norm in one pass."""
        x, h = self.input_layernorm.add_norm(x, delta)
        attn = self.self_attn(h, rope, kv_cache, meta, backend, rows)
        if rows is not None:
            x = x.index_select(0, rows)
        x, h = self.post_attention_layernorm.add_norm(x, attn)
        return x, self.mlp(h)


class LlamaForCausalLM(nn.Module):
    """Token ids + positions in, hidden states out; logits only for the rows asked for."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        # nn.Linear, or PackedLinear / GGUFBlockLinear once packed; None: tied to embed_tokens
        self.lm_head: nn.Module | None = (
            None
            if args.tie_word_embeddings
            else nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        )
        # RoPE tables [max_positions, D / 2]: (cis,) complex for float32, else (cos, sin); set
        # by set_rope() after weights are materialized.
        self.rope_tables: tuple[torch.Tensor, ...] = ()

    def decoder_layers(self) -> Sequence[LlamaDecoderLayer]:
        """self.layers, typed (nn.ModuleList's items are plain nn.Modules to a type checker)."""
        return cast("Sequence[LlamaDecoderLayer]", self.layers)

    def set_rope(self, inv_freq: torch.Tensor, max_positions: int, scaling: float = 1.0) -> None:
        """Precompute the rotations for positions [0, max_positions). inv_freq: [D / 2]."""
        device = self.embed_tokens.weight.device
        pos = torch.arange(max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(pos, inv_freq.float().to(device))
        dtype = self.embed_tokens.weight.dtype
        if dtype == torch.float32:
            self.rope_tables = (torch.polar(torch.full_like(freqs, scaling), freqs),)
        else:
            self.rope_tables = (
                (freqs.cos() * scaling).to(dtype),
                (freqs.sin() * scaling).to(dtype),
            )

    def interleave_rope_rows(self) -> None:
        """Put every layer's q and k projection rows (weights and biases) in rotation-pair
        order (see interleaved_rope_order); call once, after loading HF-layout weights."""
        order = self.qk_row_order()
        for layer in self.decoder_layers():
            proj = layer.self_attn.qkv_proj
            for param in (proj.weight, proj.bias):
                if param is not None:
                    param.data[: len(order)] = param.data[order]

    def qk_row_order(self) -> torch.Tensor:
        """New row order of the q and k rows of a fused qkv projection ([q rows, k rows])."""
        a = self.args
        q = interleaved_rope_order(a.num_heads, a.head_dim)
        k = interleaved_rope_order(a.num_kv_heads, a.head_dim) + a.num_heads * a.head_dim
        return torch.cat((q, k)).to(self.embed_tokens.weight.device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, E], or [len(rows), E] of just
        the rows asked for (those that sample): the last layer then skips the output
        projection and MLP of the others, which no later layer reads."""
        backend.begin_step(meta)
        rope = tuple(t.index_select(0, positions).unsqueeze(1) for t in self.rope_tables)
        x, delta = self.embed_tokens(input_ids), None  # the hidden state is x + delta
        layers = self.decoder_layers()
        last = len(layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches, strict=True)):
            x, delta = layer.forward_pending(
                x, delta, rope, kv_cache, meta, backend, rows if i == last else None
            )
        return self.norm.add_norm(x, delta)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, E] -> logits [N, V] in fp32."""
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        return F.linear(hidden, self.embed_tokens.weight).float()

    def pack_for_cpu(self) -> None:
        """Give every projection (and a tied lm_head) oneDNN-prepacked weights."""
        from engine.model.cpu_linear import PackedLinear, onednn_available, pack_linears

        if not onednn_available(self.embed_tokens.weight):
            return
        pack_linears(self.layers)
        head = self.lm_head
        if head is None:
            self.lm_head = PackedLinear(self.embed_tokens.weight, None)
        elif isinstance(head, nn.Linear):  # (a head packed before stays as it is)
            self.lm_head = PackedLinear.from_linear(head)
