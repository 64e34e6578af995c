"""The fused decode step over several rows (decode_step.c): for rows with different context
lengths, blocks out of order and prefix blocks shared between rows, the same hidden states,
logits and KV cache contents as the unfused path; each row bit for bit what the step computes
for it alone; greedy tokens of concurrent requests equal the unfused engine's and
transformers'; and the unfused path where rows cannot share a step."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention import build_metadata
from engine.attention.kv_layout import allocate_kv_cache
from engine.model import fused_decode
from engine.model.fused_decode import MAX_ROWS, FusedDecoder
from engine.model.gguf_linear import GGUFBlockLinear
from tests.engine.test_fused_decode import (
    INT8_ISAS,
    OPTS,
    RUNNABLE_ISAS,
    spy_steps,
    threads,  # noqa: F401 - the fixture, by name
)
from tests.engine.test_gguf_blocks import VOCAB
from tests.helpers import hf_greedy, random_prompts

pytestmark = pytest.mark.skipif(
    fused_decode.load_kernel() is None, reason="no x86-64 AVX2/FMA/F16C CPU or C compiler"
)

BLOCK, NUM_BLOCKS, STEPS = 4, 160, 5
# the caches' blocks: NUM_BLOCKS drawn in random order, then the rest in order (50 rows over
# LONG_PREFIX need more than NUM_BLOCKS)
CACHE_BLOCKS = 400
PREFIX = 8  # tokens (two full blocks) that every third row shares, blocks and all
# a shared prefix past the fused step's first window of keys (128): that window runs once for
# all the rows sharing it
LONG_PREFIX = 136
CPU = torch.device("cpu")


@dataclass(frozen=True, slots=True)
class Row:
    """One sequence of a test step: its tokens, its block table, and how many of the tokens
    are in the cache before the first decode step (the rest are decoded one per step)."""

    tokens: list[int]
    blocks: list[int]
    context: int
    shared: bool  # starts with the shared prefix, in the shared blocks


def make_rows(count: int, seed: int, prefix_len: int = PREFIX) -> tuple[list[Row], list[int]]:
    """`count` rows with context lengths 0 to 20 (row 0: none, its first token decodes at
    position 0), blocks drawn out of order, and rows 1, 4, 7, ... starting with the same
    prefix_len tokens (whole blocks) in the same blocks. Returns (rows, the shared prefix's
    tokens)."""
    g = torch.Generator().manual_seed(seed)
    free = list(range(CACHE_BLOCKS - 1, NUM_BLOCKS - 1, -1))
    free = free + torch.randperm(NUM_BLOCKS, generator=g).tolist()  # popped from the end
    prefix_blocks = [free.pop() for _ in range(prefix_len // BLOCK)]
    prefix = torch.randint(0, VOCAB, (prefix_len,), generator=g).tolist()
    rows = []
    for r in range(count):
        shared = r % 3 == 1
        context = 0 if r == 0 else int(torch.randint(1, 21, (1,), generator=g))
        if shared:
            context = prefix_len + int(torch.randint(0, 9, (1,), generator=g))
        tokens = torch.randint(0, VOCAB, (context + STEPS,), generator=g).tolist()
        blocks = list(prefix_blocks) if shared else []
        if shared:
            tokens[:prefix_len] = prefix
        blocks += [free.pop() for _ in range(-(-len(tokens) // BLOCK) - len(blocks))]
        rows.append(Row(tokens, blocks, context, shared))
    return rows, prefix


def caches(runner) -> list[torch.Tensor]:
    a = runner.model.args
    return [
        allocate_kv_cache(CACHE_BLOCKS, BLOCK, a.num_kv_heads, a.head_dim, torch.float32)
        for _ in range(a.num_layers)
    ]


def prefill(runner, rows: list[Row], prefix: list[int]) -> list[torch.Tensor]:
    """Fresh caches holding every row's context, written by the unfused model: the shared
    prefix once, then each row's own part of its context (chunked-prefill style: the shared
    rows' queries start after the prefix, whose blocks they read)."""
    kv = caches(runner)
    shared = [row for row in rows if row.shared]
    steps = [([prefix], [0], [shared[0].blocks[: len(prefix) // BLOCK]])] if shared else []
    chunks = [(row, len(prefix) if row.shared else 0) for row in rows]
    chunks = [(row, start) for row, start in chunks if row.context > start]
    steps.append(
        (
            [row.tokens[start : row.context] for row, start in chunks],
            [start for _, start in chunks],
            [row.blocks for row, _ in chunks],
        )
    )
    with torch.inference_mode():
        for tokens, starts, tables in steps:
            meta = build_metadata(
                [len(t) for t in tokens],
                [s + len(t) for s, t in zip(starts, tokens, strict=True)],
                tables,
                BLOCK,
                CPU,
            )
            ids = torch.tensor([t for ts in tokens for t in ts])
            pos = torch.tensor(
                [s + i for s, ts in zip(starts, tokens, strict=True) for i in range(len(ts))]
            )
            runner.model(ids, pos, kv, meta, runner.backend)
    return kv


def copy_of(kv: list[torch.Tensor], runner) -> list[torch.Tensor]:
    """Caches laid out as allocate_kv_cache lays them out, holding kv's values."""
    out = caches(runner)
    for dst, src in zip(out, kv, strict=True):
        dst.copy_(src)
    return out


def decode_inputs(rows: list[Row], step: int) -> tuple[list[int], list[list[int]], list[int]]:
    """(tokens, block tables, sequence lengths) of decode step `step` (0-based)."""
    return (
        [row.tokens[row.context + step] for row in rows],
        [row.blocks for row in rows],
        [row.context + step + 1 for row in rows],
    )


@functools.cache
def runner_for(path: str, isa: str, int8: bool):
    """An engine's runner on the quantized checkpoint, norm weights other than ones (so that
    each one's place matters), with the given kernels."""
    llm = LLM(path, gguf_isa=isa, int8_activations=int8, **OPTS)
    model = llm.engine.runner.model
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in model.layers:
            layer.input_layernorm.weight.uniform_(0.5, 1.5, generator=g)
            layer.post_attention_layernorm.weight.uniform_(0.5, 1.5, generator=g)
        model.norm.weight.uniform_(0.5, 1.5, generator=g)
    return llm.engine.runner


def assert_rows_equal_unfused(
    runner, count: int, seed: int, tolerance: float, batched_tolerance: float, prefix_len=PREFIX
) -> None:
    """STEPS decode steps of `count` rows, fused over fresh caches against the runner's
    unfused model over its own, two ways: one unfused step of all rows (hidden states, logits
    and every layer's cache within batched_tolerance) and one unfused step per row (the
    products of one row: the arithmetic the fused step uses for every row; within
    `tolerance`)."""
    rows, prefix = make_rows(count, seed, prefix_len)
    batched_kv = prefill(runner, rows, prefix)
    alone_kv, fused_kv = copy_of(batched_kv, runner), copy_of(batched_kv, runner)
    fused = FusedDecoder.build(runner.model, fused_kv, runner.backend, runner.config)
    model = runner.model

    def unfused(tokens: list[int], tables, lens: list[int], kv) -> torch.Tensor:
        meta = build_metadata([1] * len(tokens), lens, tables, BLOCK, CPU)
        pos = torch.tensor(lens) - 1
        return model(torch.tensor(tokens), pos, kv, meta, runner.backend)

    with torch.inference_mode():
        for step in range(STEPS):
            tokens, tables, lens = decode_inputs(rows, step)
            hidden, logits = fused.step_rows(tokens, tables, lens, list(range(count)))
            batched = unfused(tokens, tables, lens, batched_kv)
            each = zip(tokens, tables, lens, strict=True)
            alone = torch.cat([unfused([t], [b], [n], alone_kv) for t, b, n in each])
            for ref, ref_kv, tol in (
                (batched, batched_kv, batched_tolerance),
                (alone, alone_kv, tolerance),
            ):
                close = dict(rtol=tol, atol=tol)
                torch.testing.assert_close(hidden, ref, **close)
                torch.testing.assert_close(logits, model.compute_logits(ref), **close)
                for ref_cache, ours in zip(ref_kv, fused_kv, strict=True):
                    torch.testing.assert_close(ours, ref_cache, **close)
    assert fused_kv[-1].abs().sum() > 0


@pytest.mark.usefixtures("threads")
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("isa", RUNNABLE_ISAS)
@pytest.mark.parametrize(
    "count,prefix_len", [(2, PREFIX), (3, PREFIX), (8, PREFIX), (17, PREFIX), (17, LONG_PREFIX)]
)
def test_rows_equal_the_unfused_path(quantized_llama, isa, count, prefix_len):
    """Against one row at a time: the one-row tests' tolerance (the same products; silu's exp
    differs in the last bit) up to EXACT_MAX_ROWS rows; above, the fused step's panel products
    sum in another order (3e-5). Against the unfused step of all rows: 2e-5 where both
    multiply on AVX2 (the unfused path: AVX2 block kernel up to 8 rows, dense float32 above,
    and its attention cuts keys by the step's work where the fused step cuts them every 128);
    with AVX-512 the fused rows sum 16 lanes wide and the unfused several-row products 8 wide
    (another order, ~1e-5 after two layers)."""
    runner = runner_for(str(quantized_llama), isa, False)
    batched = 2e-5 if isa == "avx2" and count <= exact_max_rows() else 3e-5
    alone = 1e-5 if count <= exact_max_rows() else 3e-5
    assert_rows_equal_unfused(
        runner, count, count, tolerance=alone, batched_tolerance=batched, prefix_len=prefix_len
    )


@pytest.mark.parametrize("isa", INT8_ISAS)
@pytest.mark.parametrize("count", [2, 3, 8])
def test_int8_rows_equal_the_unfused_int8_path(quantized_llama, isa, count):
    # up to 8 rows the unfused layers quantize too (above: dense float32, not comparable);
    # tolerance as for one int8 row (AVX-512 VNNI: zmm vs ymm summation)
    runner = runner_for(str(quantized_llama), isa, True)
    assert runner.fused is not None and runner.fused.int8
    assert_rows_equal_unfused(
        runner, count, seed=20 + count, tolerance=1e-4, batched_tolerance=1e-4
    )


@pytest.mark.usefixtures("threads")
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize(
    "isa,int8", [(isa, False) for isa in RUNNABLE_ISAS] + [(isa, True) for isa in INT8_ISAS]
)
@pytest.mark.parametrize("prefix_len", [PREFIX, LONG_PREFIX])
# 7: one AVX-512 tile of 7 rows (AVX2 and int8: tiles of 4 and 3);
# 50: 17 rows share the prefix, 34 query vectors, which pass its window in lanes on AVX-512
@pytest.mark.parametrize("count", [7, 12, 17, 34, 50])
def test_each_row_is_what_it_is_alone(quantized_llama, isa, int8, prefix_len, count):
    """`count` rows in one step against each row alone (R = 1) over a copy of the same cache:
    hidden state, logits and cache equal bit for bit, whatever tile and thread a row meets,
    and whether its shared prefix's window runs for its group or for it alone. Float32 steps
    of more than EXACT_MAX_ROWS rows multiply by panels (on AVX-512 from LANES_MIN_ROWS rows by
    lanes, with AMX from AMX_MIN_ROWS rows on tiles): there each row is compared with the same
    row in a step of fewer other rows whose products are of the same kind (the first rows,
    then the last). The head's arithmetic is set by its own rows (up to EXACT_MAX_ROWS: the
    exact kernels in any step), so each step computes the logits of the rows of `some` only."""
    runner = runner_for(str(quantized_llama), isa, int8)
    rows, prefix = make_rows(count, seed=30, prefix_len=prefix_len)
    together = prefill(runner, rows, prefix)
    apart = copy_of(together, runner)
    both = [
        FusedDecoder.build(runner.model, kv, runner.backend, runner.config)
        for kv in (together, apart)
    ]
    some = [r for r in (0, 2, 3, 9, 16) if r < count]  # only these rows' logits are computed
    size = same_products_min_rows(isa, int8, count)
    if size == 1:
        splits = [range(r, r + 1) for r in range(count)]
    else:  # steps of `size` rows that together cover every row (the last ends at count)
        assert size < count
        ends = [min(lo + size, count) for lo in range(0, count, size)]
        splits = [range(hi - size, hi) for hi in ends]
    for step in range(STEPS):
        tokens, tables, lens = decode_inputs(rows, step)
        hidden, logits = both[0].step_rows(tokens, tables, lens, some)
        assert logits.shape == (len(some), VOCAB)
        for split in splits:
            picked = list(split)
            sampled = [i for i, r in enumerate(picked) if r in some]
            part_hidden, part_logits = both[1].step_rows(
                [tokens[r] for r in picked],
                [tables[r] for r in picked],
                [lens[r] for r in picked],
                sampled,
            )
            for i, r in enumerate(picked):
                assert torch.equal(hidden[r], part_hidden[i])
                if r in some:
                    assert torch.equal(logits[some.index(r)], part_logits[sampled.index(i)])
        assert all(torch.equal(a, b) for a, b in zip(together, apart, strict=True))


@pytest.mark.parametrize("isa", RUNNABLE_ISAS)
# 12: panels on AVX2, tiles with AMX; 34: lanes on AVX-512, tiles with AMX
@pytest.mark.parametrize("count", [12, 34])
def test_a_few_rows_logits_are_the_heads_one_row_products_in_any_step(quantized_llama, isa, count):
    """Whatever kind a step's products are, the logits of up to EXACT_MAX_ROWS of its rows are
    the head's one-row products of those rows' final hidden states, bit for bit."""
    runner = runner_for(str(quantized_llama), isa, False)
    head = runner.model.lm_head
    assert isinstance(head, GGUFBlockLinear)
    rows, prefix = make_rows(count, seed=31)
    fused = FusedDecoder.build(
        runner.model, prefill(runner, rows, prefix), runner.backend, runner.config
    )
    some = [0, 5, 9, count - 1]
    assert len(some) <= exact_max_rows() < count
    hidden, logits = fused.step_rows(*decode_inputs(rows, 0), some)
    for i, r in enumerate(some):
        assert torch.equal(logits[i], head(hidden[r : r + 1])[0])


def exact_max_rows() -> int:
    """decode_step.c's EXACT_MAX_ROWS."""
    lib = fused_decode.load_kernel()
    assert lib is not None
    return lib.baton_decode_exact_max_rows()


def same_products_min_rows(isa: str, int8: bool, count: int) -> int:
    """The fewest rows of a step whose products have the arithmetic of a step of `count` rows
    (decode_matrix.c): int8, or float32 up to EXACT_MAX_ROWS rows, the one-row kernels' (1);
    above, the panels' (EXACT_MAX_ROWS + 1), on AVX-512 from LANES_MIN_ROWS rows the lanes',
    with AMX from AMX_MIN_ROWS rows the tiles'."""
    lib = fused_decode.load_kernel()
    assert lib is not None
    exact, lanes = lib.baton_decode_exact_max_rows(), lib.baton_decode_lanes_min_rows()
    tiles = lib.baton_decode_amx_min_rows()
    if int8 or count <= exact:
        return 1
    if isa == "amx" and count >= tiles:
        return tiles
    return lanes if isa in ("avx512", "amx") and count >= lanes else exact + 1


def test_rows_that_cannot_share_a_step_are_refused(quantized_llama):
    runner = runner_for(str(quantized_llama), RUNNABLE_ISAS[0], False)
    rows, prefix = make_rows(3, seed=40)
    kv = prefill(runner, rows, prefix)
    before = [c.clone() for c in kv]
    fused = FusedDecoder.build(runner.model, kv, runner.backend, runner.config)
    tokens, tables, lens = decode_inputs(rows, 0)
    # row 2 reads the block row 0 writes its new token into: not a step the scheduler makes
    reads_others_slot = [tables[0], tables[1], [tables[0][0], *tables[2][1:]]]
    assert lens[2] > BLOCK  # so row 2 reads its first block
    assert fused.step_rows(tokens, reads_others_slot, lens, [0, 1, 2]) is None
    assert fused.step_rows(tokens, [tables[0]] * 3, [lens[0]] * 3, [0]) is None  # one slot
    assert fused.step_rows(tokens, tables, lens, [1, 0]) is None  # logit rows out of order
    assert fused.step_rows([VOCAB, *tokens[1:]], tables, lens, []) is None  # no such token
    assert all(torch.equal(a, b) for a, b in zip(before, kv, strict=True))
    with pytest.raises(ValueError, match="cannot hold"):
        fused.step_rows(tokens, [tables[0], [], tables[2]], lens, [])
    # one table for three rows: one sequence's consecutive tokens, which these are not
    assert fused.step_rows(tokens, [tables[0]], [lens[0]] * 3, [], rows_per_table=[3]) is None
    assert all(torch.equal(a, b) for a, b in zip(before, kv, strict=True))
    with pytest.raises(ValueError, match="rows of block tables"):
        fused.step_rows(tokens, tables[:2], lens, [])


def test_greedy_tokens_of_concurrent_requests_equal_unfused_and_transformers(
    quantized_llama, hf_models, monkeypatch
):
    """Five requests (two sharing a cached prefix) decode together: every step after the
    prefill runs fused with all running rows, and the tokens are those of the unfused engine
    and of transformers. With chunk_size 1 every step is one token per row, prompts included:
    rows that do not sample yet share fused steps with rows that do."""
    shared = random_prompts([9], seed=50, vocab=VOCAB)[0]
    prompts = random_prompts([5, 3, 17, 1], seed=51, vocab=VOCAB)
    prompts = [shared + prompts[0], *prompts[1:], shared + prompts[1]]
    lengths = [12, 7, 12, 9, 12]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    hf = hf_models(str(quantized_llama))
    want = [hf_greedy(hf, p, n) for p, n in zip(prompts, lengths, strict=True)]
    unfused = LLM(str(quantized_llama), fused_decode=False, **OPTS)
    assert [o.token_ids for o in unfused.generate(prompts, params)] == want
    for chunking in ({}, {"chunk_size": 1, "max_num_batched_tokens": 8}):
        fused = LLM(str(quantized_llama), **OPTS, **chunking)
        fused.generate([shared + [1]], params[0])  # the shared prefix's blocks now cached
        calls = spy_steps(fused.engine.runner, monkeypatch)
        outs = fused.generate(prompts, params)
        assert [o.token_ids for o in outs] == want
        assert [o.num_cached_tokens for o in outs] == [8, 0, 0, 0, 8]  # the prefix's 2 blocks
        sizes = [1 if isinstance(c, int) else len(c) for c in calls]
        computed = sum(len(p) - 8 * (i in (0, 4)) for i, p in enumerate(prompts))
        if not chunking:  # one step of every prompt's tokens, then every step decodes all
            assert sizes == [computed] + [5] * 6 + [4] * 2 + [3] * 3
        else:  # one token per row and step: each computed token is a fused row
            assert max(sizes) == 5 and sum(sizes) == computed + sum(lengths) - len(prompts)
        fused.engine.check_integrity()


def test_steps_of_more_tokens_than_max_rows_take_the_unfused_path(quantized_llama, monkeypatch):
    prompts = random_prompts([3] * 5, seed=60, vocab=VOCAB)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    fused = LLM(str(quantized_llama), **OPTS)
    fused.engine.runner.fused_max_rows = 4
    calls = spy_steps(fused.engine.runner, monkeypatch)
    ours = [o.token_ids for o in fused.generate(prompts, params)]
    assert calls == []  # the prompts' step has 15 rows, every decode step 5
    unfused = LLM(str(quantized_llama), fused_decode=False, **OPTS)
    assert ours == [o.token_ids for o in unfused.generate(prompts, params)]
    assert MAX_ROWS >= 64


def test_steps_whose_attention_states_do_not_fit_take_the_unfused_path(quantized_llama):
    """A step whose attention states would pass max_state_bytes: the C step refuses it before
    writing anything (the engine then runs the per-operation path). 16 decode rows, each with
    one window of keys (one state per query head): 64 states of 2 + head_dim floats; a bound
    one state short refuses the step, the bound itself takes it, and the cache is as the
    taken step alone leaves it."""
    runner = runner_for(str(quantized_llama), "avx2", False)
    rows, prefix = make_rows(16, seed=82)
    kv = prefill(runner, rows, prefix)
    before = [c.clone() for c in kv]
    fused = FusedDecoder.build(runner.model, kv, runner.backend, runner.config)
    args = runner.model.args
    states = 4 * len(rows) * args.num_heads * (2 + args.head_dim)
    step = decode_inputs(rows, 0)
    fused.max_state_bytes = states - 1
    assert fused.step_rows(*step, list(range(16))) is None
    assert all(torch.equal(a, b) for a, b in zip(kv, before, strict=True))
    fused.max_state_bytes = states
    assert fused.step_rows(*step, list(range(16))) is not None
    assert not all(torch.equal(a, b) for a, b in zip(kv, before, strict=True))


def chunk_step(rows: list[Row], prompt: Row, lo: int, hi: int):
    """Inputs of one step: every row of `rows` decodes its first token after its context, and
    `prompt`'s tokens [lo, hi) are a chunk (a row per token). Returns (tokens, tables,
    seq_lens, rows_per_table, logit_rows: every decode row and the chunk's last token)."""
    tokens, tables, lens = decode_inputs(rows, 0)
    tokens += prompt.tokens[lo:hi]
    lens += list(range(lo + 1, hi + 1))
    logit_rows = [*range(len(rows)), len(tokens) - 1]
    return tokens, [*tables, prompt.blocks], lens, [1] * len(rows) + [hi - lo], logit_rows


def fresh_prompt(rows: list[Row], length: int, seed: int) -> Row:
    """A prompt with nothing cached, in blocks no row uses."""
    used = {b for row in rows for b in row.blocks}
    free = [b for b in range(NUM_BLOCKS) if b not in used]
    tokens = torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))
    return Row(tokens.tolist(), free[: -(-length // BLOCK)], 0, False)


def assert_step_equals_unfused(runner, rows: list[Row], prefix: list[int], step) -> None:
    """The rows' contexts prefilled, then one fused step of `step` (tokens, tables, sequence
    lengths, rows per table, logit rows) against one unfused step of the same rows over a copy
    of the cache: hidden states, logits and caches within 3e-5."""
    tokens, tables, lens, per_table, logit_rows = step
    kv = prefill(runner, rows, prefix)
    fused_kv = copy_of(kv, runner)
    fused = FusedDecoder.build(runner.model, fused_kv, runner.backend, runner.config)
    with torch.inference_mode():
        hidden, logits = fused.step_rows(tokens, tables, lens, logit_rows, per_table)
        meta = build_metadata(per_table, [lens[i] for i in logit_rows], tables, BLOCK, CPU)
        ref = runner.model(torch.tensor(tokens), torch.tensor(lens) - 1, kv, meta, runner.backend)
    close = dict(rtol=3e-5, atol=3e-5)
    torch.testing.assert_close(hidden, ref, **close)
    torch.testing.assert_close(logits, runner.model.compute_logits(ref[logit_rows]), **close)
    for ours, theirs in zip(fused_kv, kv, strict=True):
        torch.testing.assert_close(ours, theirs, **close)


def test_a_prompt_chunk_beside_decodes_equals_the_unfused_step(quantized_llama):
    """Decode rows and a prompt's chunk (after cached context: a shared row's own tokens, and
    five more whose keys this very step writes) in one fused step: hidden states, logits and
    caches as one unfused step of the same rows computes them."""
    runner = runner_for(str(quantized_llama), "avx2", False)
    rows, prefix = make_rows(5, seed=70)
    prompt = rows[1]  # it shares the prefix; its context is in the cache
    assert prompt.shared and prompt.context >= PREFIX
    others = [row for row in rows if row is not prompt]
    hi = prompt.context + STEPS  # five tokens past what the cache holds
    assert_step_equals_unfused(runner, rows, prefix, chunk_step(others, prompt, PREFIX, hi))


@pytest.mark.parametrize("isa", RUNNABLE_ISAS)
def test_a_long_prompt_beside_decodes_equals_the_unfused_step(quantized_llama_one_head, isa):
    """head_dim 64: with AMX the prompt's windows of keys are attended on tiles, each window's
    keys packed once for the prompt's chunks (150 tokens: three chunks of 64 rows at most, two
    windows). Hidden states, logits and caches within the tolerance of the fused step's
    products of many rows."""
    runner = runner_for(str(quantized_llama_one_head), isa, False)
    assert runner.model.args.head_dim == 64
    rows, prefix = make_rows(4, seed=73)
    prompt = fresh_prompt(rows, 150, seed=74)
    assert_step_equals_unfused(runner, rows, prefix, chunk_step(rows, prompt, 0, 150))


@pytest.mark.usefixtures("threads")
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("isa", RUNNABLE_ISAS)
def test_a_prompt_of_many_windows_beside_decodes_equals_the_unfused_step(quantized_llama_long, isa):
    """520 tokens beside four decode rows (its chunks' windows run in runs, the first folded
    as it runs: of 3 windows on two threads, of 6 on one): within the tolerance of the fused
    step's products of many rows."""
    runner = runner_for(str(quantized_llama_long), isa, False)
    rows, prefix = make_rows(4, seed=78)
    prompt = fresh_prompt(rows, 520, seed=79)
    assert_step_equals_unfused(runner, rows, prefix, chunk_step(rows, prompt, 0, 520))


@pytest.mark.parametrize("isa", RUNNABLE_ISAS)
def test_two_prompts_beside_decodes_equal_the_unfused_step(quantized_llama_one_head, isa):
    """Two fresh prompts in one step (with AMX each packs its own windows: 70 tokens, two
    chunks of 64 rows at most sharing their packs; 40 tokens, one chunk) beside four decode
    rows: within the tolerance of the fused step's products of many rows."""
    runner = runner_for(str(quantized_llama_one_head), isa, False)
    rows, prefix = make_rows(4, seed=75)
    first = fresh_prompt(rows, 70, seed=76)
    second = fresh_prompt([*rows, first], 40, seed=77)
    tokens, tables, lens = decode_inputs(rows, 0)
    for prompt in (first, second):
        tokens += prompt.tokens
        tables.append(prompt.blocks)
        lens += list(range(1, len(prompt.tokens) + 1))
    per_table = [1] * len(rows) + [70, 40]
    logit_rows = [*range(len(rows)), len(rows) + 69, len(tokens) - 1]
    assert_step_equals_unfused(runner, rows, prefix, (tokens, tables, lens, per_table, logit_rows))


@pytest.mark.parametrize(
    "model,length,cut",
    [
        (model, length, cut)
        for model in ("quantized_llama", "quantized_llama_one_head")
        for length, cut in ((32, 12), (64, 28), (150, 70))
    ]
    # five windows for the last rows: off AMX the whole step runs each chunk's windows in
    # runs of three, the first folded as it runs; the first part in runs of one, the second
    # of three (decode_step.c's CHUNK_TASKS)
    + [("quantized_llama_long", 520, 200)],
)
@pytest.mark.parametrize("isa", RUNNABLE_ISAS)
def test_a_prompt_gives_the_same_numbers_however_it_is_chunked(request, model, isa, length, cut):
    """A fresh prompt beside four decode rows in one step, and the same in two steps (the
    decode rows in the first; 150 tokens: several windows of keys and several groups of rows
    per window): bit for bit the same keys and values, the same hidden states and the same
    logits, since each row's numbers are what a step of more than EXACT_MAX_ROWS rows computes
    for it (by panels, or by lanes on AVX-512: each of the three steps takes the same kind),
    whatever the other rows. With head_dim 64 (quantized_llama_one_head) and AMX the prompt's
    windows are attended on tiles, their keys packed to the furthest chunk's end: the whole
    step's packs hold more keys than the first half's."""
    size = same_products_min_rows(isa, False, length + 4)
    if length - cut < size:
        pytest.skip(f"the halves of {length} tokens are steps of another kind than the whole")
    runner = runner_for(str(request.getfixturevalue(model)), isa, False)
    rows, prefix = make_rows(4, seed=71)
    prompt = fresh_prompt(rows, length, seed=72)
    whole = prefill(runner, rows, prefix)
    halves = copy_of(whole, runner)
    one, two = (
        FusedDecoder.build(runner.model, kv, runner.backend, runner.config)
        for kv in (whole, halves)
    )
    tokens, tables, lens, per_table, logit_rows = chunk_step(rows, prompt, 0, length)
    hidden, logits = one.step_rows(tokens, tables, lens, logit_rows, per_table)
    tokens, tables, lens, per_table, logit_rows = chunk_step(rows, prompt, 0, cut)
    first_hidden, first_logits = two.step_rows(tokens, tables, lens, logit_rows, per_table)
    rest = length - cut
    second_hidden, second_logits = two.step_rows(
        prompt.tokens[cut:length],
        [prompt.blocks],
        list(range(cut + 1, length + 1)),
        [rest - 1],
        [rest],
    )
    assert size > 1 and cut + len(rows) >= size and rest >= size
    assert torch.equal(first_hidden[: len(rows)], hidden[: len(rows)])
    assert torch.equal(first_logits[: len(rows)], logits[: len(rows)])
    assert torch.equal(first_hidden[len(rows) :], hidden[len(rows) : len(rows) + cut])
    assert torch.equal(second_hidden, hidden[len(rows) + cut :])
    assert torch.equal(second_logits, logits[-1:])
    assert all(torch.equal(a, b) for a, b in zip(whole, halves, strict=True))


@pytest.mark.parametrize("isa", RUNNABLE_ISAS)
@pytest.mark.parametrize("decodes,length", [(4, 150), (0, 40), (12, 3)])
def test_only_the_logit_rows_past_the_last_attention_give_the_same_numbers(
    quantized_llama_one_head, isa, decodes, length
):
    """all_hidden=False (what the model runner asks for): the last layer's output and MLP
    products run for the logit rows alone. A fresh prompt's chunk beside `decodes` decode rows
    (logits of every decode row and the chunk's last token; then of none of them): the logit
    rows' hidden states, the logits and every layer's cache bit for bit what the whole step
    computes, the other rows' hidden states zeros. 150 + 4 rows multiply by lanes on AVX-512
    (the pruned layer's 5 rows too), 40 rows by panels or lanes, 3 + 12 rows by panels."""
    runner = runner_for(str(quantized_llama_one_head), isa, False)
    rows, prefix = make_rows(decodes, seed=80) if decodes else ([], [])
    prompt = fresh_prompt(rows, length, seed=81)
    whole = prefill(runner, rows, prefix) if rows else caches(runner)
    pruned_kv = copy_of(whole, runner)
    full, pruned = (
        FusedDecoder.build(runner.model, kv, runner.backend, runner.config)
        for kv in (whole, pruned_kv)
    )
    tokens, tables, lens, per_table, logit_rows = chunk_step(rows, prompt, 0, length)
    for wanted in (logit_rows, []):
        hidden, logits = full.step_rows(tokens, tables, lens, wanted, per_table)
        only_hidden, only_logits = pruned.step_rows(
            tokens, tables, lens, wanted, per_table, all_hidden=False
        )
        others = [r for r in range(len(tokens)) if r not in wanted]
        assert torch.equal(only_hidden[wanted], hidden[wanted])
        assert not only_hidden[others].any() and hidden[others].abs().sum() > 0
        assert (logits is None and only_logits is None) or torch.equal(only_logits, logits)
        assert all(torch.equal(a, b) for a, b in zip(whole, pruned_kv, strict=True))
