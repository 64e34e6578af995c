"""The fused decode step (engine/model/decode_step.c) at one row: the same hidden states, logits
and KV cache contents as the unfused path step by step, the same greedy tokens (and
transformers'), and the unfused path wherever a step is not all decode tokens or the model
cannot run it. Several rows: test_fused_decode_rows.py."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention import build_metadata
from engine.attention.kv_layout import allocate_kv_cache
from engine.model import fused_decode
from engine.model.fused_decode import FusedDecoder
from engine.model.gguf_kernel import int8_isas
from engine.model.gguf_kernel import load_kernel as load_gguf_kernel
from engine.native import library_path, source_files
from tests.engine.test_gguf_blocks import VOCAB
from tests.engine.test_gguf_isa import RUNNABLE_ISAS as KERNEL_ISAS
from tests.helpers import hf_greedy, random_prompts

lib = fused_decode.load_kernel()
pytestmark = pytest.mark.skipif(lib is None, reason="no x86-64 AVX2/FMA/F16C CPU or C compiler")

OPTS = dict(skip_tokenizer_init=True, block_size=4, num_kv_blocks=64)
# the kernels of each instruction set this CPU runs; amx: AVX-512 with AMX for many rows and
# for single rows of Q8_0 weights (the tied output projection here)
RUNNABLE_ISAS = KERNEL_ISAS + (["amx"] if fused_decode.has_amx() else [])


@pytest.fixture(scope="module")
def engine_pair(quantized_llama):
    """(fused on, fused off) engines on the same checkpoint."""
    fused = LLM(str(quantized_llama), **OPTS)
    unfused = LLM(str(quantized_llama), fused_decode=False, **OPTS)
    assert fused.engine.runner.fused is not None
    assert unfused.engine.runner.fused is None
    return fused, unfused


def spy_steps(runner, monkeypatch) -> list[int | tuple[int, ...]]:
    """Records every fused step the runner takes: the sequence length of a one-row step, the
    tuple of its rows' sequence lengths for a step of several rows (a prompt's chunk: one row
    per token)."""
    calls: list[int | tuple[int, ...]] = []
    original = runner.fused.step_rows

    def step_rows(tokens, block_tables, seq_lens, logit_rows, rows_per_table=None, **options):
        calls.append(seq_lens[0] if len(seq_lens) == 1 else tuple(seq_lens))
        return original(tokens, block_tables, seq_lens, logit_rows, rows_per_table, **options)

    monkeypatch.setattr(runner.fused, "step_rows", step_rows)
    return calls


@pytest.fixture
def threads(request):
    """torch's (and so OpenMP's) thread count for one test, restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def compare_steps(runner, g: torch.Generator, tolerance: float):
    """Token by token over 14 positions (blocks of 4: three block boundaries, blocks out of
    order), a fused step over fresh caches against the runner's unfused model: final hidden
    state, logits and every layer's cache within `tolerance`. Returns (unfused, fused) caches."""
    model, a = runner.model, runner.model.args

    def caches() -> list[torch.Tensor]:
        return [
            allocate_kv_cache(16, 4, a.num_kv_heads, a.head_dim, torch.float32)
            for _ in range(a.num_layers)
        ]

    ref_caches, fused_caches = caches(), caches()
    fused = FusedDecoder.build(model, fused_caches, runner.backend, runner.config)
    assert fused is not None and fused.has_head
    blocks = [5, 2, 9, 0]
    tokens = torch.randint(0, VOCAB, (14,), generator=g).tolist()
    close = dict(rtol=tolerance, atol=tolerance)
    with torch.inference_mode():
        for p, token in enumerate(tokens):
            meta = build_metadata([1], [p + 1], [blocks], 4, torch.device("cpu"))
            ids, pos = torch.tensor([token]), torch.tensor([p])
            ref_hidden = model(ids, pos, ref_caches, meta, runner.backend)
            ref_logits = model.compute_logits(ref_hidden)
            hidden, logits = fused.step(token, blocks, p + 1)
            torch.testing.assert_close(hidden, ref_hidden, **close)
            torch.testing.assert_close(logits, ref_logits, **close)
            for ref, ours in zip(ref_caches, fused_caches, strict=True):
                torch.testing.assert_close(ours, ref, **close)
    return ref_caches, fused_caches


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("isa", RUNNABLE_ISAS)
def test_each_step_equals_the_unfused_path(quantized_llama, isa, threads):
    """Token by token over 14 positions (blocks of 4: three block boundaries, blocks out of
    order): final hidden state, logits and every layer's cache equal the unfused path's, on
    one thread and on two (rows and heads shared out, private copies of the small vectors)."""
    llm = LLM(str(quantized_llama), gguf_isa=isa, **OPTS)
    runner = llm.engine.runner
    model = runner.model
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # norm weights other than ones, so that each one's place matters
        for layer in model.layers:
            layer.input_layernorm.weight.uniform_(0.5, 1.5, generator=g)
            layer.post_attention_layernorm.weight.uniform_(0.5, 1.5, generator=g)
        model.norm.weight.uniform_(0.5, 1.5, generator=g)

    # values of order 1; the one difference in arithmetic is silu's exp (last bit), which
    # later layers' sums carry on at ~1e-6
    ref_caches, fused_caches = compare_steps(runner, g, tolerance=1e-5)
    # the first layer's keys and values come from the same operations, bit for bit
    assert torch.equal(fused_caches[0], ref_caches[0])
    assert fused_caches[0].abs().sum() > 0


