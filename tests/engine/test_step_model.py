"""Step-time model: shapes, exact least-squares fits, JSON, profile lookup, and the profiler
(perf/profiler.py --quick) end to end on the tiny checkpoint."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

import engine
from engine import step_model
from engine.step_model import (
    FALLBACK,
    PROFILE_DIR_ENV,
    SHIPPED_PROFILES_DIR,
    SMALL_STEP_ROWS,
    StepModel,
    StepShape,
    find_step_model,
    fit_with_holdout,
    profile_key,
    profile_path,
    user_profile_dir,
)
from perf import profiler as profile

SHIPPED = SHIPPED_PROFILES_DIR / "smollm2-135m-instruct-float32-cpu-1t.json"

TRUE = {
    "const": 0.004,
    "prefill_tokens": 2e-4,
    "prefill_chunks": 1e-3,
    "prefill_attention": 3e-8,
    "decodes": 5e-4,
    "decode_context": 1e-7,
    "prefill_context": 2e-6,
    "small_rows": 3e-3,
    "multi_row": 5e-3,
    "large_step": 2e-2,
}


def grid_shapes() -> list[StepShape]:
    return [
        StepShape.of([ctx] * d, [(c, p)] if p else [])
        for d, ctx in ((0, 0), (1, 50), (4, 100), (8, 900), (16, 300))
        for p in (0, 16, 256, 1000)
        for c in (0, 500, 2000)
        if d or p
    ]


def test_shape_counts_attention_pairs_and_decode_keys():
    shape = StepShape.of(decode_contexts=[10, 20], chunks=[(100, 4), (0, 3)])
    assert shape == StepShape(
        prefill_tokens=7,
        prefill_chunks=2,
        prefill_attention=(4 * 100 + 10) + 6,  # token i of a chunk after c reads c + i + 1 keys
        decodes=2,
        decode_context=11 + 21,
        prefill_context=100 + 0,  # cached keys the chunks attend to
    )


def test_small_and_large_steps_are_the_gguf_kernels_regimes():
    from engine.model.gguf_linear import QUANT_MAX_ROWS

    assert SMALL_STEP_ROWS == QUANT_MAX_ROWS
    model = StepModel({"small_rows": 1.0, "multi_row": 0.5, "large_step": 10.0})
    predicted = [model.predict(StepShape.of([5] * d)) for d in (1, 2, 8, 9, 30)]
    assert predicted == [1, 2.5, 8.5, 18.5, 18.5]
    assert model.predict(StepShape.of([5] * 3, [(0, 4)])) == 7.5  # rows: decodes + chunk


def test_fit_recovers_the_coefficients_of_noise_free_steps():
    true = StepModel(TRUE)
    samples = [(s, true.predict(s)) for s in grid_shapes()]
    fitted = fit_with_holdout(samples, key={"model": "m"})
    assert fitted.coefficients == pytest.approx(TRUE, rel=1e-6)
    assert fitted.error["held_out"] == len(samples) // 4
    assert fitted.error["max_rel"] < 1e-9 and fitted.error["mean_rel"] < 1e-9
    assert fitted.key == {"model": "m"}


def test_fit_keeps_coefficients_non_negative():
    # Step time falls with decode context in these (nonsense) samples: that feature is dropped.
    samples = [
        (StepShape.of([ctx], [(0, p)]), 0.01 + p * 1e-4 - ctx * 1e-7)
        for p, ctx in ((16, 0), (64, 1000), (256, 5000), (512, 100), (128, 3000), (32, 7000))
    ]
    fitted = StepModel.fit(samples)
    assert fitted.coefficients["decode_context"] == 0.0
    assert all(v >= 0 for v in fitted.coefficients.values())


def test_json_round_trip_and_unknown_coefficients(tmp_path):
    model = StepModel(TRUE, key={"model": "m", "threads": 1}, error={"mean_rel": 0.1}, note="n")
    model.save(tmp_path / "p.json")
    assert StepModel.load(tmp_path / "p.json") == model
    with pytest.raises(ValueError, match="flops"):
        StepModel.from_json({"coefficients": {"flops": 1.0}})


def test_profile_key_names_model_dtype_device_and_threads():
    assert profile_key("smollm2-135m-instruct", "float32", "cpu", 1) == (
        "smollm2-135m-instruct-float32-cpu-1t"
    )
    assert profile_key("/m/SmolLM2-135M.Q4_1.gguf", "float32", "cpu", 2) == (
        "smollm2-135m.q4-1-float32-cpu-2t"
    )
    assert profile_key("/models/Llama-3/", "bfloat16", "NVIDIA H200", None) == (
        "llama-3-bfloat16-nvidia-h200"
    )


@pytest.fixture
def profile_dir(tmp_path, monkeypatch) -> Path:
    """The user's profile directory of this test ($BATON_PROFILE_DIR), not yet created."""
    path = tmp_path / "user-profiles"
    monkeypatch.setenv(PROFILE_DIR_ENV, str(path))
    return path


def test_the_shipped_profiles_are_package_data_of_the_engine():
    assert SHIPPED_PROFILES_DIR == Path(engine.__file__).resolve().parent / "profiles"
    names = sorted(p.name for p in SHIPPED_PROFILES_DIR.glob("*.json"))
    assert names == [
        "smollm2-135m-instruct-float32-cpu-1t.json",
        "smollm2-135m-instruct-float32-cpu-2t.json",
    ]
    for path in SHIPPED_PROFILES_DIR.glob("*.json"):
        assert StepModel.load(path).key["model"] == "smollm2-135m-instruct"


