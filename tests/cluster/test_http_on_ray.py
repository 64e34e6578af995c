"""The OpenAI-compatible HTTP door and the cluster-wide /metrics of a real local Ray cluster
(router actor + 1 prefill + 1 decode worker actor), as a user reaches them: the `openai` SDK
and a Prometheus-format scrape. The scrape's figures equal what the clients saw."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.local import LocalCluster
from deploy.manifest import parse_manifest
from engine import LLM, SamplingParams
from tests.cluster.manifests import tiny_manifest
from tests.helpers import random_prompts

pytestmark = pytest.mark.ray

openai = pytest.importorskip("openai")
MAX_TOKENS = 6
ENGINE = {"block_size": 4, "num_kv_blocks": 256, "chunk_size": 16}


@pytest.fixture(scope="module")
def cluster(tiny_llama):
    c = LocalCluster(parse_manifest(tiny_manifest(tiny_llama))).start(log=lambda _m: None)
    yield c
    c.close()


def samples(text: str, name: str) -> dict[tuple, float]:
    """{sorted label items: value} of one sample name in an exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_openai_sdk_greedy_equals_offline_engine_and_metrics_match_clients(cluster, tiny_llama):
    assert cluster.http_address and cluster.http_address.startswith("http://127.0.0.1:")
    client = openai.OpenAI(base_url=f"{cluster.http_address}/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == [tiny_llama]
    assert httpx.get(f"{cluster.http_address}/health", timeout=30).status_code == 200

    system = random_prompts([40], seed=71)[0]
    prompts = [system + tail for tail in random_prompts([5, 6, 7], seed=72)]
    expected = LLM(tiny_llama, skip_tokenizer_init=True, **ENGINE).generate(
        prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    )
    extra = {"ignore_eos": True, "return_token_ids": True}
    cached = []
    for prompt, exp in zip(prompts[:2], expected[:2], strict=True):
        reply = client.completions.create(
            model=tiny_llama,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body=extra,
        )
        assert reply.choices[0].model_extra["token_ids"] == exp.token_ids
        assert reply.usage.completion_tokens == MAX_TOKENS
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
    stream = client.completions.create(
        model=tiny_llama,
        prompt=prompts[2],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    chunks = list(stream)
    streamed = [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]]
    assert streamed == expected[2].token_ids
    cached.append(chunks[-1].usage.prompt_tokens_details.cached_tokens)
    assert cached == [0, 40, 40]  # the shared 40-token prefix: 10 full blocks of 4

    text = httpx.get(f"{cluster.http_address}/metrics", timeout=60).text
    ttft = samples(text, "baton:time_to_first_token_seconds_count")
    assert sum(ttft.values()) == len(prompts)
    hits = samples(text, "baton:prefix_cache_hits_total")
    router_hits = sum(v for labels, v in hits.items() if ("role", "router") in labels)
    assert router_hits == sum(cached)
    workers = {dict(labels).get("worker") for labels in samples(text, "baton:num_requests_running")}
    assert {"prefill-0", "decode-0"} <= workers
    moved_blocks = samples(text, "baton:kv_transfer_blocks_total")
    moved_bytes = samples(text, "baton:kv_transfer_bytes_total")
    assert sum(moved_blocks.values()) > 0 and sum(moved_bytes.values()) > 0