INT8_ISAS = int8_isas(load_gguf_kernel()) if load_gguf_kernel() is not None else []


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("isa", INT8_ISAS)
def test_int8_steps_equal_the_unfused_int8_path(quantized_llama, isa, threads):
    """With int8_activations every product's input is quantized to int8 blocks inside the C
    step as the unfused int8 layers do it: logits and caches equal theirs, and greedy tokens."""
    int8 = dict(int8_activations=True, gguf_isa=isa, **OPTS)
    llm = LLM(str(quantized_llama), **int8)
    runner = llm.engine.runner
    assert runner.fused is not None and runner.fused.int8
    # the same integer dot products; AVX-512 VNNI sums the unfused row in zmm lanes, the fused
    # one in ymm lanes (another float order), and silu's exp (last bit)
    compare_steps(runner, torch.Generator().manual_seed(6), tolerance=1e-4)
    unfused = LLM(str(quantized_llama), fused_decode=False, **int8)
    prompts = random_prompts([5, 9], seed=11, vocab=VOCAB)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ours = [o.token_ids for o in llm.generate(prompts, greedy)]
    assert ours == [o.token_ids for o in unfused.generate(prompts, greedy)]


def test_greedy_tokens_equal_unfused_and_transformers(
    engine_pair, quantized_llama, hf_models, monkeypatch
):
    fused, unfused = engine_pair
    calls = spy_steps(fused.engine.runner, monkeypatch)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    hf = hf_models(str(quantized_llama))
    for prompt in random_prompts([1, 5, 9, 17, 150], seed=41, vocab=VOCAB):
        calls.clear()
        ours = fused.generate([prompt], params)[0].token_ids
        # the prompt's step (one row per token) and every decode step run fused
        prompt_step = tuple(range(1, len(prompt) + 1)) if len(prompt) > 1 else 1
        assert calls == [prompt_step, *range(len(prompt) + 1, len(prompt) + 12)]
        assert ours == unfused.generate([prompt], params)[0].token_ids
        assert ours == hf_greedy(hf, prompt, 12)
        # again: the prompt's full blocks now come from the prefix cache; the rest is computed
        calls.clear()
        assert fused.generate([prompt], params)[0].token_ids == ours
        cached = (len(prompt) - 1) // 4 * 4
        rest = tuple(range(cached + 1, len(prompt) + 1))
        assert calls[0] == (rest if len(rest) > 1 else rest[0])


def test_prompts_and_decodes_of_several_requests_run_fused(engine_pair, monkeypatch):
    fused, unfused = engine_pair
    calls = spy_steps(fused.engine.runner, monkeypatch)
    prompts = random_prompts([6, 6], seed=42, vocab=VOCAB)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    ours = [o.token_ids for o in fused.generate(prompts, params)]
    # both prompts in one C call (a row per token), then each step decodes both
    both_prompts = (*range(1, 7), *range(1, 7))
    assert calls == [both_prompts, (7, 7), (8, 8), (9, 9), (10, 10)]
    assert ours == [o.token_ids for o in unfused.generate(prompts, params)]
    # a longer request finishes alone: its last steps are one-row steps
    params_each = [params, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)]
    calls.clear()
    ours = [o.token_ids for o in fused.generate(prompts, params_each)]
    # the prompts' last blocks are computed again (their first full block is cached)
    rest = (5, 6, 5, 6)
    assert calls == [rest, (7, 7), (8, 8), (9, 9), (10, 10), 11, 12, 13]
    assert ours == [o.token_ids for o in unfused.generate(prompts, params_each)]


