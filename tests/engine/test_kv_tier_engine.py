"""A KV tier wired into the engine: blocks evicted from a small device cache are loaded back
from the tier (not recomputed) and give exactly the tokens of an engine without a tier."""

from __future__ import annotations

import pytest
import torch

from deploy.manifest import ManifestError, parse_manifest
from engine import InvalidRequestError, LLMEngine, SamplingParams
from engine.block_hash import hash_prompt_blocks
from engine.block_pool import KVEvent
from engine.kv_tier import TIERS
from engine.options import KV_TIER_NAMES
from engine.request import RequestStatus
from tests.deploy.test_manifest import with_change
from tests.helpers import random_prompts

BS = 4
OPTS = dict(skip_tokenizer_init=True, block_size=BS, chunk_size=16, num_kv_blocks=12)
PROMPT, OTHER, SHORT = random_prompts([27, 40, 5], seed=21)
SEED_OF = {"a": 11, "b": 12, "c": 13, "a2": 11}  # a2 repeats a: same prompt, same seed


def params(sampled: bool, rid: str, max_tokens: int = 3) -> SamplingParams:
    if not sampled:
        return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return SamplingParams(
        max_tokens=max_tokens, temperature=1.0, seed=SEED_OF[rid], ignore_eos=True
    )


def step(engine: LLMEngine, tokens: dict, computed: dict, events: list) -> list[str]:
    """One step, gathering tokens, the tokens the model computed per request and KV events;
    returns the ids scheduled."""
    result = engine.step()
    for rid, n in result.scheduled.items():
        computed[rid] = computed.get(rid, 0) + n
    for rid, out in result.outputs.items():
        tokens.setdefault(rid, []).extend(out.new_token_ids)
    events.extend(result.kv_events)
    return list(result.scheduled)


def steps(engine: LLMEngine, tokens: dict, computed: dict, events: list) -> None:
    """Step until done."""
    while engine.has_unfinished():
        step(engine, tokens, computed, events)
    engine.check_integrity()


def evict_prompt(
    engine: LLMEngine, sampled: bool, tokens: dict, computed: dict, events: list
) -> dict[int, torch.Tensor]:
    """Run a, then b (whose blocks evict a's prefix from the 12-block device cache); returns
    the KV of a's full prompt blocks by hash as a computed it."""
    engine.add_request("a", PROMPT, params(sampled, "a"))
    steps(engine, tokens, computed, events)
    computed_kv = device_kv(engine, hash_prompt_blocks(PROMPT, BS, engine.config.hash_seed))
    engine.add_request("b", OTHER, params(sampled, "b", max_tokens=2))
    steps(engine, tokens, computed, events)
    if engine.kv_tier is not None:
        assert engine.kv_tier.flush(timeout=30)
        events.extend(engine.take_kv_events())  # the tier's stored events since the last step
    return computed_kv


def device_kv(engine: LLMEngine, hashes: list[int]) -> dict[int, torch.Tensor]:
    """A copy of the KV [L, 2, BS, KVH, D] of each device-cached block among `hashes`."""
    by_hash = {b.block_hash: b.block_id for b in engine.pool.cached_blocks()}
    return {
        h: torch.stack([layer[:, by_hash[h]] for layer in engine.kv_caches]).clone()
        for h in hashes
        if h in by_hash
    }


@pytest.fixture
def tier_options(request, tmp_path) -> dict:
    kind = request.param
    extra = {"kv_tier_path": str(tmp_path / "tier")} if kind == "disk" else {}
    return dict(kv_tier=kind, kv_tier_bytes=1 << 20, **extra)


