"""Routing over real decode workers (in process, aggregated) with a host KV tier: a prompt
whose blocks the KV cache evicted to the tier is indexed there (medium host), goes back to the
worker holding it in its tier rather than to an empty one, is served from the tier (cached
tokens counted by medium at the router) and gives the tokens of a fresh engine."""

from __future__ import annotations

import pytest

from decode_worker.worker import DecodeWorker
from engine import LLM, SamplingParams
from engine.block_hash import hash_prompt_blocks
from router.kv_index import PrefixHits
from router.router import Router
from tests.helpers import random_prompts, wait_until

PARAMS = {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
BS = 4


def options(model: str, **tier) -> dict:
    return dict(
        model=model,
        skip_tokenizer_init=True,
        block_size=BS,
        num_kv_blocks=16,
        chunk_size=32,
        hash_seed="t",
        **tier,
    )


@pytest.fixture
def workers(tiny_llama):
    d0 = DecodeWorker("d0", options(tiny_llama, kv_tier="host", kv_tier_bytes=1 << 20))
    d1 = DecodeWorker("d1", options(tiny_llama))
    yield d0, d1
    d0.shutdown()
    d1.shutdown()


def test_a_prompt_in_a_workers_tier_goes_back_to_it_and_loads_from_there(workers, tiny_llama):
    d0, d1 = workers
    a, b, c = random_prompts([33, 33, 33], seed=301)  # 8 full blocks each (+ 1 token)
    router = Router({}, {"d0": d0}, block_size=BS, hash_seed="t", aggregated=True)
    for rid, prompt in (("a", a), ("b", b), ("c", c)):
        assert list(router.generate(rid, prompt, PARAMS))[-1]["decode_worker"] == "d0"
    hashes = hash_prompt_blocks(a, BS, "t")

    def a_in_host_tier() -> bool:
        router.refresh_index()
        return router.index.hits("d0", hashes[:8]) == PrefixHits(0, 8, "host")

    # 16 KV blocks: b and c evicted a's 8 cached blocks, which the tier stored (its writer
    # thread: the events come a moment later)
    wait_until(a_in_host_tier)
    router.set_workers({}, {"d0": d0, "d1": d1})  # d1: an empty KV cache, no tier
    outs = list(router.generate("a-again", a, PARAMS))
    assert (outs[-1]["decode_worker"], outs[-1]["num_cached_tokens"]) == ("d0", 32)
    get = router.metrics.registry.get_sample_value
    assert get("baton:router_cached_tokens_total", {"medium": "host"}) == 32
    stats = d0.stats()
    assert (stats.tier_medium, stats.tier_hits, stats.tier_blocks_read) == ("host", 8, 8)
    assert stats.tier_bytes_read == 8 * stats.kv_block_bytes and stats.tier_load_seconds > 0
    expected = LLM(**options(tiny_llama)).generate([a], SamplingParams(**PARAMS))[0]
    assert [t for o in outs for t in o["token_ids"]] == expected.token_ids
    # the next choice reads the tier's measured bandwidth from d0's stats
    list(router.generate("d", random_prompts([9], seed=302)[0], PARAMS))
    rates = router.chooser.costs.rates("d0")
    assert rates.tier_bytes_per_s == stats.tier_bytes_read / stats.tier_load_seconds
    d0.check_integrity()


def test_a_restart_report_keeps_the_disk_blocks_a_restarted_worker_announced():
    from tests.router.fake_workers import FakeDecode

    router = Router({}, {"d0": FakeDecode()}, block_size=BS, hash_seed="t", aggregated=True)
    router.index.apply(
        "d0",
        [
            {"kind": "stored", "block_hashes": [1, 2], "medium": "device"},
            {"kind": "stored", "block_hashes": [1, 2, 3], "medium": "disk"},
        ],
    )
    router.update_membership({"restarted": ["d0"], "healthy": {"d0": True}})
    assert router.index.hits("d0", [1, 2, 3, 4]) == PrefixHits(0, 3, "disk")
    assert router.index.num_blocks("d0") == 0
