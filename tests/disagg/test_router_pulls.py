"""The router's pull / local / recompute choice between real worker processes (gloo): turn 2
of a conversation starts with turn 1's prompt and answer, whose last blocks exist only on the
decode worker. The router has the prefill worker pull them (the prefill computes only the
rest), or prefills on the decode worker when the tail is short enough and that is cheaper,
or recomputes when a pull would cost more; every way gives the tokens of one engine that ran
both turns."""

from __future__ import annotations

import pytest

from kvtransfer.worker_api import PullResult
from router.router import Router
from router.sessions import SessionHint
from tests.disagg.cluster import paired_workers, tokens
from tests.disagg.test_pull_blocks import BLOCK_BYTES, PARAMS, colocated, metric
from tests.disagg.test_two_processes import check_clean, engine_options
from tests.helpers import random_prompts

TRANSFER = {"timeout_seconds": 3.0, "lease_seconds": 4.0}


@pytest.fixture(scope="module")
def workers(tiny_llama):
    with paired_workers(engine_options(tiny_llama), TRANSFER) as both:
        yield both


def router_over(prefill, decode, local_prefill_tokens: int = 0) -> Router:
    return Router(
        {"p0": prefill.client},
        {"d0": decode.client},
        block_size=4,
        hash_seed=prefill.client.info().hash_seed,
        local_prefill_tokens=local_prefill_tokens,
        timeout=60,
    )


def counters(worker) -> dict[str, float]:
    families = worker.client.metrics()
    names = (
        "baton:prefix_cache_queries_total",
        "baton:prefix_cache_hits_total",
        "baton:kv_pull_bytes_total",
        "baton:kv_pull_served_bytes_total",
    )
    out = {}
    for name in names:
        try:
            out[name] = metric(families, name)
        except KeyError:
            out[name] = 0.0
    return out


def conversation(router: Router, seed: int, session: str) -> tuple[list, list, list]:
    """Two turns: (turn 1's prompt, turn 1's outputs, turn 2's outputs)."""
    a, u = random_prompts([22, 6], seed=seed)
    hint = SessionHint(session, 60.0)
    first = list(router.generate(f"{session}-1", a, PARAMS, session=hint))
    second = list(router.generate(f"{session}-2", a + tokens(first) + u, PARAMS, session=hint))
    return a + tokens(first) + u, first, second


def decisions(router: Router) -> dict[str, float]:
    get = router.metrics.registry.get_sample_value
    return {
        d: get("baton:router_pull_decisions_total", {"decision": d}) or 0.0
        for d in ("pull", "local", "recompute")
    }


def test_the_second_turn_moves_the_answer_instead_of_recomputing_it(workers, tiny_llama):
    prefill, decode = workers
    router = router_over(prefill, decode)
    p0, d0 = counters(prefill), counters(decode)
    prompt2, first, second = conversation(router, 211, "conv-pull")
    p1, d1 = counters(prefill), counters(decode)
    # Turn 1 (22 tokens): 0 cached, 22 computed. Turn 2 (37 tokens): p0 held turn 1's 5 full
    # blocks, pulled blocks 5 and 6 (turn 1's tail and answer) from d0, computed 37 - 28 = 9.
    queries = p1["baton:prefix_cache_queries_total"] - p0["baton:prefix_cache_queries_total"]
    hits = p1["baton:prefix_cache_hits_total"] - p0["baton:prefix_cache_hits_total"]
    assert (queries, hits, queries - hits) == (22 + 37, 28, 22 + 9)
    assert second[-1]["num_cached_tokens"] == 28
    assert p1["baton:kv_pull_bytes_total"] - p0["baton:kv_pull_bytes_total"] == 2 * BLOCK_BYTES
    served = d1["baton:kv_pull_served_bytes_total"] - d0["baton:kv_pull_served_bytes_total"]
    assert served == 2 * BLOCK_BYTES
    assert decisions(router) == {"pull": 1, "local": 0, "recompute": 0}
    get = router.metrics.registry.get_sample_value
    assert get("baton:router_cached_tokens_total", {"medium": "device"}) == 28  # pulled ones
    assert [o["prefill_worker"] for o in (first[-1], second[-1])] == ["p0", "p0"]
    (ref1, _), (ref2, _) = colocated(tiny_llama, [prompt2[:22], prompt2])
    assert (tokens(first), tokens(second)) == (ref1, ref2)  # as recomputing them gives
    # the pair's bandwidth is measured now: what that pull moved over the time it took
    assert router.chooser.costs.pair_bytes_per_s("p0", "d0") != 1e8
    check_clean(prefill, decode)


def test_a_short_tail_prefills_locally_and_a_slow_pair_recomputes(workers, tiny_llama):
    prefill, decode = workers
    local = router_over(prefill, decode, local_prefill_tokens=16)
    before = counters(prefill)
    prompt2, first, second = conversation(local, 212, "conv-local")
    # turn 1's 22 uncached tokens are past 16: remote; turn 2's tail on d0 is 37 - 28 = 9
    assert [o["prefill_worker"] for o in (first[-1], second[-1])] == ["p0", "d0"]
    assert second[-1]["num_cached_tokens"] == 28  # d0's own blocks, nothing moved
    assert decisions(local) == {"pull": 0, "local": 1, "recompute": 0}
    (ref1, _), (ref2, _) = colocated(tiny_llama, [prompt2[:22], prompt2])
    assert (tokens(first), tokens(second)) == (ref1, ref2)

    slow = router_over(prefill, decode)
    slow.chooser.costs.observe_pull("p0", "d0", PullResult(1, 0, 1, 1000, 100.0))  # 10 B/s
    prompt2, first, second = conversation(slow, 213, "conv-slow")
    assert second[-1]["num_cached_tokens"] == 20  # p0's own 5 blocks; the rest computed
    assert decisions(slow) == {"pull": 0, "local": 0, "recompute": 1}
    after = counters(prefill)
    assert after["baton:kv_pull_bytes_total"] == before["baton:kv_pull_bytes_total"]
    (ref1, _), (ref2, _) = colocated(tiny_llama, [prompt2[:22], prompt2])
    assert (tokens(first), tokens(second)) == (ref1, ref2)
    check_clean(prefill, decode)
