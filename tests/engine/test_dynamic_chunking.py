"""Dynamic chunking (itl_target_ms, and decode_stretch): exact prefill tokens per
step under a fake step model, the floor, the online correction, and unchanged greedy outputs
on the tiny checkpoint."""

from __future__ import annotations

import pytest

from engine import InvalidRequestError, LLMEngine, SamplingParams
from engine.chunk_budget import ChunkBudget, DecodeStretchBudget
from engine.step_model import StepModel, StepShape
from tests.engine.test_scheduler import make_request, make_scheduler, run_to_completion, step
from tests.helpers import random_prompts
from tests.helpers import run_to_completion as run_engine

# 10 ms a step, 1 ms a decode row, 0.1 ms a prefill token
LINEAR = StepModel({"const": 0.010, "decodes": 0.001, "prefill_tokens": 0.0001})
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def scheduler_with(model: StepModel, target_s: float, min_tokens: int = 4, **kw):
    sched = make_scheduler(num_blocks=1024, budget=2048, chunk=16, **kw)
    sched.budget = ChunkBudget(model, target_s, min_tokens)
    return sched


def test_prefill_fills_the_target_left_by_the_decodes():
    sched = scheduler_with(LINEAR, 0.050)
    sched.add(make_request("long", range(1000, 2000), max_tokens=1))
    # alone: 10 ms + n * 0.1 ms <= 50 ms -> 400 tokens (chunk_size 16 does not apply)
    assert run_to_completion(sched) == [{"long": 400}, {"long": 400}, {"long": 200}]

    for i in range(4):
        sched.add(make_request(f"d{i}", range(10 * i, 10 * i + 3), max_tokens=50))
    step(sched)  # the four 3-token prompts (prefill)
    sched.add(make_request("A", range(3000, 3900), max_tokens=1))
    # with 4 decodes: 10 + 4 + n * 0.1 <= 50 -> 360 tokens a step
    steps = [step(sched)[0].num_tokens for _ in range(3)]
    decodes = {f"d{i}": 1 for i in range(4)}
    assert steps == [decodes | {"A": 360}, decodes | {"A": 360}, decodes | {"A": 180}]


def test_chunks_share_the_target_in_order_and_attention_bounds_them():
    quadratic = StepModel({"prefill_attention": 1e-6})  # 1 us per query-key pair
    plan = ChunkBudget(quadratic, 0.010, 4).plan()
    assert plan.grant(0, 5000) == 140  # 140 * 141 / 2 = 9870 pairs; 141 tokens: 10011
    plan = ChunkBudget(quadratic, 0.010, 4).plan()
    assert plan.grant(1000, 5000) == 9  # 9 * 1000 + 45 = 9045 pairs; 10 tokens: 10055
    assert plan.grant(0, 5000) == 43  # the rest: 9045 + 43 * 44 / 2 = 9991; 44 tokens: 10035
    assert plan.grant(0, 5000) == 3  # 9991 + 6 = 9997 pairs; 4 tokens: 10001

    sched = scheduler_with(LINEAR, 0.050)
    sched.add(make_request("a", range(100, 350), max_tokens=1))
    sched.add(make_request("b", range(400, 1000), max_tokens=1))
    assert step(sched)[0].num_tokens == {"a": 250, "b": 150}  # 400 tokens in all


def test_floor_advances_one_prompt_when_decodes_fill_the_target(caplog):
    sched = scheduler_with(LINEAR, 0.005, min_tokens=4)  # the step's constant alone is 10 ms
    sched.add(make_request("a", range(100, 120), max_tokens=1))
    sched.add(make_request("b", range(200, 212), max_tokens=1))
    with caplog.at_level("WARNING", logger="engine.chunk_budget"):
        steps = run_to_completion(sched)
    assert steps == [{"a": 4}] * 5 + [{"b": 4}] * 3
    assert sched.budget.floor_overruns == 8  # every step: the floor alone is over the target
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [  # logged once a minute, not every step
        "itl_target_ms 5 cannot hold: a step with the smallest chunk (4 tokens after 0 "
        "cached) is predicted at 10 ms (1 such steps so far)"
    ]


