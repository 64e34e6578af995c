"""The Router over real workers (in-process, gloo pair groups): cache-aware routing keeps
each system prompt on the prefill worker that caches it while both workers stay busy, where
round robin needs pulls from the decode worker for the same hit rate; outputs equal the
colocated engine's."""

from __future__ import annotations

import pytest

from decode_worker.worker import DecodeWorker
from engine import LLM, SamplingParams
from prefill_worker.worker import PrefillWorker
from router.policy import make_policy
from router.router import Router
from tests.helpers import random_prompts

PARAMS = {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def options(tiny_llama) -> dict:
    return dict(
        model=tiny_llama,
        skip_tokenizer_init=True,
        block_size=4,
        num_kv_blocks=512,
        chunk_size=32,
        hash_seed="t",
    )


def make_router(options: dict, policy: str) -> tuple[Router, list]:
    prefill = {f"p{i}": PrefillWorker(f"p{i}", options) for i in range(2)}
    decode = {"d0": DecodeWorker("d0", options)}
    for pid, p in prefill.items():
        decode["d0"].connect_prefill(pid, p.connect_decode("d0", decode["d0"]), p)
    router = Router(prefill, decode, block_size=4, hash_seed="t", policy=make_policy(policy))
    return router, [*prefill.values(), *decode.values()]


FAMILIES = [0, 0, 1, 1, 0, 0, 1, 1]  # which system prompt each request starts with


def workload() -> list[list[int]]:
    """Two families of requests, each sharing a 64-token system prompt."""
    systems = random_prompts([64, 64], seed=201)
    tails = random_prompts([5] * len(FAMILIES), seed=202)
    return [systems[f] + tail for f, tail in zip(FAMILIES, tails, strict=True)]


@pytest.mark.parametrize("policy", ["cache_aware", "round_robin"])
def test_router_outputs_equal_colocated(options, policy):
    router, workers = make_router(options, policy)
    try:
        prompts = workload()[:4]
        expected = LLM(**options).generate(prompts, SamplingParams(**PARAMS))
        for i, prompt in enumerate(prompts):
            outs = list(router.generate(f"{policy}-{i}", prompt, PARAMS))
            assert [t for o in outs for t in o["token_ids"]] == expected[i].token_ids
            assert outs[-1]["prefill_worker"] in ("p0", "p1")
            assert outs[-1]["decode_worker"] == "d0"
    finally:
        for w in workers:
            w.shutdown()


def test_cache_aware_keeps_each_family_on_one_worker_and_round_robin_pulls_its_misses(options):
    results = {}
    for policy in ("cache_aware", "round_robin"):
        router, workers = make_router(options, policy)
        try:
            served = []
            for i, prompt in enumerate(workload()):
                outs = list(router.generate(f"{policy}-{i}", prompt, PARAMS))
                served.append(outs[-1]["prefill_worker"])
            pulls = router.metrics.registry.get_sample_value(
                "baton:router_pull_decisions_total", {"decision": "pull"}
            )
            results[policy] = (router.hit_rate(), served, pulls or 0)
        finally:
            for w in workers:
                w.shutdown()
    aware_rate, aware_served, aware_pulls = results["cache_aware"]
    rr_rate, rr_served, rr_pulls = results["round_robin"]
    # Each family sticks to one worker, and the two families use different workers.
    by_family = [
        {w for w, f in zip(aware_served, FAMILIES, strict=True) if f == fam} for fam in (0, 1)
    ]
    assert by_family == [{"p0"}, {"p1"}]
    assert aware_rate == pytest.approx(6 * 64 / (8 * 69))  # all but the first of each family
    assert aware_pulls == 0
    # Round robin alternates workers, so each family's prompt goes to both. The second
    # worker's first miss of a family is pulled from the decode worker (it decoded the
    # family's first prompt) instead of computed: the same hit rate, bought with 2 pulls.
    assert rr_served == ["p0", "p1"] * 4
    assert rr_rate == pytest.approx(6 * 64 / (8 * 69))
    assert rr_pulls == 2


def test_short_uncached_tail_is_prefilled_on_the_decode_worker(options):
    router, workers = make_router(options, "cache_aware")
    router.chooser.local_prefill_tokens = 16
    decode = workers[-1]
    try:
        shared = random_prompts([64], seed=211)[0]
        first, second = (shared + tail for tail in random_prompts([30, 6], seed=212))
        expected = LLM(**options).generate([first, second], SamplingParams(**PARAMS))
        # 94 tokens, nothing cached on the decode worker: transferred from a prefill worker.
        outs = list(router.generate("far", first, PARAMS))
        assert outs[-1]["prefill_worker"] in ("p0", "p1")
        received = decode.stats().blocks_received
        assert received == 24
        # 70 tokens, 64 cached on the decode worker itself: a 6-token tail, prefilled locally.
        outs = list(router.generate("near", second, PARAMS))
        assert (outs[-1]["prefill_worker"], outs[-1]["decode_worker"]) == ("d0", "d0")
        assert outs[-1]["num_cached_tokens"] == 64
        assert decode.stats().blocks_received == received  # no transfer
        assert [t for o in outs for t in o["token_ids"]] == expected[1].token_ids
        decode.check_integrity()
    finally:
        for w in workers:
            w.shutdown()
