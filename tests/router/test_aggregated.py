"""Aggregated mode (0 prefill workers): every request is prefilled on its decode worker, the
decode worker chosen by its own cached prefix; outputs equal the colocated engine's. Switching
modes: aggregated takes effect at once (requests already on a prefill worker finish there),
leaving it waits until prefill workers are published; a disaggregated router whose prefill pool
is empty still waits for one (tests/router/test_membership.py)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from decode_worker.worker import DecodeWorker
from engine import LLM, SamplingParams
from kvtransfer.worker_api import PromptRequest
from router.openai_http import create_app
from router.router import Router
from tests.helpers import generate_in_thread, random_prompts, wait_until
from tests.router.fake_workers import FakeDecode, FakePrefill
from tests.router.serving import http_serving

PARAMS = {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True}


# ---- over real tiny decode workers -------------------------------------------------------
@pytest.fixture(scope="module")
def options(tiny_llama) -> dict:
    return dict(
        model=tiny_llama,
        skip_tokenizer_init=True,
        block_size=4,
        num_kv_blocks=256,
        chunk_size=16,
        hash_seed="t",
    )


def test_finished_streams_nobody_reads_are_dropped_as_new_requests_come(options, monkeypatch):
    import decode_worker.worker as worker_module

    worker = DecodeWorker("d0", options)
    try:
        prompts = random_prompts([6, 6], seed=303)
        worker.local_generate(PromptRequest("orphan", tuple(prompts[0]), PARAMS))
        wait_until(lambda: worker._streams["orphan"].completed_at is not None)
        worker.local_generate(PromptRequest("kept", tuple(prompts[1]), PARAMS))
        assert set(worker._streams) == {"orphan", "kept"}  # within the TTL: both kept
        wait_until(lambda: worker._streams["kept"].completed_at is not None)
        monkeypatch.setattr(worker_module, "ORPHAN_STREAM_TTL_S", 0.0)
        worker.local_generate(PromptRequest("next", tuple(prompts[1]), PARAMS))
        assert set(worker._streams) == {"next"}  # the two unread finished streams are gone
        with pytest.raises(KeyError, match="unknown request 'orphan'"):
            worker.poll("orphan")
        outs = []
        while not (outs and outs[-1].finished):
            outs += worker.poll("next")
        assert sum(len(o.token_ids) for o in outs) == PARAMS["max_tokens"]
        pool = worker.engine.pool
        assert pool.num_free_blocks == pool.num_blocks  # every block released (some cached)
    finally:
        worker.shutdown()


def test_every_request_prefills_locally_and_a_shared_prefix_lands_where_it_is_cached(options):
    decode = {f"d{i}": DecodeWorker(f"d{i}", options) for i in range(2)}
    router = Router({}, decode, block_size=4, hash_seed="t", aggregated=True)
    try:
        systems = random_prompts([64, 64], seed=301)  # 16 blocks each
        families = [0, 1, 0, 1, 0]
        tails = random_prompts([5] * len(families), seed=302)
        prompts = [systems[f] + tail for f, tail in zip(families, tails, strict=True)]
        expected = LLM(**options).generate(prompts, SamplingParams(**PARAMS))
        served, cached = [], []
        for i, prompt in enumerate(prompts):
            outs = list(router.generate(f"agg-{i}", prompt, PARAMS))
            assert [t for o in outs for t in o["token_ids"]] == expected[i].token_ids
            assert outs[-1]["prefill_worker"] == outs[-1]["decode_worker"]  # prefilled locally
            served.append(outs[-1]["decode_worker"])
            cached.append(outs[-1]["num_cached_tokens"])
        # The second family goes to the worker caching nothing; each family then stays put.
        assert served == ["d0", "d1", "d0", "d1", "d0"]
        assert cached == [0, 0, 64, 64, 64]
        assert router.hit_rate() == pytest.approx(3 * 64 / (5 * 69))
        assert all(w.stats().blocks_received == 0 for w in decode.values())  # no KV moved
        for w in decode.values():
            w.check_integrity()
    finally:
        for w in decode.values():
            w.shutdown()


# ---- switching modes, over fake workers --------------------------------------------------
def run(router: Router, request_id: str, out: dict) -> threading.Thread:
    return generate_in_thread(router, request_id, [1, 2, 3, 4, 5], PARAMS, out)


def workers_of(out: list[dict]) -> tuple[str, str]:
    return out[-1]["prefill_worker"], out[-1]["decode_worker"]


def test_scaling_to_zero_routes_new_requests_locally_while_running_ones_finish():
    p, d = FakePrefill(), FakeDecode()
    router = Router({"p0": p}, {"d0": d}, block_size=4, hash_seed="t")
    out: dict = {}
    first = run(router, "r1", out)  # disaggregated: handed over from p0
    wait_until(lambda: "r1" in d.release)
    router.configure("cache_aware", 0, 0.0, aggregated=True)  # the apply's EnsureRouter
    assert router.aggregated
    second = run(router, "r2", out)
    wait_until(lambda: "r2" in d.release)
    assert (p.prefilled, d.reserved, d.local) == (["r1"], ["r1"], ["r2"])
    assert router.active_counts() == {"p0": 1, "d0": 2}  # the drain waits for r1 on p0
    d.release["r1"].set()
    first.join(10)
    router.set_workers({}, {"d0": d})  # p0 retired
    assert router.aggregated and router.active_counts() == {"d0": 1}
    d.release["r2"].set()
    second.join(10)
    assert (workers_of(out["r1"]), workers_of(out["r2"])) == (("p0", "d0"), ("d0", "d0"))


def test_scaling_from_zero_keeps_prefilling_locally_until_prefill_workers_are_published():
    p, d = FakePrefill(), FakeDecode()
    router = Router({}, {"d0": d}, block_size=4, hash_seed="t", aggregated=True)
    router.configure("cache_aware", 0, 30.0, aggregated=False)  # prefill workers still starting
    assert router.aggregated
    out: dict = {}
    d.release["r1"] = threading.Event()
    d.release["r1"].set()
    run(router, "r1", out).join(10)
    assert workers_of(out["r1"]) == ("d0", "d0")  # did not wait for the prefill pool
    router.set_workers({"p0": p}, {"d0": d})
    assert not router.aggregated
    d.release["r2"] = threading.Event()
    d.release["r2"].set()
    run(router, "r2", out).join(10)
    assert workers_of(out["r2"]) == ("p0", "d0") and p.prefilled == ["r2"]
    router.set_workers({}, {"d0": d})  # a disaggregated pool emptied (replaced): requests wait
    assert not router.aggregated


def test_a_request_waiting_for_a_prefill_worker_goes_local_when_aggregated_is_applied():
    d = FakeDecode()
    router = Router({}, {"d0": d}, block_size=4, hash_seed="t", wait_for_workers_s=30.0)
    out: dict = {}
    waiting = run(router, "r1", out)
    time.sleep(0.3)
    assert "r1" not in out and not d.release  # disaggregated: waits for a prefill worker
    router.configure("cache_aware", 0, 30.0, aggregated=True)
    wait_until(lambda: "r1" in d.release)
    d.release["r1"].set()
    waiting.join(10)
    assert workers_of(out["r1"]) == ("d0", "d0") and d.local == ["r1"]


def test_health_is_ok_without_a_prefill_pool_only_when_aggregated():
    """GET /health (what load clients such as guidellm check first): an aggregated router
    needs only decode workers; a disaggregated one whose prefill pool is empty is 503."""
    statuses = []
    for aggregated in (True, False):
        router = Router(
            {}, {"d0": FakeDecode()}, block_size=4, hash_seed="t", aggregated=aggregated
        )
        with http_serving(create_app(router, ["tiny"])) as (url, _):
            reply = httpx.get(f"{url}/health", timeout=30)
        statuses.append((reply.status_code, reply.json()["status"]))
    assert statuses == [(200, "ok"), (503, "no healthy prefill worker")]