def test_user_profile_dir_is_the_variable_else_the_cache(monkeypatch):
    monkeypatch.setenv(PROFILE_DIR_ENV, "/data/profiles")
    assert user_profile_dir() == Path("/data/profiles")
    monkeypatch.delenv(PROFILE_DIR_ENV)
    monkeypatch.setenv("HOME", "/home/someone")
    assert user_profile_dir() == Path("/home/someone/.cache/baton/profiles")


def test_lookup_order_path_then_users_then_shipped(profile_dir, tmp_path):
    key = SHIPPED.stem
    assert profile_path(key) == SHIPPED  # no user directory yet
    assert find_step_model(None, key) == StepModel.load(SHIPPED)
    StepModel(TRUE, note="the user's").save(profile_dir / f"{key}.json")
    assert profile_path(key) == profile_dir / f"{key}.json"
    assert find_step_model(None, key) == StepModel(TRUE, note="the user's")
    StepModel(FALLBACK.coefficients).save(tmp_path / "mine.json")
    assert find_step_model(str(tmp_path / "mine.json"), key) == StepModel(FALLBACK.coefficients)
    with pytest.raises(FileNotFoundError, match="missing.json"):
        find_step_model(str(tmp_path / "missing.json"), key)
    # a user profile of another key hides nothing
    assert find_step_model(None, "smollm2-135m-instruct-float32-cpu-2t") == StepModel.load(
        SHIPPED_PROFILES_DIR / "smollm2-135m-instruct-float32-cpu-2t.json"
    )


def test_no_profile_is_the_fallback_with_one_warning_per_key(profile_dir, caplog):
    step_model._warn_fallback.cache_clear()
    with caplog.at_level(logging.WARNING, logger="engine.step_model"):
        for _ in range(3):
            assert find_step_model(None, "no-such-model-float32-cpu-1t") is FALLBACK
        assert find_step_model(None, "other-model-float32-cpu-1t") is FALLBACK
    assert [r.getMessage() for r in caplog.records] == [
        f"no step-time profile {key}.json in {profile_dir} or {SHIPPED_PROFILES_DIR}: using the "
        "built-in fallback (corrected online from measured steps); `baton profile` measures "
        "this engine's"
        for key in ("no-such-model-float32-cpu-1t", "other-model-float32-cpu-1t")
    ]


def test_profiler_quick_grid_writes_a_loadable_profile(tiny_llama, profile_dir, capsys):
    threads = torch.get_num_threads()  # the profiler sets 1; later tests get theirs back
    try:
        assert profile.main(["--model", tiny_llama, "--quick", "--repeats", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    # written to the user's directory under the engine's key, found there by its engines
    out = profile_dir / f"{profile_key(tiny_llama, 'float32', 'cpu', 1)}.json"
    assert sorted(profile_dir.iterdir()) == [out]
    assert profile_path(out.stem) == out
    data = json.loads(out.read_text())
    grid = profile.QUICK
    decode_batches = sum(1 for d, _ in grid.decodes if d)
    points = len(grid.decodes) * len(grid.prefill) * len(grid.context) + decode_batches
    points += len(grid.decode_only)  # one decode-only step each
    assert len(data["points"]) == points
    alone = [(p["decodes"], p["decode_len"]) for p in data["points"] if p["prefill"] == 0]
    assert set(grid.decode_only) <= set(alone)
    assert data["key"]["dtype"] == "float32" and data["key"]["device"] == "cpu"
    assert data["error"]["held_out"] == points // 4
    model = StepModel.load(out)
    assert all(v >= 0 for v in model.coefficients.values())
    assert "held-out error" in capsys.readouterr().out

    # --refit: the same fit from the stored points (an older form's coefficients replaced),
    # and a calibrated control path in the file is kept
    data["coefficients"] = {"const": 1.0}
    data["request_overhead_ms"] = {"local": 12.5, "remote": 40.0}
    out.write_text(json.dumps(data))
    assert profile.main(["--refit", str(out)]) == 0
    refitted = json.loads(out.read_text())
    assert StepModel.load(out).coefficients == model.coefficients
    assert refitted["request_overhead_ms"] == {"local": 12.5, "remote": 40.0}
    assert refitted["points"] == data["points"] and refitted["key"] == data["key"]


def test_refit_writes_to_the_users_directory_never_beside_the_source(profile_dir, tmp_path):
    shipped = SHIPPED.read_bytes()
    out = tmp_path / "elsewhere.json"
    assert profile.main(["--refit", str(SHIPPED), "--out", str(out)]) == 0
    assert profile.main(["--refit", str(SHIPPED)]) == 0
    assert SHIPPED.read_bytes() == shipped
    written = profile_dir / SHIPPED.name
    assert json.loads(written.read_text()) == json.loads(out.read_text())
    data, source = json.loads(written.read_text()), json.loads(shipped)
    assert (
        data["request_overhead_ms"]
        == source["request_overhead_ms"]
        == {
            "local": 0.7,
            "remote": 5.3,
        }
    )
    assert data["points"] == source["points"] and data["key"] == source["key"]
    assert data["coefficients"] == pytest.approx(source["coefficients"], rel=1e-6, abs=1e-12)
