"""The cluster scrape (GET /metrics of the HTTP front door) during and after an end-to-end run:
a prefill and a decode worker in their own processes, a Router in this one. Every exposition
parses, and its figures equal what the clients saw (TTFT count = requests, cached tokens,
tokens, transfer bytes = blocks moved x block bytes, decisions, finish reasons)."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.metrics_exposition import cluster_metrics_text, router_scrape
from router.openai_http import create_app
from router.router import Router
from tests.disagg.cluster import pair, start_worker
from tests.helpers import random_prompts
from tests.router.serving import http_serving

BLOCK = 4
PARAMS = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster(tiny_llama):
    options = dict(
        model=tiny_llama, skip_tokenizer_init=True, block_size=BLOCK, num_kv_blocks=256,
        chunk_size=16, hash_seed="m",
    )  # fmt: skip
    prefill = start_worker("prefill", "p0", options, {})
    decode = start_worker("decode", "d0", options, {})
    try:
        pair(prefill, decode)
        router = Router(
            {"p0": prefill.client},
            {"d0": decode.client},
            block_size=BLOCK,
            hash_seed="m",
            local_prefill_tokens=8,  # a tail of <= 8 uncached tokens is prefilled on d0
        )
        app = create_app(router, ["tiny"], metrics_text=lambda: router_scrape(router))
        with http_serving(app) as (url, _):
            yield router, decode, Path(tiny_llama), url
    finally:
        prefill.stop()
        decode.stop()


def block_bytes(checkpoint: Path) -> int:
    """Bytes of one KV block over all layers, K and V (fp32 on CPU)."""
    cfg = json.loads((checkpoint / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * BLOCK * cfg["num_key_value_heads"] * head_dim * 4


def parse(text: str) -> dict[tuple[str, str, str], float]:
    """{(sample name, worker, other labels): value} of one exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            extra = ",".join(
                f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("worker", "role")
            )
            out[(s.name, s.labels["worker"], extra)] = s.value
    return out


def total(series: dict, name: str, worker: str | None = None, extra: str = "") -> float:
    return sum(
        v
        for (n, w, e), v in series.items()
        if n == f"baton:{name}" and (worker is None or w == worker) and e == extra
    )


def test_scrape_during_and_after_a_run_equals_what_clients_saw(cluster):
    router, decode, checkpoint, url = cluster

    def scrape() -> str:
        reply = httpx.get(f"{url}/metrics", timeout=30)
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/plain; version=0.0.4")
        return reply.text

    system = random_prompts([32], seed=401)[0]
    tails = random_prompts([20, 3, 17, 2, 25, 13], seed=402)
    prompts = [system + random_prompts([9], seed=400)[0]] + [system + t for t in tails]
    results: dict[str, list[dict]] = {}

    def run(i: int) -> None:
        results[f"m{i}"] = list(router.generate(f"m{i}", prompts[i], PARAMS))

    run(0)  # caches the system prompt on p0 (and, having received it, on d0)
    scrapes: list[str] = []
    done = threading.Event()

    def scrape_until_done() -> None:
        while not done.is_set():
            scrapes.append(scrape())
            done.wait(0.05)

    scraper = threading.Thread(target=scrape_until_done)
    scraper.start()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(1, len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    done.set()
    scraper.join(30)

    assert scrapes, "no scrape ran during the requests"
    for text in scrapes:  # every mid-run scrape is a valid exposition with both workers up
        assert total(parse(text), "worker_up") == 2
    finals = [outs[-1] for outs in results.values()]
    n = len(prompts)
    remote = sum(1 for f in finals if f["prefill_worker"] == "p0")
    m = parse(scrape())
    deadline = time.monotonic() + 10  # acks travel to p0 after the decode side has the KV
    while total(m, "kv_transfer_time_seconds_count", "p0") < remote:
        assert time.monotonic() < deadline, "not every hand-over was acknowledged"
        time.sleep(0.05)
        m = parse(scrape())
    assert len(finals) == n and all(f["finish_reason"] == "length" for f in finals)

    # Router: what the clients saw.
    assert total(m, "time_to_first_token_seconds_count", "router") == n
    assert total(m, "e2e_request_latency_seconds_count", "router") == n
    token_outputs = sum(sum(1 for o in outs if o["token_ids"]) for outs in results.values())
    assert total(m, "inter_token_latency_seconds_count", "router") == token_outputs - n
    assert total(m, "request_success_total", "router", "finished_reason=length") == n
    assert total(m, "prefix_cache_queries_total", "router") == sum(map(len, prompts))
    cached = sum(f["num_cached_tokens"] for f in finals)
    assert total(m, "prefix_cache_hits_total", "router") == cached == (n - 1) * 32
    placement = Counter("local" if f["prefill_worker"] == "d0" else "remote" for f in finals)
    assert placement == {"local": 2, "remote": 5}  # tails of 3 and 2 after d0's cached 32
    for where, count in placement.items():
        extra = f"policy=cache_aware,prefill={where}"
        assert total(m, "router_decisions_total", "router", extra) == count

    # Workers: every prompt prefilled once, every generated token sampled once.
    completion = sum(len(o["token_ids"]) for outs in results.values() for o in outs)
    prompt_tokens = total(m, "prompt_tokens_total", "p0") + total(m, "prompt_tokens_total", "d0")
    assert prompt_tokens == sum(map(len, prompts))
    assert total(m, "generation_tokens_total") == completion
    assert total(m, "request_prefill_time_seconds_count", "p0") == placement["remote"]
    assert total(m, "request_decode_time_seconds_count", "d0") == n
    assert total(m, "num_requests_running") == total(m, "num_requests_waiting") == 0

    # KV transfer: bytes = blocks moved x block bytes; one hand-over per remote request.
    blocks = total(m, "kv_transfer_blocks_total", "p0")
    assert blocks == decode.client.stats().blocks_received > 0
    assert total(m, "kv_transfer_bytes_total", "p0") == blocks * block_bytes(checkpoint)
    assert total(m, "kv_transfer_time_seconds_count", "p0") == placement["remote"]
    assert total(m, "kv_transfer_failures_total") == 0


def test_a_reservation_whose_kv_never_arrives_counts_as_a_transfer_failure(tiny_llama):
    from decode_worker.worker import DecodeWorker
    from kvtransfer.worker_api import PromptRequest

    options = dict(model=tiny_llama, skip_tokenizer_init=True, block_size=BLOCK, num_kv_blocks=32)
    decode = DecodeWorker("d0", options, {"lease_seconds": 0.2})
    try:
        request = PromptRequest("lost", tuple(range(5, 15)), {**PARAMS, "seed": 1})
        decode.reserve(request, prefill_id="p0")  # no prefill worker will ever send it
        outs = decode.poll("lost", timeout=10)
        assert outs[-1].finish_reason == "error" and "lease" in outs[-1].error
        text = cluster_metrics_text(None, {"d0": ("decode", decode.metrics())})
        assert parse(text)[("baton:kv_transfer_failures_total", "d0", "")] == 1
    finally:
        decode.shutdown()