@pytest.mark.parametrize("tier_options", ["host", "disk"], indirect=True)
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_a_prefix_evicted_to_the_tier_loads_back_and_gives_the_same_tokens(
    tiny_llama, tier_options, sampled
):
    reference = LLMEngine(tiny_llama, **OPTS)
    ref_tokens, ref_computed = {}, {}
    evict_prompt(reference, sampled, ref_tokens, ref_computed, [])
    reference.add_request("a2", PROMPT, params(sampled, "a2"))
    reference.add_request("c", SHORT, params(sampled, "c"))
    steps(reference, ref_tokens, ref_computed, [])

    engine = LLMEngine(tiny_llama, **OPTS, **tier_options)
    tier = engine.kv_tier
    tokens, computed, events = {}, {}, []
    computed_kv = evict_prompt(engine, sampled, tokens, computed, events)
    hashes = hash_prompt_blocks(PROMPT, BS, engine.config.hash_seed)  # 6 full blocks
    assert set(computed_kv) == set(hashes)
    # a's head block is still on the device; blocks 1..5 (and a's 7th) went to the tier.
    assert engine.pool.cached_hashes() & set(hashes) == {hashes[0]}
    assert set(hashes[1:]) <= set(tier.held_hashes())
    medium = tier.medium
    assert KVEvent("removed", (hashes[1],)) in events
    assert KVEvent("stored", (hashes[1],), hashes[0], medium=medium) in events

    tier.pause_loads()  # a2 waits for its blocks while c runs
    engine.add_request("a2", PROMPT, params(sampled, "a2"))
    engine.add_request("c", SHORT, params(sampled, "c"))
    assert step(engine, tokens, computed, events) == ["c"]
    a2 = engine.scheduler.requests["a2"]
    assert a2.status == RequestStatus.WAITING_FOR_TIER_KV and a2.num_computed_tokens == BS
    assert step(engine, tokens, computed, events) == ["c"]
    engine.check_integrity()
    events.clear()
    tier.resume_loads()
    steps(engine, tokens, computed, events)

    assert tokens == ref_tokens
    # a2: 1 device block + 5 tier blocks = 24 tokens not computed; 3 prompt tokens + 2 decodes.
    assert computed["a2"] == 27 - 24 + 2
    assert ref_computed["a2"] == 27 - 4 + 2  # without the tier only the device block is reused
    s = tier.stats()
    assert (s.loads, s.blocks_read) == (1, 5)
    # Loaded blocks are cached on the device again, announced as such.
    stored = {
        h for e in events if e.kind == "stored" and e.medium == "device" for h in e.block_hashes
    }
    assert set(hashes[1:6]) <= stored
    assert set(hashes) <= engine.pool.cached_hashes()
    loaded_kv = device_kv(engine, hashes)
    for h in hashes:  # the bytes a computed, back in place bit for bit
        assert torch.equal(loaded_kv[h].view(torch.int32), computed_kv[h].view(torch.int32))
    engine.check_integrity()
    tier.check_integrity()
    engine.close()


def test_a_block_that_fails_to_load_is_computed_instead(tiny_llama, tmp_path):
    opts = dict(OPTS, kv_tier="disk", kv_tier_bytes=1 << 20, kv_tier_path=str(tmp_path / "t"))
    reference = LLMEngine(tiny_llama, **OPTS)
    ref_tokens = {}
    evict_prompt(reference, False, ref_tokens, {}, [])
    reference.add_request("a2", PROMPT, params(False, "a2"))
    steps(reference, ref_tokens, {}, [])

    engine = LLMEngine(tiny_llama, **opts)
    tokens, computed = {}, {}
    evict_prompt(engine, False, tokens, computed, [])
    hashes = hash_prompt_blocks(PROMPT, BS, engine.config.hash_seed)
    path = engine.kv_tier.file_of(hashes[3])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # the payload of a's 4th block
    path.write_bytes(bytes(data))
    engine.add_request("a2", PROMPT, params(False, "a2"))
    steps(engine, tokens, computed, [])
    assert tokens == ref_tokens
    # device block 0, tier blocks 1 and 2 loaded, block 3 corrupt: 12 tokens reused
    assert computed["a2"] == 27 - 12 + 2
    s = engine.kv_tier.stats()
    assert (s.blocks_read, s.corrupted_dropped) == (2, 1)
    engine.close()


def test_a_restarted_engine_serves_the_prefix_from_its_disk_tier(tiny_llama, tmp_path):
    opts = dict(OPTS, kv_tier="disk", kv_tier_bytes=1 << 20, kv_tier_path=str(tmp_path / "t"))
    first = LLMEngine(tiny_llama, **opts)
    tokens = {}
    first.add_request("a", PROMPT, params(False, "a"))
    steps(first, tokens, {}, [])
    first.close()  # writes the device's cached blocks to the tier
    hashes = hash_prompt_blocks(PROMPT, BS, first.config.hash_seed)

    second = LLMEngine(tiny_llama, **opts)
    assert set(hashes) <= set(second.kv_tier.held_hashes())
    events = second.take_kv_events()  # what a restarted worker publishes
    assert {h for e in events for h in e.block_hashes} == set(second.kv_tier.held_hashes())
    assert all(e.kind == "stored" and e.medium == "disk" for e in events)
    again, computed = {}, {}
    second.add_request("a", PROMPT, params(False, "a"))
    steps(second, again, computed, [])
    assert again == tokens
    assert computed["a"] == 27 - 24 + 2  # all 6 full prompt blocks came from the tier
    with pytest.raises(InvalidRequestError, match="in use by another engine"):
        LLMEngine(tiny_llama, **opts)
    second.close()


def test_abort_of_a_loading_request_frees_its_blocks(tiny_llama):
    engine = LLMEngine(tiny_llama, **OPTS, kv_tier="host", kv_tier_bytes=1 << 20)
    evict_prompt(engine, False, {}, {}, [])
    engine.kv_tier.pause_loads()
    engine.add_request("a2", PROMPT, params(False, "a2"))
    assert engine.step().scheduled == {}
    assert engine.scheduler.requests["a2"].status == RequestStatus.WAITING_FOR_TIER_KV
    assert engine.abort("a2")  # the queued load is dropped, not waited for
    out = engine.step().outputs["a2"]
    assert out.finished and out.finish_reason == "abort"
    assert not engine.has_unfinished()
    engine.check_integrity()
    assert engine.pool.num_free_blocks == 12
    engine.kv_tier.resume_loads()
    engine.kv_tier.check_integrity()
    engine.close()


