"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) over a paged KV cache.

Shapes: T = tokens in the flattened step batch, H = query heads, KVH = key/value heads,
D = head dim, E = hidden size, I = intermediate size, V = vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata


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

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Plain ops: on CPU F.rms_norm is ~20x slower than this at 2,048 rows (torch 2.13).
        if x.dtype == torch.float32:  # the same ops without the two no-op casts
            inv_rms = torch.mean(x * x, -1, keepdim=True).add_(self.eps).rsqrt_()
            return self.weight * (x * inv_rms)
        xf = x.float()
        inv_rms = torch.mean(xf * xf, -1, keepdim=True).add_(self.eps).rsqrt_()
        return self.weight * (xf * inv_rms).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [T, heads, D]; cos, sin: [T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LlamaAttention(nn.Module):
    """Fused QKV projection, RoPE, paged attention through the backend, output projection."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            args.num_heads, args.num_kv_heads, args.head_dim)
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        self.scale = args.head_dim ** -0.5
        self.qkv_proj = nn.Linear(args.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=args.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, args.hidden_size, bias=args.o_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2 KVH) D]
        qk = apply_rope(qkv[:, :self.q_size + self.kv_size].view(
            t, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)  # [T, H + KVH, D]
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        out = backend.forward(q, k, v, kv_cache, meta, self.scale)  # [T, H, D]
        return self.o_proj(out.reshape(t, self.q_size))


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused in one matmul."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.intermediate_size = args.intermediate_size
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size,
                                      bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention block followed by a pre-norm MLP block, both residual."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = LlamaAttention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = LlamaMLP(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Token ids + positions in, hidden states out; logits only for the rows asked for."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = (None if args.tie_word_embeddings
                        else nn.Linear(args.hidden_size, args.vocab_size, bias=False))
        # RoPE tables [max_positions, D]; set by set_rope() after weights are materialized.
        self.rope_cos: torch.Tensor | None = None
        self.rope_sin: torch.Tensor | None = None

    def set_rope(self, inv_freq: torch.Tensor, max_positions: int, scaling: float = 1.0) -> None:
        """Precompute cos/sin for positions [0, max_positions). inv_freq: [D / 2]."""
        device = self.embed_tokens.weight.device
        pos = torch.arange(max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(pos, inv_freq.float().to(device))
        emb = torch.cat((freqs, freqs), dim=-1)
        dtype = self.embed_tokens.weight.dtype
        self.rope_cos = (emb.cos() * scaling).to(dtype)
        self.rope_sin = (emb.sin() * scaling).to(dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, E]."""
        backend.begin_step(meta)
        cos = self.rope_cos.index_select(0, positions).unsqueeze(1)  # [T, 1, D]
        sin = self.rope_sin.index_select(0, positions).unsqueeze(1)
        x = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, meta, backend)
        return self.norm(x)

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
        head = self.lm_head if self.lm_head is not None else None
        self.lm_head = (PackedLinear.from_linear(head) if head is not None
                        else PackedLinear(self.embed_tokens.weight, None))
