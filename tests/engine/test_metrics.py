"""EngineMetrics: the step loop's counters, gauges and per-request histograms equal what the
requests themselves report (tokens, cached tokens, preemptions), colocated and disaggregated."""

from __future__ import annotations

import msgpack

from engine import LLMEngine, SamplingParams
from engine.metrics import REQUEST_LATENCY_BUCKETS, snapshot
from tests.helpers import random_prompts

OPTS = dict(skip_tokenizer_init=True, block_size=4, chunk_size=16, decode_stretch=0)


def value(engine: LLMEngine, name: str) -> float:
    v = engine.metrics.registry.get_sample_value(f"baton:{name}")
    return 0.0 if v is None else v


def run(engine: LLMEngine) -> tuple[dict, dict, int]:
    """Step to completion: (tokens per request, final outputs, preemptions seen)."""
    tokens: dict[str, list[int]] = {}
    final = {}
    preempted = 0
    while engine.has_unfinished():
        result = engine.step()
        preempted += len(result.preempted)
        for rid, out in result.outputs.items():
            tokens.setdefault(rid, []).extend(out.new_token_ids)
            if out.finished:
                final[rid] = out
    return tokens, final, preempted


def test_colocated_counters_equal_what_the_requests_report(tiny_llama):
    engine = LLMEngine(tiny_llama, num_kv_blocks=128, **OPTS)
    shared = random_prompts([24], seed=3)[0]
    tails = random_prompts([5, 30, 9], seed=4)
    prompts = [shared + tails[0]]
    engine.add_request("warm", prompts[0], SamplingParams(max_tokens=1, temperature=0))
    run(engine)
    prompts += [shared + t for t in tails[1:]] + [random_prompts([40], seed=5)[0]]
    for i, p in enumerate(prompts[1:]):
        engine.add_request(
            str(i), p, SamplingParams(max_tokens=6 + i, temperature=0, ignore_eos=True)
        )
    tokens, final, _ = run(engine)
    tokens["warm"] = [0]  # one token, seen in the first run
    n = len(prompts)

    assert value(engine, "prompt_tokens_total") == sum(map(len, prompts))
    assert value(engine, "generation_tokens_total") == sum(map(len, tokens.values()))
    assert value(engine, "prefix_cache_queries_total") == sum(map(len, prompts))
    cached = sum(o.num_cached_tokens for o in final.values())
    assert cached == 2 * 24  # the two later prompts that share the warm one's 24 tokens
    assert value(engine, "prefix_cache_hits_total") == cached
    for hist in ("queue", "prefill", "decode"):
        assert value(engine, f"request_{hist}_time_seconds_count") == n
        top = engine.metrics.registry.get_sample_value(
            f"baton:request_{hist}_time_seconds_bucket", {"le": "+Inf"}
        )
        assert top == n
    assert value(engine, "num_preemptions_total") == 0
    assert (value(engine, "num_requests_running"), value(engine, "num_requests_waiting")) == (0, 0)
    assert value(engine, "kv_cache_usage_perc") == engine.pool.usage() == 0.0


