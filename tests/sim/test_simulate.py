"""The simulator on hand-checkable cases: exact times, cache hits, LRU order, routing."""

from __future__ import annotations

import json

import pytest

from engine.step_model import StepModel
from perf.bench.driver import BenchConfig
from perf.bench.timeline import read_results
from perf.bench.workloads import (
    PrefixRepetitionWorkload,
    RandomWorkload,
    TokenSpace,
    TraceWorkload,
)
from perf.sim.cluster import ClusterConfig, SimCluster
from perf.sim.driver import simulate
from perf.sim.events import EventLoop
from perf.sim.kv_bytes import MODEL_SHAPES, block_bytes
from perf.sim.request import SimRequest
from perf.sim.worker import WorkerConfig
from router.policy import choose_prefill

MODEL = StepModel({"const": 0.01, "prefill_tokens": 0.001})  # decode step: 10 ms
TOKENS = TokenSpace()


def run(workload, cluster, **bench):
    config = BenchConfig(**{"num_requests": 1, **bench})
    records, sim = simulate(workload, TOKENS, config, cluster, MODEL)
    return records, sim


def test_one_request_ttft_is_prefill_step_plus_transfer():
    # 64 prompt tokens = 4 blocks of 1,000 bytes at 4,000 B/s: 1 s, plus 2 ms latency
    cluster = ClusterConfig(block_bytes=1000, kv_bandwidth_gbs=4e-6, kv_latency_s=0.002)
    (r,), _ = run(RandomWorkload(input_len=64, output_len=3), cluster)
    assert r.ttft == pytest.approx(0.01 + 0.064 + 0.002 + 1.0)
    assert r.tpot == pytest.approx(0.01)  # two decode steps of one row
    assert [n for _, n in r.chunks] == [1, 1, 1]
    assert (r.prefill_worker, r.decode_worker, r.cached_tokens) == ("prefill-0", "decode-0", 0)


def test_aggregated_request_prefills_on_its_decode_worker():
    (r,), _ = run(RandomWorkload(input_len=64, output_len=2), ClusterConfig(prefill=0))
    assert r.ttft == pytest.approx(0.074)
    assert r.local_prefill and r.decode_worker == "decode-0"


def test_chunked_prefill_takes_one_step_per_chunk():
    worker = WorkerConfig(chunk_size=32)
    (r,), sim = run(RandomWorkload(input_len=64, output_len=1), ClusterConfig(worker=worker))
    assert r.ttft == pytest.approx(2 * 0.01 + 0.064 + 0.002)  # block_bytes 0: latency only
    assert sim.cluster.prefill["prefill-0"].steps == 2


@pytest.mark.parametrize(
    "spacing,second_ttft",
    [
        (0, 2 * 0.074),  # A's prefill, then A's decode beside B's prefill
        (1, 2 * 0.074 + 0.01),  # a decode-only step of A between the two prompts' steps
    ],
)
def test_prompt_steps_alternate_with_decode_steps(spacing, second_ttft):
    worker = WorkerConfig(decode_steps_between_prompts=spacing)
    records, _ = run(
        RandomWorkload(input_len=64, output_len=4),
        ClusterConfig(prefill=0, worker=worker),
        num_requests=2,
    )
    assert sorted(r.ttft for r in records) == pytest.approx([0.074, second_ttft])


def test_repeated_prefix_hits_the_cache():
    workload = PrefixRepetitionWorkload(num_prefixes=1, prefix_len=64, suffix_len=16, output_len=2)
    records, _ = run(workload, ClusterConfig(), num_requests=3, max_concurrency=1)
    assert [r.cached_tokens for r in records] == [0, 64, 64]
    assert [r.oracle_cached_tokens for r in records] == [0, 64, 64]


def _request(name: str, hashes: list[int], n: int) -> SimRequest:
    return SimRequest(name, hashes, n, 1, 0.0)


def test_lru_evicts_the_least_recently_freed_block_first():
    # one aggregated worker of 6 blocks; each request of 33 tokens + 1 output takes 3
    loop = EventLoop()
    config = ClusterConfig(prefill=0, worker=WorkerConfig(num_kv_blocks=6))
    cluster = SimCluster(config, MODEL, loop)
    done = []
    for r in (_request("a", [1, 2], 33), _request("b", [3, 4], 33), _request("c", [5], 17)):
        r.on_done = done.append
        cluster.route(r)
        loop.run()
    # a freed [tail, a2, a1], then b; c's two blocks are a's tail and a2: a1 survives
    index = cluster.index
    assert index.prefix_hits("decode-0", [1, 2]) == 1
    assert index.prefix_hits("decode-0", [3, 4]) == 2
    assert index.prefix_hits("decode-0", [5]) == 1
    again = _request("a-again", [1, 2], 33)
    cluster.route(again)
    loop.run()
    assert again.cached_tokens == 16
    cluster.decode["decode-0"].pool.check_integrity()
    index.check_integrity()


