"""Engine hooks for disaggregation: a prefill engine's KV copied into a decode engine's
reserved blocks continues exactly like the colocated engine (transport-free here)."""

from __future__ import annotations

import pytest

from engine import CapacityError, LLMEngine, SamplingParams
from tests.helpers import random_prompts, run_to_completion

OPTS = dict(skip_tokenizer_init=True, block_size=4, chunk_size=16)


def copy_blocks(src: LLMEngine, src_ids: list[int], dst: LLMEngine, dst_ids: list[int]) -> None:
    for s_layer, d_layer in zip(src.kv_caches, dst.kv_caches, strict=True):
        d_layer[:, dst_ids] = s_layer[:, src_ids]


def disaggregated(prefill: LLMEngine, decode: LLMEngine, prompts, params) -> dict:
    """Prefill everything on `prefill`, move the missing blocks, decode on `decode`."""
    moved = {}
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        prefill.add_request(str(i), p, sp, prefill_only=True)
    seeds = {str(i): prefill.seed_of(str(i)) for i in range(len(prompts))}
    firsts = {}
    while prefill.has_unfinished():
        for rid, out in prefill.step().outputs.items():
            assert out.finish_reason == "prefilled"
            firsts[rid] = out.new_token_ids[0]
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        rid = str(i)
        dst_ids, n_hit = decode.reserve_remote(rid, p, sp, seeds[rid])
        src_ids = prefill.held_block_ids(rid)
        assert len(src_ids) == len(dst_ids)
        copy_blocks(prefill, src_ids[n_hit:], decode, dst_ids[n_hit:])
        moved[rid] = len(dst_ids) - n_hit
        decode.complete_remote(rid, firsts[rid])
        assert prefill.release_held(rid)
    prefill.check_integrity()
    return run_to_completion(decode), moved


@pytest.mark.parametrize("sampled", [False, True])
def test_disaggregated_equals_colocated(tiny_llama, sampled):
    prompts = random_prompts([5, 23, 40, 9], seed=31)
    params = [
        SamplingParams(
            max_tokens=9,
            ignore_eos=True,
            temperature=1.0 if sampled else 0,
            seed=7 + i if sampled else None,
        )
        for i in range(4)
    ]
    check_disaggregated_equals_colocated(tiny_llama, prompts, params)


def check_disaggregated_equals_colocated(model: str, prompts, params) -> None:
    """The tokens of one engine equal those of a prefill engine handing off to a decode
    engine, and both engines free every block afterwards."""
    colocated = LLMEngine(model, num_kv_blocks=128, **OPTS)
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        colocated.add_request(str(i), p, sp)
    expected = run_to_completion(colocated)
    prefill = LLMEngine(model, num_kv_blocks=128, **OPTS)
    decode = LLMEngine(model, num_kv_blocks=128, **OPTS)
    got, _ = disaggregated(prefill, decode, prompts, params)
    assert got == expected
    decode.check_integrity()
    assert decode.pool.num_free_blocks == 128 and prefill.pool.num_free_blocks == 128


def test_decode_side_reuses_its_cached_prefix(tiny_llama):
    prefill = LLMEngine(tiny_llama, num_kv_blocks=128, **OPTS)
    decode = LLMEngine(tiny_llama, num_kv_blocks=128, **OPTS)
    shared = random_prompts([32], seed=40)[0]
    a, b = (shared + t for t in random_prompts([6, 7], seed=41))
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    _, moved_a = disaggregated(prefill, decode, [a], [greedy])
    assert moved_a == {"0": 10}  # 38 tokens -> 10 blocks, none cached yet
    _, moved_b = disaggregated(prefill, decode, [b], [greedy])
    assert moved_b == {"0": 2}  # 32 shared tokens = 8 cached blocks; 39 tokens -> 10 blocks


def test_reservation_errors_and_failure_free_blocks(tiny_llama):
    decode = LLMEngine(tiny_llama, num_kv_blocks=8, **OPTS)
    greedy = SamplingParams(max_tokens=4, temperature=0)
    ids, hits = decode.reserve_remote("big", [5] * 31, greedy, seed=1)  # all 8 blocks
    assert (sorted(ids), hits) == (list(range(8)), 0)
    with pytest.raises(CapacityError, match="0 free"):
        decode.reserve_remote("big2", [6] * 5, greedy, seed=1)
    decode.check_integrity()
    decode.fail_remote("big", "prefill worker died")
    out = decode.step().outputs["big"]
    assert (out.finish_reason, out.error) == ("error", "prefill worker died")
    decode.check_integrity()
    assert decode.pool.num_free_blocks == 8
    assert decode.kv.table_ids() == []


def test_held_block_ids_are_the_table_when_the_prefill_ended_until_released(tiny_llama):
    # The prefill worker's sender reads them from its own thread while the loop steps other
    # requests: a snapshot that later steps (allocating, freeing) cannot change.
    prefill = LLMEngine(tiny_llama, num_kv_blocks=64, **OPTS)
    prompt, other = random_prompts([21, 30], seed=7)
    params = SamplingParams(max_tokens=1, temperature=0)
    prefill.add_request("held", prompt, params, prefill_only=True)
    while prefill.has_unfinished():
        prefill.step()
    held = prefill.held_block_ids("held")
    assert held == prefill.kv.block_ids("held") and len(held) == 6  # ceil(21 / 4)
    prefill.add_request("other", other, SamplingParams(max_tokens=3, temperature=0))
    run_to_completion(prefill)
    assert prefill.held_block_ids("held") == held
    assert prefill.release_held("held")
    with pytest.raises(KeyError, match="holds no blocks"):
        prefill.held_block_ids("held")
    prefill.check_integrity()