def test_a_tier_smaller_than_a_block_is_refused(tiny_llama):
    # tiny Llama, block_size 4: 2 layers * 2 * 4 tokens * 2 KV heads * 16 dims * 4 bytes
    with pytest.raises(
        InvalidRequestError, match=r"kv_tier_bytes=100 is smaller than one KV block \(2048 bytes\)"
    ):
        LLMEngine(tiny_llama, **OPTS, kv_tier="host", kv_tier_bytes=100)


@pytest.mark.parametrize("queue_blocks", [3, None], ids=["3-blocks", "default"])
def test_the_write_queue_holds_kv_tier_write_queue_bytes_of_blocks(tiny_llama, queue_blocks):
    """Blocks evicted while the writer is held up wait in a queue of
    kv_tier_write_queue_bytes: past it they are dropped (counted), within it all are stored."""
    block_bytes = 2048  # tiny Llama, block_size 4 (see the test above)
    extra = {}
    if queue_blocks is not None:
        extra["kv_tier_write_queue_bytes"] = queue_blocks * block_bytes + 1
    engine = LLMEngine(tiny_llama, **OPTS, kv_tier="host", kv_tier_bytes=1 << 20, **extra)
    engine.kv_tier.pause_writes()
    engine.add_request("a", PROMPT, params(False, "a"))
    steps(engine, {}, {}, [])
    engine.add_request("b", OTHER, params(False, "b", max_tokens=2))
    steps(engine, {}, {}, [])
    evicted = engine.pool.stats.evictions
    assert evicted >= 6  # a's prompt blocks, at least
    engine.kv_tier.resume_writes()
    assert engine.kv_tier.flush(timeout=30)
    stats = engine.kv_tier.stats()
    stored = evicted if queue_blocks is None else queue_blocks
    assert (stats.num_blocks, stats.dropped_writes) == (stored, evicted - stored)
    engine.close()


def test_kv_tier_options_are_checked_in_the_engine_and_the_manifest():
    from engine.config import EngineConfig

    assert set(KV_TIER_NAMES) == {"none", *TIERS}
    with pytest.raises(InvalidRequestError, match="kv_tier_path is required when kv_tier is disk"):
        EngineConfig(kv_tier="disk")
    with pytest.raises(InvalidRequestError, match="needs enable_prefix_caching"):
        EngineConfig(kv_tier="host", enable_prefix_caching=False)
    with pytest.raises(ManifestError, match="kv_tier_path is required"):
        parse_manifest(with_change("spec.engine.kv_tier", "disk"))
    spec = parse_manifest(with_change("spec.engine", {"kv_tier": "host", "kv_tier_bytes": 1024}))
    assert (spec.spec.engine.kv_tier, spec.spec.engine.kv_tier_bytes) == ("host", 1024)


def test_tier_metrics_are_on_the_engine_registry(tiny_llama):
    from engine.metrics import snapshot

    engine = LLMEngine(tiny_llama, **OPTS, kv_tier="host", kv_tier_bytes=1 << 20)
    evict_prompt(engine, False, {}, {}, [])
    engine.add_request("a2", PROMPT, params(False, "a2"))
    steps(engine, {}, {}, [])
    samples = {
        (name, tuple(sorted(labels.items()))): value
        for family in snapshot(engine.metrics.registry)
        for name, labels, value in family["samples"]
    }
    s = engine.kv_tier.stats()
    host = (("medium", "host"),)
    assert samples[("baton:kv_tier_read_bytes_total", host)] == s.bytes_read
    assert s.bytes_read == 5 * engine.runner.block_bytes()
    assert samples[("baton:kv_tier_usage_bytes", host)] == s.usage_bytes > 0
    assert samples[("baton:kv_tier_hits_total", host)] == s.hits
    assert samples[("baton:kv_tier_load_seconds_count", host)] == 1
    reason = (("medium", "host"), ("reason", "corrupted"))
    assert samples[("baton:kv_tier_dropped_files_total", reason)] == 0
    engine.close()


def test_the_model_fingerprint_follows_the_weights_and_the_arithmetic(tmp_path):
    from engine.kv_tier.fingerprint import SAMPLE_LIMIT, model_fingerprint

    (tmp_path / "config.json").write_text('{"hidden_size": 64}')
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(bytes(range(256)) * (SAMPLE_LIMIT // 128))  # sampled, not hashed whole
    base = model_fingerprint(tmp_path, dtype="float32")
    assert model_fingerprint(tmp_path, dtype="float32") == base
    assert model_fingerprint(tmp_path, dtype="bfloat16") != base
    data = bytearray(weights.read_bytes())
    data[0] ^= 1  # the first sampled chunk
    weights.write_bytes(bytes(data))
    assert model_fingerprint(tmp_path, dtype="float32") != base
    (tmp_path / "config.json").write_text('{"hidden_size": 65}')
    assert model_fingerprint(tmp_path, dtype="float32") != base