def test_sampled_requests_and_logprobs_match(engine_pair):
    fused, unfused = engine_pair
    prompt = random_prompts([7], seed=43, vocab=VOCAB)[0]
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=3, logprobs=2, ignore_eos=True)
    a, b = fused.generate([prompt], params)[0], unfused.generate([prompt], params)[0]
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert x.token_id == y.token_id and [t for t, _ in x.top] == [t for t, _ in y.top]
        assert x.logprob == pytest.approx(y.logprob, rel=1e-5, abs=1e-5)
        for (_, lx), (_, ly) in zip(x.top, y.top, strict=True):
            assert lx == pytest.approx(ly, rel=1e-5, abs=1e-5)


def test_models_it_cannot_run_keep_the_unfused_path(engine_pair, monkeypatch):
    runner = engine_pair[0].engine.runner
    args = (runner.model, runner.kv_caches, runner.backend)
    assert FusedDecoder.build(*args, runner.config) is not None
    off = dataclasses.replace(runner.config, fused_decode=False)
    assert FusedDecoder.build(*args, off) is None
    int8 = types.SimpleNamespace(int8_activations=True)
    assert FusedDecoder.build(*args, int8) is None  # the engine says int8, its layers do not
    monkeypatch.setattr(runner.model.layers[0].mlp.down_proj, "int8_activations", True, False)
    assert FusedDecoder.build(*args, runner.config) is None  # a layer with int8 products
    monkeypatch.undo()
    other = "avx512" if runner.model.layers[0].mlp.down_proj.isa == "avx2" else "avx2"
    monkeypatch.setattr(runner.model.layers[1].self_attn.o_proj, "isa", other)
    assert FusedDecoder.build(*args, runner.config) is None  # kernels on two ISAs
    monkeypatch.undo()
    torch_backend = types.SimpleNamespace(name="torch")
    assert FusedDecoder.build(runner.model, runner.kv_caches, torch_backend, None) is None
    hook = runner.model.layers[1].mlp.register_forward_hook(lambda *_: None)
    try:
        assert FusedDecoder.build(*args, runner.config) is None
    finally:
        hook.remove()
    dense = LLM(engine_pair[1].engine.model_dir, use_gguf_blocks=False, **OPTS)
    assert dense.engine.runner.fused is None  # no blocks: nothing for the C step to read


def test_library_key_covers_included_files(tmp_path):
    names = {p.name for p in source_files(fused_decode.SOURCE)}
    assert names == {
        "decode_step.c",
        "decode_matrix.c",
        "gguf_gemm.c",
        "gemm_lanes.c",
        "gemm_amx.c",
        "paged_decode.c",
        "paged_decode_span_loop.h",
        "window_amx.c",
        "rms_norm.c",
        "simd_math.h",
        "team_barrier.h",
    }
    (tmp_path / "part.c").write_text("int part(void) { return 1; }\n")
    main = tmp_path / "main.c"
    main.write_text('#include "part.c"\nint whole(void) { return part(); }\n')
    before = library_path(main)
    (tmp_path / "part.c").write_text("int part(void) { return 2; }\n")
    assert library_path(main) != before


def test_a_step_the_kernel_refuses_writes_nothing(engine_pair):
    runner = engine_pair[0].engine.runner
    before = [c.clone() for c in runner.kv_caches]
    assert runner.fused.step(VOCAB, [3], 1) is None  # no such token: C refuses (-1)
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_caches, strict=True))
    with pytest.raises(ValueError, match="cannot hold"):
        runner.fused.step(1, [3], 5)  # 5 tokens need 2 blocks of 4


def test_a_head_without_blocks_gets_its_logits_from_torch(engine_pair, monkeypatch):
    fused, unfused = engine_pair
    runner = fused.engine.runner
    monkeypatch.setattr(runner.model, "lm_head", runner.model.lm_head.dense)  # float32 only
    no_head = FusedDecoder.build(runner.model, runner.kv_caches, runner.backend, runner.config)
    assert no_head is not None and not no_head.has_head
    monkeypatch.setattr(runner, "fused", no_head)
    calls = spy_steps(runner, monkeypatch)
    prompt = random_prompts([6], seed=44, vocab=VOCAB)[0]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert fused.generate([prompt], params)[0].token_ids == (
        unfused.generate([prompt], params)[0].token_ids
    )
    assert calls == [tuple(range(1, 7)), 7, 8, 9, 10, 11]
