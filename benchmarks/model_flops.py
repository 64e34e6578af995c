"""Floating-point work of a Llama model's steps, counted from its shape: the products of every
row (2 x weights), the output projection for rows that sample, and attention (4 x head_dim per
query head and key; a prompt row attends its cached keys and the prompt's keys up to itself).
The counts equal PyTorch's FLOP counter over transformers' forward of the same checkpoint
(tests/bench/test_serving_bounds.py), attention counted causally. A prompt's work as Baton's
fused step does it (pruned) leaves out the last layer's products past its attention for
every row but the one that samples (nothing reads them).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.model.llama import LlamaArgs
from engine.model.loader import llama_args


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, config: dict) -> Shape:
        """The shape of an HF config.json's model."""
        return cls.of_args(llama_args(config))

    @classmethod
    def of_args(cls, a: LlamaArgs) -> Shape:
        """The shape of a loaded model's arguments (model.args)."""
        return cls(
            layers=a.num_layers,
            hidden=a.hidden_size,
            intermediate=a.intermediate_size,
            heads=a.num_heads,
            kv_heads=a.num_kv_heads,
            head_dim=a.head_dim,
            vocab=a.vocab_size,
        )

    def products(self) -> list[tuple[int, int]]:
        """(K, N) of each layer's products: qkv, attention output, gate + up, down."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return [
            (self.hidden, q + 2 * kv),
            (q, self.hidden),
            (self.hidden, 2 * self.intermediate),
            (self.intermediate, self.hidden),
        ]

    def row_flops(self) -> float:
        """Products of one row through the layers (no output projection)."""
        return 2.0 * self.layers * sum(k * n for k, n in self.products())

    def head_flops(self) -> float:
        return 2.0 * self.hidden * self.vocab

    def attention_flops(self, keys: int) -> float:
        """One query row over `keys` positions: scores and values of every query head."""
        return 4.0 * self.layers * self.heads * self.head_dim * keys

    def tail_flops(self) -> float:
        """One row's products of a layer past its attention: output, gate + up, down."""
        return 2.0 * sum(k * n for k, n in self.products()[1:])

    def prefill_products(self, new: int, pruned: bool = False) -> float:
        """The products of a prompt's `new` rows; pruned: the last layer's tail for the last
        row only."""
        return new * self.row_flops() - ((new - 1) * self.tail_flops() if pruned else 0.0)

    def prefill_flops(self, cached: int, new: int, pruned: bool = False) -> float:
        return (
            self.prefill_products(new, pruned)
            + self.attention_flops(prompt_keys(cached, new))
            + self.head_flops()
        )

    def decode_row_flops(self, keys: int) -> float:
        return self.row_flops() + self.head_flops() + self.attention_flops(keys)


def prompt_keys(cached: int, new: int) -> int:
    """Keys the `new` prompt rows attend to in all, each its cached ones and those before it."""
    return sum(cached + i + 1 for i in range(new))
