"""ModelRunner: owns the weights and the paged KV tensors; turns a scheduled batch into tokens."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention import build_metadata, get_attention_backend
from engine.attention.kv_layout import allocate_kv_cache
from engine.config import EngineConfig
from engine.errors import CapacityError
from engine.model.fused_decode import MAX_ROWS as MAX_FUSED_ROWS
from engine.model.fused_decode import FusedDecoder
from engine.model.loader import load_model
from engine.sampler import SampleRequest, TokenLogprobs, compute_logprobs, sample

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BatchRow:
    """One request's slice of the step: tokens [start, start + n) of token_ids."""

    token_ids: list[int]  # all the request's tokens (prompt + output)
    start: int  # = num_computed_tokens before this step
    n: int
    block_ids: list[int]
    sample: SampleRequest | None  # set when this step completes the request's tokens


class ModelRunner:
    """Executes forward passes over the paged KV cache (one tensor per layer)."""

    def __init__(self, config: EngineConfig, model_dir: Path, max_model_len: int) -> None:
        self.config = config
        self.device = config.torch_device()
        self.dtype = config.torch_dtype()
        if self.device.type == "cpu" and config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model, self.hf_config = load_model(
            model_dir,
            self.dtype,
            self.device,
            max_model_len,
            config.use_gguf_blocks,
            config.int8_activations,
            config.gguf_isa,
        )
        args = self.model.args
        self.backend = get_attention_backend(config.attention_backend, self.device)
        self.block_size = config.block_size
        self.num_blocks = config.num_kv_blocks or self._blocks_for_budget()
        # Per layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (head-major storage)
        self.kv_caches = [
            allocate_kv_cache(
                self.num_blocks,
                self.block_size,
                args.num_kv_heads,
                args.head_dim,
                self.dtype,
                self.device,
            )
            for _ in range(args.num_layers)
        ]
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB)",
            self.num_blocks,
            self.block_size,
            self.kv_cache_bytes() / 2**30,
        )
        # Decode-only steps in one C call where the model allows (engine/model/fused_decode.py)
        self.fused = FusedDecoder.build(self.model, self.kv_caches, self.backend, config)

    def block_bytes(self) -> int:
        """Bytes one block occupies across all layers (keys and values)."""
        a = self.model.args
        elem = torch.finfo(self.dtype).bits // 8
        return a.num_layers * 2 * self.block_size * a.num_kv_heads * a.head_dim * elem

    def kv_cache_bytes(self) -> int:
        return self.block_bytes() * self.num_blocks

    def _blocks_for_budget(self) -> int:
        n = int(self.config.kv_cache_memory_gb * 2**30) // self.block_bytes()
        if n < 1:
            raise CapacityError(
                f"kv_cache_memory_gb={self.config.kv_cache_memory_gb} is too "
                f"small for one block of {self.block_bytes()} bytes"
            )
        return n

    @torch.inference_mode()
    def execute(self, rows: list[BatchRow]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Run one step; return sampled tokens (and logprobs) for the rows that sample."""
        if self.fused is not None and len(rows) <= MAX_FUSED_ROWS and all(r.n == 1 for r in rows):
            done = self._execute_fused(rows)
            if done is not None:
                return done
        input_ids: list[int] = []
        positions: list[int] = []
        logit_rows: list[int] = []
        samples: list[SampleRequest] = []
        for row in rows:
            input_ids.extend(row.token_ids[row.start : row.start + row.n])
            positions.extend(range(row.start, row.start + row.n))
            if row.sample is not None:
                logit_rows.append(len(input_ids) - 1)
                samples.append(row.sample)
        meta = build_metadata(
            [r.n for r in rows],
            [r.start + r.n for r in rows],
            [r.block_ids for r in rows],
            self.block_size,
            self.device,
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        rows = None  # every row samples (all decode): no selection needed
        if len(logit_rows) < len(input_ids):
            rows = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
        hidden = self.model(ids, pos, self.kv_caches, meta, self.backend, rows)  # [N, E]
        if not logit_rows:
            return [], []
        logits = self.model.compute_logits(hidden)  # [N, V] fp32
        tokens = sample(logits, samples)
        return tokens, compute_logprobs(logits, tokens, samples)

    def _execute_fused(
        self, rows: list[BatchRow]
    ) -> tuple[list[int], list[TokenLogprobs | None]] | None:
        """A step of one token per row through the fused C step; None where it does not run
        (the caller then takes the unfused path; nothing was written)."""
        if not self.fused.serves(self.kv_caches):
            return None
        wanted = [i for i, row in enumerate(rows) if row.sample is not None]
        if len(rows) == 1:
            row = rows[0]
            out = self.fused.step(
                row.token_ids[row.start], row.block_ids, row.start + 1, bool(wanted)
            )
        else:
            out = self.fused.step_rows(
                [row.token_ids[row.start] for row in rows],
                [row.block_ids for row in rows],
                [row.start + 1 for row in rows],
                wanted,
            )
        if out is None:
            return None
        if not wanted:
            return [], []
        hidden, logits = out
        if logits is None:  # the output projection is not in GGUF blocks
            logits = self.model.compute_logits(hidden[wanted])
        samples = [rows[i].sample for i in wanted]
        tokens = sample(logits, samples)
        return tokens, compute_logprobs(logits, tokens, samples)
