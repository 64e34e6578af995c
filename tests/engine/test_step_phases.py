"""The engine step's phase timers: per step, the phases add up to the step's wall time, on the
per-operation path and on the fused decode path (whose C part timers split its forward into
products, attention and norms); the token-time record names every sampled token once."""

from __future__ import annotations

import pytest

from engine import LLMEngine, SamplingParams
from engine.step_phases import PHASES, StepPhases, TokenTimes
from tests.engine.test_gguf_blocks import VOCAB
from tests.helpers import random_prompts

OPTS = dict(skip_tokenizer_init=True, block_size=4, num_kv_blocks=128, chunk_size=16)


def sample(engine: LLMEngine, name: str, labels: dict | None = None) -> float:
    v = engine.metrics.registry.get_sample_value(f"baton:{name}", labels or {})
    return 0.0 if v is None else v


def run_steps(engine: LLMEngine) -> tuple[list[dict[str, float]], list[float], dict]:
    """Step to completion: each step's phases and wall time (from the step histogram's
    rise), and the tokens each request got."""
    phases, walls, tokens = [], [], {}
    while engine.has_unfinished():
        before = sample(engine, "engine_step_duration_seconds_sum")
        result = engine.step()
        for rid, out in result.outputs.items():
            tokens.setdefault(rid, []).extend(out.new_token_ids)
        if result.scheduled:
            phases.append(dict(engine.phases.seconds))
            walls.append(sample(engine, "engine_step_duration_seconds_sum") - before)
    return phases, walls, tokens


def start(engine: LLMEngine, lengths: list[int], max_tokens: int) -> list[str]:
    ids = []
    for i, prompt in enumerate(random_prompts(lengths, seed=11, vocab=VOCAB)):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        engine.add_request(f"r{i}", prompt, params)
        ids.append(f"r{i}")
    return ids


@pytest.mark.parametrize("fused", [False, True])
def test_phases_add_up_to_each_step(quantized_llama, fused):
    engine = LLMEngine(str(quantized_llama), fused_decode=fused, **OPTS)
    engine.token_times = TokenTimes()
    ids = start(engine, [9, 23, 14], max_tokens=5)
    phases, walls, tokens = run_steps(engine)

    assert set(phases[0]) == set(PHASES)
    for step, wall in zip(phases, walls, strict=True):
        assert sum(step.values()) == pytest.approx(wall, rel=1e-9, abs=1e-9)
        assert step["schedule"] > 0 and step["inputs"] > 0 and step["sample"] > 0
        assert step["grammar"] == 0  # no structured outputs
    decode_steps = phases[-4:]  # the last 4 steps: one token per row, every row decoding
    split = [s["matmul"] > 0 and s["attention"] > 0 and s["norms"] > 0 for s in decode_steps]
    assert split == [fused] * 4  # only the fused C step splits its forward
    # Over the run the exported histogram sums agree with the step histogram's sum.
    total = sum(sample(engine, "engine_step_phase_seconds_sum", {"phase": p}) for p in PHASES)
    assert total == pytest.approx(sample(engine, "engine_step_duration_seconds_sum"), rel=1e-9)
    assert sample(engine, "engine_step_phase_seconds_count", {"phase": "schedule"}) == len(walls)
    # Each step after the first left work: one gap each.
    assert sample(engine, "engine_step_gap_seconds_count") == len(walls) - 1

    recorded = engine.token_times.take()
    assert sorted((rid, i) for rid, i, _ in recorded) == sorted(
        (rid, i) for rid in ids for i in range(len(tokens[rid]))
    )
    times = [t for _, _, t in recorded]
    assert times == sorted(times)
    assert len(set(times)) == len(walls)  # one end time per step that sampled


def test_lap_timer_moves_part_times_between_phases():
    phases = StepPhases()
    phases.begin(0.0)
    phases.seconds["forward"] = 0.010
    phases.move("forward", "matmul", 0.007)
    assert phases.seconds["forward"] == pytest.approx(0.003)
    assert phases.seconds["matmul"] == pytest.approx(0.007)
    phases.begin()
    assert set(phases.seconds.values()) == {0.0}
    end = phases.lap("kv")
    assert phases.seconds["kv"] >= 0 and end > 0


def test_grammar_masks_are_their_own_phase(tiny_llama_tok):
    engine = LLMEngine(tiny_llama_tok, num_kv_blocks=64, block_size=4)
    params = SamplingParams(max_tokens=6, temperature=0.0, structured_output={"regex": "a+"})
    engine.add_request("r", [5, 6, 7, 8], params)
    phases, walls, tokens = run_steps(engine)
    assert len(tokens["r"]) >= 1
    masked = [s["grammar"] > 0 for s in phases]
    assert all(masked)  # every step of a constrained request fills its bitmask
    for step, wall in zip(phases, walls, strict=True):
        assert sum(step.values()) == pytest.approx(wall, rel=1e-9, abs=1e-9)
    grammar = sample(engine, "engine_step_phase_seconds_sum", {"phase": "grammar"})
    assert grammar == pytest.approx(sum(s["grammar"] for s in phases), rel=1e-9)
