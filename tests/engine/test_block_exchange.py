"""An engine's side of a pull (engine/block_exchange.py): the exporting engine pins the cached
blocks of a token run, the importing engine takes blocks for the ones it lacks and caches what
arrives, so its next prompt starting with the run computes only the rest. Two engines in one
process, blocks copied between their caches (the transport is tested in tests/kvtransfer)."""

from __future__ import annotations

import pytest
import torch

from engine import InvalidRequestError, LLMEngine, SamplingParams
from tests.engine.test_remote_kv import copy_blocks
from tests.helpers import random_prompts, run_to_completion

BS = 4
OPTS = dict(skip_tokenizer_init=True, block_size=BS, chunk_size=16)
A, U = random_prompts([22, 6], seed=51)
GREEDY = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)


def steps(engine: LLMEngine) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Run to completion: tokens and tokens computed, per request."""
    tokens: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    while engine.has_unfinished():
        result = engine.step()
        for rid, n in result.scheduled.items():
            computed[rid] = computed.get(rid, 0) + n
        for rid, out in result.outputs.items():
            tokens.setdefault(rid, []).extend(out.new_token_ids)
    engine.check_integrity()
    return tokens, computed


def block(engine: LLMEngine, block_id: int) -> torch.Tensor:
    return torch.stack([layer[:, block_id] for layer in engine.kv_caches]).clone()


@pytest.fixture
def turn1(tiny_llama):
    """A decode-side engine that generated turn 1 (A and its 9 tokens: KV of 30 tokens, 7
    full blocks cached) and a prefill-side engine that computed A only (5 full blocks)."""
    decode = LLMEngine(tiny_llama, num_kv_blocks=64, **OPTS)
    decode.add_request("t1", A, GREEDY)
    answer = run_to_completion(decode)["t1"]
    prefill = LLMEngine(tiny_llama, num_kv_blocks=64, **OPTS)
    prefill.add_request("t1", A, SamplingParams(max_tokens=1, temperature=0))
    run_to_completion(prefill)
    return decode, prefill, A + answer


def pull(src: LLMEngine, dst: LLMEngine, run: list[int], salt: str | None = None) -> tuple:
    """One pull, the transport replaced by a copy; returns (plan, exported ids, cached)."""
    plan = dst.import_blocks("in", run, salt)
    ids = src.export_blocks("out", run, salt, plan.start, len(plan.dst_block_ids))
    dst.check_integrity()
    src.check_integrity()
    copy_blocks(src, ids, dst, list(plan.dst_block_ids[: len(ids)]))
    assert src.release_exchange("out")
    cached = dst.finish_import("in", plan.start, len(ids))
    return plan, ids, cached


def test_pulled_blocks_are_the_exporters_bytes_and_the_next_turn_computes_only_the_rest(
    tiny_llama, turn1
):
    decode, prefill, run = turn1  # 31 tokens: 7 full blocks
    free_before = decode.pool.num_free_blocks
    plan, ids, cached = pull(decode, prefill, run)
    assert (plan.num_blocks, plan.start, len(plan.dst_block_ids)) == (7, 5, 2)
    assert len(ids) == 2 and cached == 2
    by_hash = {b.block_hash: b.block_id for b in prefill.pool.cached_blocks()}
    src_by_hash = {b.block_hash: b.block_id for b in decode.pool.cached_blocks()}
    for h in plan.block_hashes:  # every block of the run, bit for bit the decode side's
        assert torch.equal(
            block(prefill, by_hash[h]).view(torch.int32),
            block(decode, src_by_hash[h]).view(torch.int32),
        )
    assert prefill.exchanges() == [] and decode.exchanges() == []
    assert decode.pool.num_free_blocks == free_before  # unpinned, still cached
    prefill.check_integrity()

    turn2 = run + U
    prefill.add_request("t2", turn2, GREEDY)
    tokens, computed = steps(prefill)
    assert computed["t2"] == len(turn2) - 28 + 8  # 7 blocks from the cache, then 8 decodes
    reference = LLMEngine(tiny_llama, num_kv_blocks=64, **OPTS)
    reference.add_request("t2", turn2, GREEDY)
    assert tokens == run_to_completion(reference)


def test_an_import_of_a_run_held_already_takes_no_block(turn1):
    decode, prefill, run = turn1
    pull(decode, prefill, run)
    plan = prefill.import_blocks("again", run, None)
    assert (plan.start, plan.dst_block_ids) == (7, ())
    assert prefill.exchanges() == []
    prefill.check_integrity()


def test_the_exporter_sends_only_the_leading_blocks_it_holds(turn1):
    decode, prefill, run = turn1
    other = run[:8] + [t + 1 for t in run[8:]]  # blocks 2.. differ from what decode holds
    plan = prefill.import_blocks("in", other, None)
    assert plan.start == 2 and len(plan.dst_block_ids) == 5
    assert decode.export_blocks("out", other, None, plan.start, 5) == []
    decode.release_exchange("out")
    # a cache_salt names other blocks: nothing matches either
    assert decode.export_blocks("salted", run, "tenant", 0, 7) == []
    decode.release_exchange("salted")
    assert prefill.finish_import("in", plan.start, 0) == 0
    prefill.check_integrity()
    assert prefill.pool.num_free_blocks == 64


def test_a_failed_pull_frees_its_blocks_uncached(turn1):
    decode, prefill, run = turn1
    cached = prefill.pool.cached_hashes()
    plan = prefill.import_blocks("in", run, None)
    assert prefill.pool.num_free_blocks == 64 - 7  # head pinned, 2 blocks taken
    assert prefill.release_exchange("in")
    assert not prefill.release_exchange("in")
    assert prefill.pool.cached_hashes() == cached  # nothing of the failed pull was cached
    assert set(plan.block_hashes[5:]).isdisjoint(prefill.pool.cached_hashes())
    prefill.check_integrity()
    assert prefill.pool.num_free_blocks == 64


def test_an_import_takes_only_the_free_blocks(tiny_llama, turn1):
    decode, _, run = turn1
    small = LLMEngine(tiny_llama, num_kv_blocks=12, **OPTS)
    small.reserve_remote("busy", [5] * 40, GREEDY, seed=1)  # 10 of 12 blocks
    plan = small.import_blocks("in", run, None)
    assert (plan.start, len(plan.dst_block_ids)) == (0, 2)
    small.release_exchange("in")
    small.check_integrity()


def test_bad_exchanges_are_refused(turn1):
    decode, prefill, run = turn1
    with pytest.raises(InvalidRequestError, match=r"token_ids out of range \[0, 512\)"):
        prefill.import_blocks("in", [1, 2, 99999, 3], None)
    prefill.import_blocks("in", run, None)
    with pytest.raises(InvalidRequestError, match="exchange id 'in' is already in use"):
        prefill.import_blocks("in", run, None)
    prefill.release_exchange("in")
    prefill.check_integrity()