def test_step_time_histogram_counts_every_step_that_ran_a_batch(tiny_llama):
    import time

    engine = LLMEngine(tiny_llama, num_kv_blocks=128, **OPTS)
    for i, p in enumerate(random_prompts([40, 7], seed=6)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    ran, start = 0, time.perf_counter()
    while engine.has_unfinished():
        ran += bool(engine.step().scheduled)
    wall = time.perf_counter() - start
    # 16 + the whole 7-token prompt, 16 + a decode, 8 + a decode, then 4 decode steps (the
    # 7-token prompt's 5 tokens end one step before the 40-token one's)
    assert ran == 7
    assert value(engine, "engine_step_duration_seconds_count") == ran
    assert 0 < value(engine, "engine_step_duration_seconds_sum") <= wall


def test_preemptions_are_counted_and_prompts_are_not_counted_twice(tiny_llama):
    # 12 blocks of 4 tokens: three 12-token prompts decoding 20 tokens each cannot all fit.
    engine = LLMEngine(tiny_llama, num_kv_blocks=12, **OPTS)
    prompts = random_prompts([12, 12, 12], seed=6)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    tokens, _, preempted = run(engine)
    assert preempted > 0
    assert value(engine, "num_preemptions_total") == preempted
    assert value(engine, "prompt_tokens_total") == 36
    assert value(engine, "generation_tokens_total") == sum(map(len, tokens.values())) == 60
    assert value(engine, "request_queue_time_seconds_count") == 3


def test_gauges_follow_waiting_running_and_remote_requests(tiny_llama):
    engine = LLMEngine(tiny_llama, num_kv_blocks=64, max_num_seqs=1, **OPTS)
    prompts = random_prompts([8, 8, 8], seed=7)
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    engine.add_request("a", prompts[0], sp)
    engine.add_request("b", prompts[1], sp)
    engine.reserve_remote("c", prompts[2], sp, seed=1)
    engine.step()  # one running (max_num_seqs=1); b queued, c waits for its KV
    assert (value(engine, "num_requests_running"), value(engine, "num_requests_waiting")) == (1, 2)
    assert value(engine, "kv_cache_usage_perc") == engine.pool.usage() > 0
    engine.abort("c")
    engine.record_state()  # what the loop does on an idle tick
    assert value(engine, "num_requests_waiting") == 1


def test_disaggregated_split_between_prefill_and_decode_engines(tiny_llama):
    prefill = LLMEngine(tiny_llama, num_kv_blocks=128, **OPTS)
    decode = LLMEngine(tiny_llama, num_kv_blocks=128, **OPTS)
    prompts = random_prompts([9, 21, 14], seed=8)
    sp = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
    # The decode engine already holds the first prompt: its blocks are a local hit there.
    decode.add_request("pre", prompts[0], SamplingParams(max_tokens=1, temperature=0))
    run(decode)
    base = {k: value(decode, k) for k in ("prompt_tokens_total", "generation_tokens_total")}
    for i, p in enumerate(prompts):
        prefill.add_request(str(i), p, sp, prefill_only=True)
    _, firsts, _ = run(prefill)
    hits = 0
    for i, p in enumerate(prompts):
        rid = str(i)
        ids, n_hit = decode.reserve_remote(rid, p, sp, seed=1)  # greedy
        hits += n_hit * 4
        for s, d in zip(prefill.kv_caches, decode.kv_caches, strict=True):
            d[:, ids[n_hit:]] = s[:, prefill.held_block_ids(rid)[n_hit:]]
        decode.complete_remote(rid, firsts[rid].new_token_ids[0])
        prefill.release_held(rid)
    tokens, _, _ = run(decode)
    assert hits == 8  # prompt 0's two full blocks (its last token is always recomputed)

    assert value(prefill, "prompt_tokens_total") == sum(map(len, prompts))
    assert value(prefill, "generation_tokens_total") == 3  # the first tokens
    assert value(prefill, "request_prefill_time_seconds_count") == 3
    assert value(prefill, "request_decode_time_seconds_count") == 0  # finished "prefilled"
    assert value(decode, "prompt_tokens_total") == base["prompt_tokens_total"]
    generated = value(decode, "generation_tokens_total") - base["generation_tokens_total"]
    assert generated == sum(map(len, tokens.values())) - 3 == 3 * 6  # first tokens came along
    assert value(decode, "request_decode_time_seconds_count") == 1 + 3
    assert value(decode, "request_prefill_time_seconds_count") == 1  # only its local request
    assert value(decode, "prefix_cache_queries_total") == 9 + sum(map(len, prompts))
    assert value(decode, "prefix_cache_hits_total") == hits


def test_snapshot_is_plain_values_without_created_samples(tiny_llama):
    engine = LLMEngine(tiny_llama, num_kv_blocks=32, **OPTS)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0))
    run(engine)
    families = msgpack.unpackb(msgpack.packb(snapshot(engine.metrics.registry)))
    by_name = {f["name"]: f for f in families}
    assert by_name["baton:prompt_tokens"]["type"] == "counter"
    assert by_name["baton:prompt_tokens"]["samples"] == [["baton:prompt_tokens_total", {}, 3.0]]
    queue = by_name["baton:request_queue_time_seconds"]
    assert queue["type"] == "histogram"
    assert len(queue["samples"]) == len(REQUEST_LATENCY_BUCKETS) + 3  # buckets, +Inf, count, sum
    assert not any(s[0].endswith("_created") for f in families for s in f["samples"])