def test_online_correction_scales_the_budget_by_the_measured_ratio():
    budget = ChunkBudget(LINEAR, 0.050, 4, alpha=0.25)
    prefill = StepShape.of(chunks=[(0, 400)])  # predicted 50 ms
    budget.observe(StepShape.of(decode_contexts=[5]), 1.0)  # a decode-only step: ignored
    assert budget.ratio == 1.0
    budget.observe(prefill, 0.100)  # measured twice the prediction
    assert budget.ratio == pytest.approx(1.25)
    assert budget.plan().grant(0, 5000) == 300  # 1.25 * (10 + 0.1 n) <= 50 ms
    budget.observe(prefill, 0.025)  # half the prediction: 1.25 + 0.25 * (0.5 - 1.25)
    assert budget.ratio == pytest.approx(1.0625)
    assert budget.plan().grant(0, 5000) == 370  # (50 / 1.0625 - 10) / 0.1 = 370.6
    budget.observe(prefill, 1e-9)  # an outlier moves the ratio at most 10x
    assert budget.ratio == pytest.approx(1.0625 + 0.25 * (0.10625 - 1.0625))


def test_plans_with_the_tail_of_recent_ratios():
    budget = ChunkBudget(LINEAR, 0.050, 4, alpha=0.25)
    prefill = StepShape.of(chunks=[(0, 400)])  # predicted 50 ms
    for _ in range(9):
        budget.observe(prefill, 0.050)
    assert budget.planning_ratio() == 1.0 and budget.plan().grant(0, 5000) == 400
    budget.observe(prefill, 0.100)  # one step twice as slow: the 90% quantile of 10 ratios
    assert budget.ratio == pytest.approx(1.25)
    assert budget.planning_ratio() == pytest.approx(2.0)
    assert budget.plan().grant(0, 5000) == 150  # 2 * (10 + 0.1 n) <= 50 ms
    for _ in range(10):  # 20 ratios, one slow: the quantile is 1.0 again, the EWMA decays
        budget.observe(prefill, 0.050)
    assert budget.ratio == pytest.approx(1 + 0.25 * 0.75**10)
    assert budget.planning_ratio() == budget.ratio
    assert budget.plan().grant(0, 5000) == 393  # (50 / 1.0141 - 10) / 0.1 = 393.0


def test_plans_steps_within_the_target_less_the_gaps_between_them():
    budget = ChunkBudget(LINEAR, 0.050, 4)
    for gap in (0.001, 0.002, 0.010, 0.003):  # fewer than MIN_TAIL_STEPS: no gap yet
        budget.observe(StepShape.of(decode_contexts=[5]), 0.011, gap)
    assert budget.step_limit_s() == 0.050
    assert budget.plan().grant(0, 5000) == 400  # 10 + 0.1 n <= 50 ms
    budget.observe(StepShape.of(decode_contexts=[5]), 0.011, None)  # not counted: idle before
    budget.observe(StepShape.of(decode_contexts=[5]), 0.011, 0.004)
    # gaps 1, 2, 10, 3, 4 ms: the 90% quantile is the largest, 10 ms
    assert budget.step_limit_s() == pytest.approx(0.040)
    assert budget.plan().grant(0, 5000) == 300  # 10 + 0.1 n <= 40 ms
    for _ in range(20):  # gaps longer than the target: at most half of it is given up
        budget.observe(StepShape.of(decode_contexts=[5]), 0.011, 0.200)
    assert budget.step_limit_s() == pytest.approx(0.025)


def test_decode_stretch_holds_prefill_steps_to_a_multiple_of_the_decode_step(caplog):
    sched = make_scheduler(num_blocks=1024, budget=2048, chunk=512)
    sched.budget = DecodeStretchBudget(LINEAR, 2.0, 4, chunk_size=512)
    sched.add(make_request("long", range(1000, 2000), max_tokens=1))
    # no decodes running: chunk_size, as without a budget
    assert run_to_completion(sched) == [{"long": 512}, {"long": 488}]

    for i in range(4):
        sched.add(make_request(f"d{i}", range(10 * i, 10 * i + 3), max_tokens=50))
    step(sched)  # the four 3-token prompts
    sched.add(make_request("A", range(3000, 3300), max_tokens=1))
    # decodes alone: 10 + 4 = 14 ms; with A: 10 + 4 + n * 0.1 <= 2 * 14 -> 140 tokens a step
    steps = [step(sched)[0].num_tokens for _ in range(3)]
    decodes = {f"d{i}": 1 for i in range(4)}
    assert steps == [decodes | {"A": 140}, decodes | {"A": 140}, decodes | {"A": 20}]

    # 1.01x leaves 0.14 ms (1 token): under the floor, a prompt still gets one block (4 tokens)
    # a step, counted, not logged (short decode steps make it common)
    sched.budget = DecodeStretchBudget(LINEAR, 1.01, 4, chunk_size=512)
    sched.add(make_request("B", range(4000, 4010), max_tokens=1))
    with caplog.at_level("WARNING", logger="engine.chunk_budget"):
        steps = [step(sched)[0].num_tokens for _ in range(3)]
    assert steps == [decodes | {"B": 4}, decodes | {"B": 4}, decodes | {"B": 2}]
    assert sched.budget.floor_overruns == 3 and not caplog.records
    with pytest.raises(ValueError, match="stretch > 1"):
        DecodeStretchBudget(LINEAR, 1.0, 4, chunk_size=512)


