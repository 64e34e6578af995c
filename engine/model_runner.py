"""ModelRunner: owns the weights and the paged KV tensors; turns a scheduled batch into tokens."""

from __future__ import annotations

import itertools
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
from engine.sampler import SampleRequest, TokenLogprobs, compute_logprobs, sample, top_logprobs
from engine.step_phases import FUSED_PART_PHASES, StepPhases

logger = logging.getLogger(__name__)


PROMPT_LOGITS_SLICE = 256  # prompt-logprob rows turned into logits [rows, V] at a time


@dataclass(frozen=True, slots=True)
class PromptLogprobsSpan:
    """Prompt tokens [lo, hi) whose logprobs this step computes (from the logits at the
    positions before them, all inside the row), with the top_n alternatives of each."""

    lo: int
    hi: int
    top_n: int


@dataclass(frozen=True, slots=True)
class BatchRow:
    """One request's slice of the step: tokens [start, start + n) of token_ids."""

    token_ids: list[int]  # all the request's tokens (prompt + output)
    start: int  # = num_computed_tokens before this step
    n: int
    block_ids: list[int]
    # Set when this step completes the request's tokens: one per token drawn from the last
    # position's logits (n of them where a prefill forks n choices).
    samples: tuple[SampleRequest, ...] = ()
    prompt_logprobs: PromptLogprobsSpan | None = None


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one step produced: a token (and its logprobs) per sample, rows in order, and
    the prompt logprobs of the rows that asked (row index -> one entry per token)."""

    tokens: list[int]
    logprobs: list[TokenLogprobs | None]
    prompt_logprobs: dict[int, list[TokenLogprobs]]


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
        # Decode steps of up to this many rows run fused (benchmarks.decode_batch raises it to
        # measure the fused step past the bound)
        self.fused_max_rows = MAX_FUSED_ROWS
        # execute() laps its phases here; the engine shares its own (engine/step_phases.py)
        self.phases = StepPhases()
        if self.fused is not None:
            self.fused.profile(True)  # its part timers feed the phases (a few us a step)

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

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy the KV of block src into block dst, every layer, for each (src, dst)."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.device)
        for layer in self.kv_caches:  # [2, num_blocks, block_size, kv_heads, head_dim]
            layer[:, dst] = layer[:, src]

    @torch.inference_mode()
    def execute(self, rows: list[BatchRow]) -> StepOutput:
        """Run one step: tokens (and logprobs) for the rows that sample, prompt logprobs for
        the rows that ask."""
        if self.fused is not None and self._fusable(rows):
            done = self._execute_fused(rows)
            if done is not None:
                return done
        input_ids: list[int] = []
        positions: list[int] = []
        logit_rows: list[int] = []  # the sampling position of each sample (repeated for forks)
        samples: list[SampleRequest] = []
        span_rows: list[int] = []  # the positions whose logits give prompt logprobs
        for row in rows:
            offset = len(input_ids)
            input_ids.extend(row.token_ids[row.start : row.start + row.n])
            positions.extend(range(row.start, row.start + row.n))
            for sample_request in row.samples:
                logit_rows.append(len(input_ids) - 1)
                samples.append(sample_request)
            if row.prompt_logprobs is not None:  # token j's logprob: logits at position j - 1
                first = offset + row.prompt_logprobs.lo - 1 - row.start
                span_rows.extend(
                    range(first, first + row.prompt_logprobs.hi - row.prompt_logprobs.lo)
                )
        meta = build_metadata(
            [r.n for r in rows],
            [r.start + r.n for r in rows],
            [r.block_ids for r in rows],
            self.block_size,
            self.device,
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        wanted = logit_rows + span_rows
        selection = None  # every position is wanted once (all decode): no selection needed
        if wanted != list(range(len(input_ids))):
            selection = torch.tensor(wanted, dtype=torch.long, device=self.device)
        self.phases.lap("inputs")
        hidden = self.model(ids, pos, self.kv_caches, meta, self.backend, selection)  # [W, E]
        self.phases.lap("forward")
        tokens: list[int] = []
        logprobs: list[TokenLogprobs | None] = []
        if logit_rows:
            logits = self.model.compute_logits(hidden[: len(logit_rows)])  # [S, V] fp32
            self.phases.lap("logits")
            tokens = sample(logits, samples)
            logprobs = compute_logprobs(logits, tokens, samples)
            self.phases.lap("sample")
        spans = self._prompt_logprobs(rows, hidden[len(logit_rows) :]) if span_rows else {}
        if span_rows:
            self.phases.lap("logits")
        return StepOutput(tokens, logprobs, spans)

    def _prompt_logprobs(
        self, rows: list[BatchRow], hidden: torch.Tensor
    ) -> dict[int, list[TokenLogprobs]]:
        """hidden: [P, E], the span positions of the rows that ask, in row order."""
        out: dict[int, list[TokenLogprobs]] = {}
        at = 0
        for i, row in enumerate(rows):
            span = row.prompt_logprobs
            if span is None:
                continue
            entries: list[TokenLogprobs] = []
            for lo in range(span.lo, span.hi, PROMPT_LOGITS_SLICE):
                hi = min(lo + PROMPT_LOGITS_SLICE, span.hi)
                logits = self.model.compute_logits(hidden[at + lo - span.lo : at + hi - span.lo])
                logp = torch.log_softmax(logits, dim=-1)
                entries += top_logprobs(logp, row.token_ids[lo:hi], span.top_n)
            out[i] = entries
            at += span.hi - span.lo
        return out

    def _fusable(self, rows: list[BatchRow]) -> bool:
        """Whether the fused C step can run this step: at most fused_max_rows tokens in all,
        each row drawing at most one sample and no prompt logprobs; with int8 activations
        decode rows only (prompts stay float32, see EngineOptions.int8_activations)."""
        fused = self.fused
        if fused is None or sum(r.n for r in rows) > self.fused_max_rows:
            return False
        one_token = fused.int8
        return all(
            len(r.samples) <= 1 and r.prompt_logprobs is None and (r.n == 1 or not one_token)
            for r in rows
        )

    def _execute_fused(self, rows: list[BatchRow]) -> StepOutput | None:
        """A step through the fused C step: decode rows and prompt chunks, each row drawing at
        most one sample (from its last token); None where it does not run (the caller then
        takes the unfused path; nothing was written)."""
        fused = self.fused
        if fused is None or not fused.serves(self.kv_caches):
            return None
        wanted = [i for i, row in enumerate(rows) if row.samples]
        timings = fused.timings  # None unless profiling: seconds per part, accumulated
        before = list(timings) if timings is not None else None
        self.phases.lap("inputs")
        ends = list(itertools.accumulate(r.n for r in rows))  # one past each row's tokens
        logit_rows = [ends[i] - 1 for i in wanted]  # the last token of each sampling row
        if len(rows) == 1 and rows[0].n == 1:
            row = rows[0]
            out = fused.step(row.token_ids[row.start], row.block_ids, row.start + 1, bool(wanted))
        else:
            out = fused.step_rows(
                [t for r in rows for t in r.token_ids[r.start : r.start + r.n]],
                [row.block_ids for row in rows],
                [p + 1 for r in rows for p in range(r.start, r.start + r.n)],
                logit_rows,
                None if len(rows) == ends[-1] else [r.n for r in rows],
                all_hidden=False,  # only the logit rows' hidden states are read
            )
        self.phases.lap("forward")
        if out is None:
            return None
        if before is not None and timings is not None:  # the C parts of the call, out of "forward"
            for phase, was, now in zip(FUSED_PART_PHASES, before, timings, strict=True):
                self.phases.move("forward", phase, now - was)
        if not wanted:
            return StepOutput([], [], {})
        hidden, logits = out
        if logits is None:  # the output projection is not in GGUF blocks
            logits = self.model.compute_logits(hidden[logit_rows])
            self.phases.lap("logits")
        samples = [rows[i].samples[0] for i in wanted]
        tokens = sample(logits, samples)
        result = StepOutput(tokens, compute_logprobs(logits, tokens, samples), {})
        self.phases.lap("sample")
        return result
