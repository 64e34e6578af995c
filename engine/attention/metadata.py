"""What every attention backend needs to know about one step's flattened batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Layout of one step: S sequences, T = sum(query_lens) query tokens, flattened.

    Sequence s owns query rows query_start_loc[s] : query_start_loc[s + 1]; its i-th query
    token sits at position seq_lens[s] - query_lens[s] + i and attends keys 0 ..= position.
    Keys live in the paged cache: position p of sequence s is slot
    block_tables[s, p // block_size] * block_size + p % block_size.
    """

    query_lens: list[int]  # [S] host copy
    seq_lens: list[int]  # [S] host copy: context after this step (cached + new)
    query_start_loc: torch.Tensor  # [S + 1] int32, device
    seq_lens_tensor: torch.Tensor  # [S] int32, device
    block_tables: torch.Tensor  # [S, max_blocks] int32, device; padding entries are 0
    slot_mapping: torch.Tensor  # [T] int64, device: cache slot of each new token
    block_size: int
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


def build_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Metadata for a step, with slot_mapping derived from the block tables."""
    max_blocks = max((len(t) for t in block_tables), default=0) or 1
    table = torch.zeros(len(block_tables), max_blocks, dtype=torch.int32)
    slots: list[int] = []
    for s, (blocks, q_len, s_len) in enumerate(
        zip(block_tables, query_lens, seq_lens, strict=True)
    ):
        if blocks:
            table[s, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        for pos in range(s_len - q_len, s_len):
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    return AttentionMetadata(
        query_lens=list(query_lens),
        seq_lens=list(seq_lens),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_size=block_size,
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
    )