def test_engine_budget_by_its_options(tiny_llama):
    def budget(**options):
        engine = LLMEngine(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=64, **options)
        return engine.scheduler.budget

    assert budget() is None  # off by default: fixed chunk_size
    stretch = budget(decode_stretch=2)
    assert isinstance(stretch, DecodeStretchBudget) and stretch.stretch == 2.0
    assert stretch.chunk_size == 1024
    target = budget(itl_target_ms=40, decode_stretch=3)
    assert type(target) is ChunkBudget and target.target_s == pytest.approx(0.040)
    with pytest.raises(InvalidRequestError, match="decode_stretch 1 must be 0"):
        LLMEngine(tiny_llama, skip_tokenizer_init=True, decode_stretch=1)


def test_no_target_no_plan():
    sched = make_scheduler()
    sched.add(make_request("a", range(40), max_tokens=1))
    out = sched.schedule()
    assert sched.budget is None and out.plan is None and out.num_tokens == {"a": 16}


def test_engine_with_a_target_keeps_greedy_outputs(tiny_llama):
    prompts = random_prompts([300, 57, 21], seed=5)
    outputs = []
    for options in ({}, {"itl_target_ms": 1e-3}):
        engine = LLMEngine(
            tiny_llama,
            skip_tokenizer_init=True,
            block_size=8,
            num_kv_blocks=256,
            prefill_batch_tokens=2048,  # the three prompts may share a step
            **options,
        )
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, GREEDY)
        first = engine.step()
        tokens = {rid: out.new_token_ids for rid, out in first.outputs.items()}
        for rid, more in run_engine(engine).items():
            tokens[rid] = tokens.get(rid, []) + more
        outputs.append(tokens | {"first": first.scheduled})
        engine.check_integrity()
        floor_steps = engine.metrics.registry.get_sample_value("baton:itl_target_floor_steps_total")
        # a 1 us target: every step that took the floor chunk was predicted over it
        budget = engine.scheduler.budget
        assert floor_steps == (budget.floor_overruns if budget else 0)
        assert (floor_steps > 0) == bool(options)
    fixed, dynamic = outputs
    assert fixed.pop("first") == {"0": 300, "1": 57, "2": 21}
    assert dynamic.pop("first") == {"0": 8}  # the floor: one block a step
    assert dynamic == fixed and all(len(t) == 8 for t in fixed.values())


def test_engine_loads_the_profile_and_corrects_it_from_measured_steps(tiny_llama, tmp_path):
    StepModel({"prefill_tokens": 0.001}).save(tmp_path / "p.json")  # 1 ms a token
    engine = LLMEngine(
        tiny_llama,
        skip_tokenizer_init=True,
        block_size=8,
        num_kv_blocks=256,
        itl_target_ms=50,
        step_profile=str(tmp_path / "p.json"),
    )
    engine.add_request("a", random_prompts([120])[0], GREEDY)
    assert engine.step().scheduled == {"a": 50}
    assert engine.scheduler.budget.ratio != 1.0  # the tiny model runs far faster than 1 ms/token
    with pytest.raises(InvalidRequestError, match="step_profile"):
        LLMEngine(
            tiny_llama,
            skip_tokenizer_init=True,
            itl_target_ms=50,
            step_profile=str(tmp_path / "none.json"),
        )
    with pytest.raises(InvalidRequestError, match="itl_target_ms"):
        LLMEngine(tiny_llama, skip_tokenizer_init=True, itl_target_ms=0)