def test_cache_aware_routing_is_router_policy_on_the_same_state():
    workload = PrefixRepetitionWorkload(num_prefixes=2, prefix_len=64, suffix_len=16, output_len=2)
    cluster = ClusterConfig(prefill=2, decode=2)
    records, sim = run(workload, cluster, num_requests=8, max_concurrency=1)
    by_tenant = {}
    for r in records:
        by_tenant.setdefault(r.tenant, set()).add(r.prefill_worker)
    assert sorted(len(w) for w in by_tenant.values()) == [1, 1]  # each prefix stays put
    assert set.union(*by_tenant.values()) == {"prefill-0", "prefill-1"}  # and they spread
    spec = next(iter(workload.sessions(TOKENS, 0))).next_turn(None)
    from engine.block_hash import hash_prompt_blocks

    hashes = hash_prompt_blocks(spec.prompt_token_ids, 16, "baton")
    from router.policy import WorkerLoad

    loads = [WorkerLoad(w) for w in sim.cluster.prefill]
    choice = choose_prefill(
        "cache_aware",
        hashes,
        16,
        loads,
        sim.cluster.index,
        num_prompt_tokens=len(spec.prompt_token_ids),
    )
    assert by_tenant[spec.tenant] == {choice.worker_id}
    assert choice.cached_tokens == 64


def test_same_seed_same_records():
    workload = PrefixRepetitionWorkload(num_prefixes=3, prefix_len=64, suffix_len=32, output_len=4)
    cluster = ClusterConfig(prefill=2, decode=2, policy="random")
    a, _ = run(workload, cluster, num_requests=20, request_rate=5.0)
    b, _ = run(workload, cluster, num_requests=20, request_rate=5.0)
    assert a == b and len(a) == 20


def test_sessions_cut_short_by_their_context_give_back_their_turns(tmp_path):
    """As in `baton bench`: conversations claim their 4 turns, their context fills after 2,
    and the run still simulates num_requests requests from as many as it takes."""
    rows = [
        dict(session_id=f"c{i}", input_length=12, output_length=3, hash_ids=[100 * i + k])
        for i in range(6)
        for k in range(4)
    ]
    path = tmp_path / "conversations.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    workload = TraceWorkload(path=str(path), block_len=16, max_context=40)
    records, _ = run(workload, ClusterConfig(), num_requests=12, max_concurrency=4)
    turns: dict[str, list[int]] = {}
    for r in records:
        session, turn = r.request_id.rsplit("-", 1)
        turns.setdefault(session, []).append(int(turn))
    assert sorted(turns.values()) == [[0, 1]] * 6


def test_trace_hashes_hit_as_token_hashes_do(tmp_path):
    rows = [
        dict(timestamp=0, input_length=100, output_length=2, hash_ids=[1, 2]),
        dict(timestamp=500, input_length=90, output_length=2, hash_ids=[1, 3]),
        dict(timestamp=1000, input_length=70, output_length=2, hash_ids=[1, 2]),
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    workload = TraceWorkload(path=str(path), block_len=32)
    fast, _ = run(workload, ClusterConfig(), num_requests=3)
    # the same requests with their real tokens, hashed by engine.block_hash
    from perf.sim import driver

    real_sessions = list(workload.sessions(TOKENS, 0))
    original = driver.trace_sessions
    driver.trace_sessions = lambda w, bs, seed: iter(real_sessions)
    try:
        slow, _ = run(workload, ClusterConfig(), num_requests=3)
    finally:
        driver.trace_sessions = original
    assert [r.cached_tokens for r in fast] == [r.cached_tokens for r in slow] == [0, 32, 64]
    assert [r.oracle_cached_tokens for r in fast] == [r.oracle_cached_tokens for r in slow]
    assert [r.send_s for r in fast] == [0.0, 0.5, 1.0]


def test_block_bytes_of_smollm2():
    # README's kvtransfer table: 1,024 tokens of SmolLM2 fp32 are 47 MB
    per_block = block_bytes(MODEL_SHAPES["smollm2-135m-instruct"], "float32", 16)
    assert per_block * 1024 // 16 == 47_185_920


def test_cli_writes_bench_results(tmp_path):
    from perf.sim.command import main

    out = tmp_path / "run"
    assert (
        main(
            [
                "--workload",
                "random",
                "-o",
                "input_len=64",
                "-o",
                "output_len=4",
                "--num-requests",
                "5",
                "--request-rate",
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    summary, records = read_results(out)
    assert summary["completed"] == 5 and len(records) == 5
    assert summary["config"]["simulated"]["cluster"]["prefill"] == 1


def test_fast_index_answers_as_kv_index():
    import random

    from perf.sim.fast_index import FastKVIndex
    from router.kv_index import KVIndex

    rng = random.Random(0)
    fast, slow = FastKVIndex(), KVIndex()
    workers = [f"w{i}" for i in range(5)]
    for index in (fast, slow):
        for w in workers:
            index.add_worker(w)
    prompts = [[rng.randrange(8) for _ in range(6)] for _ in range(40)]
    for step in range(200):
        w = rng.choice(workers)
        hashes = rng.choice(prompts)
        kind = rng.choice(("stored", "removed"))
        events = [{"kind": kind, "block_hashes": hashes[: rng.randrange(7)]}]
        fast.apply(w, events)
        slow.apply(w, events)
        query = rng.choice(prompts)[: rng.randrange(7)]
        assert [fast.prefix_hits(x, query) for x in workers] == [
            slow.prefix_hits(x, query) for x in workers
        ], step


def test_a_manifest_sized_in_memory_simulates_the_default_block_count():
    from cluster.local import LOCAL_MANIFEST
    from deploy.manifest import load_manifest
    from perf.sim.command import cluster_config, run_parser

    gpu = LOCAL_MANIFEST.with_name("gpu.yaml")
    assert load_manifest(gpu).spec.engine.num_kv_blocks is None  # kv_cache_memory_gb instead
    args = run_parser().parse_args(["--manifest", str(gpu)])
    cluster, _ = cluster_config(args)
    assert cluster.worker.num_kv_blocks == 2048
    assert (cluster.worker.block_size, cluster.worker.chunk_size) == (16, 2048)
