"""A tiny end-to-end `baton bench`: a dozen requests of each workload through the real gRPC
server over a prefill and a decode worker on the tiny checkpoint (loopback only)."""

from __future__ import annotations

import asyncio
import json
import threading
from contextlib import contextmanager

import pytest

from decode_worker.worker import DecodeWorker
from perf.bench.command import main
from perf.bench.driver import BenchConfig, bench
from perf.bench.workloads import (
    AgenticWorkload,
    AgentWorkload,
    LongPromptWorkload,
    PrefixRepetitionWorkload,
    RandomWorkload,
    TokenSpace,
    TraceWorkload,
    replay,
)
from prefill_worker.worker import PrefillWorker
from router.router import Router
from router.server import start_server

TOKENS = TokenSpace(low=3, high=512)
BLOCK = 4


@contextmanager
def serving(options: dict):
    """An in-process prefill + decode pair behind a Router and the gRPC server; yields the
    server's loopback address (the pattern of tests/disagg/test_grpc.py)."""
    p, d = PrefillWorker("p0", options), DecodeWorker("d0", options)
    d.connect_prefill("p0", p.connect_decode("d0", d), p)
    router = Router({"p0": p}, {"d0": d}, block_size=BLOCK, hash_seed="baton", max_model_len=256)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    srv, port = asyncio.run_coroutine_threadsafe(start_server(router, port=0), loop).result(30)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(srv.stop(1), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        p.shutdown()
        d.shutdown()


@pytest.fixture(scope="module")
def address(tiny_llama):
    options = dict(
        model=tiny_llama,
        skip_tokenizer_init=True,
        block_size=BLOCK,
        num_kv_blocks=1024,
        chunk_size=32,
        max_model_len=256,
    )
    with serving(options) as addr:
        yield addr


def run(address, workload, **config):
    config = BenchConfig(**dict(dict(num_requests=12, block_size=BLOCK, timeout_s=60), **config))
    return asyncio.run(bench(address, workload, TOKENS, config, {"ttft": 60000}))


def trace_file(tmp_path):
    rows = [
        dict(timestamp=100 * i, input_length=10 + i, output_length=3, hash_ids=[i % 3, 9])
        for i in range(12)
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


def check_run(summary, records, n=12):
    """Every request succeeded and the summary agrees with the records. (The cluster's cache
    outlives a run, the oracle's does not: each test uses its own seed, so its prompts share
    nothing with another test's.)"""
    assert summary["completed"] == n and summary["failed"] == 0, summary["failures"]
    assert len(records) == n and len({r.request_id for r in records}) == n
    for r in records:
        assert r.output_tokens == sum(c for _, c in r.chunks) and r.ttft > 0
        assert (r.prefill_worker, r.decode_worker) == ("p0", "d0")
        assert r.send_s <= r.chunks[0][0] <= r.end_s
    assert summary["throughput"]["requests_per_s"] == pytest.approx(
        n / max(r.end_s for r in records)
    )
    assert summary["goodput"]["fraction"] == 1.0  # a 60 s TTFT SLO
    assert summary["load_balance"]["decode"]["requests"] == {"d0": n}
    assert summary["cache"]["cached_tokens"] <= summary["cache"]["oracle_cached_tokens"]


@pytest.mark.parametrize(
    "workload",
    [
        AgenticWorkload(num_tenants=2, system_len=24, tools_len=16, user_len=6, output_len=4),
        RandomWorkload(input_len=24, output_len=4),
        LongPromptWorkload(
            chat_len=12,
            chat_output_len=4,
            long_min=120,
            long_max=160,
            long_output_len=2,
            long_every=6,
        ),
        "trace",
    ],
    ids=["agentic", "random", "long-prompt", "trace"],
)
def test_each_workload_runs_end_to_end(address, workload, tmp_path):
    if workload == "trace":
        workload = TraceWorkload(path=trace_file(tmp_path), block_len=BLOCK, time_scale=0.5)
    summary, records = run(address, workload, request_rate=50.0, max_concurrency=4)
    check_run(summary, records)
    if isinstance(workload, AgenticWorkload):
        assert any(r.request_id.endswith("-2") for r in records)  # third turns were sent
        assert summary["cache"]["cached_fraction"] > 0.3
    if isinstance(workload, LongPromptWorkload):
        assert [r.prompt_tokens >= 120 for r in records].count(True) == 2
        assert {r.kind for r in records} == {"chat", "long"}
    if isinstance(workload, TraceWorkload):  # sent on the trace's clock: 50 ms apart
        sends = sorted(r.send_s for r in records)
        assert sends[-1] >= 0.5


def test_sequential_cluster_cache_hits_equal_the_oracle(address):
    """One prefill worker, requests one at a time, a cache that never evicts: the cluster's
    prefix hits are the oracle's, request by request."""
    w = PrefixRepetitionWorkload(num_prefixes=3, prefix_len=20, suffix_len=6, output_len=2)
    summary, records = run(address, w, max_concurrency=1, seed=5)
    check_run(summary, records)
    assert [r.cached_tokens for r in records] == [r.oracle_cached_tokens for r in records]
    assert sum(r.oracle_cached_tokens == 20 for r in records) == 9


def test_cli_run_and_compare(address, tmp_path, capsys):
    common = [
        "--address",
        address,
        "--workload",
        "prefix-repetition",
        "--num-requests",
        "6",
        "--vocab-size",
        "512",
        "--block-size",
        str(BLOCK),
        "--no-progress",
        "-o",
        "prefix_len=12",
        "-o",
        "suffix_len=4",
        "-o",
        "output_len=3",
        "--slo",
        "ttft=60000,tpot=60000",
    ]
    for name, seed in (("a", "1"), ("b", "2")):
        assert main([*common, "--seed", seed, "--out", str(tmp_path / name)]) == 0
    out = capsys.readouterr().out
    assert "6 ok / 6 (0 failed)" in out and "goodput (req/s)" in out
    data = json.loads((tmp_path / "a" / "results.json").read_text())
    assert data["config"]["seed"] == 1 and len(data["records"]) == 6
    if (tmp_path / "a" / "ttft_cdf.png").exists():  # plots need matplotlib
        assert (tmp_path / "a" / "worker_load.png").exists()
    fig = tmp_path / "cmp.png"
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(fig)]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].split() == ["a", "b"] and "TTFT median ms" in table
    assert main(["--address", address, "--workload", "random", "-o", "bogus=1"]) == 2


def test_concurrency_cap_and_duration(address):
    w = RandomWorkload(input_len=16, output_len=6)
    summary, records = run(address, w, max_concurrency=2, num_requests=10, seed=11)
    check_run(summary, records, n=10)
    events = sorted([(r.send_s, 1) for r in records] + [(r.end_s, -1) for r in records])
    in_flight = [sum(step for _, step in events[: i + 1]) for i in range(len(events))]
    assert max(in_flight) == 2
    summary, records = run(
        address, w, num_requests=None, duration_s=0.5, request_rate=10.0, seed=12
    )
    assert 1 <= len(records) <= 5 and all(r.send_s < 0.5 for r in records)  # arrivals < 0.5 s
    with pytest.raises(ValueError, match="max-concurrency"):
        BenchConfig(num_requests=None, duration_s=1.0)


def test_manifest_starts_a_cluster_for_the_run(address, tiny_llama, tmp_path, monkeypatch):
    """--manifest: the cluster is started from it (faked here: LocalCluster needs Ray), the
    oracle takes its block size and hash seed, and the cluster is closed after the run."""
    import yaml

    import cluster.local
    from deploy.manifest import load_manifest

    data = load_manifest(cluster.local.LOCAL_MANIFEST).model_dump(mode="json")
    data["spec"]["model"].update(path=tiny_llama, skip_tokenizer_init=True)
    data["spec"]["engine"]["block_size"] = BLOCK
    manifest = tmp_path / "m.yaml"
    manifest.write_text(yaml.safe_dump(data))
    started = []

    class FakeCluster:
        def __init__(self, m):
            started.append(m.spec.engine.block_size)
            self.address = address

        def start(self, log):
            return self

        def close(self):
            started.append("closed")

    monkeypatch.setattr(cluster.local, "LocalCluster", FakeCluster)
    argv = [
        "--manifest",
        str(manifest),
        "--workload",
        "prefix-repetition",
        "--num-requests",
        "6",
        "--max-concurrency",
        "1",
        "--seed",
        "21",
        "--vocab-size",
        "512",
        "--no-progress",
        "--out",
        str(tmp_path / "run"),
        "--no-plots",
        "-o",
        "prefix_len=12",
        "-o",
        "suffix_len=4",
        "-o",
        "output_len=2",
    ]
    assert main(argv) == 0
    assert started == [BLOCK, "closed"]
    data = json.loads((tmp_path / "run" / "results.json").read_text())
    assert data["config"]["block_size"] == BLOCK
    assert [r["cached_tokens"] for r in data["records"]] == [
        r["oracle_cached_tokens"] for r in data["records"]
    ]


def small_agent(**changes) -> AgentWorkload:
    """Agent sessions of 24 + 16 shared tokens, a 6-token task, 12-token tool outputs."""
    base = dict(
        system_len=24, tools_len=16, task_len=6, tool_output_len=12, output_len=3, min_turns=2
    )
    return AgentWorkload(**{**base, "max_context": 250, **changes})


def test_agent_sessions_wait_their_tool_time_and_run_as_many_as_sized(address):
    """The agent workload through the real server: each turn is sent its think_s after the
    previous answer, and the sessions in flight are the workload's live_sessions."""
    w = small_agent(max_turns=3, think_s=0.05, live_context_x=2.0, kv_tokens=64)
    assert w.live_sessions() == 5  # ceil((2 x 64 - 40) / (6 + 15 x (2.5 - 1) / 2 + 3))
    summary, records = run(address, w, seed=9)
    check_run(summary, records)
    planned = {s.request_id: s for s in replay(w, TOKENS, 9, 12)}
    by_id = {r.request_id: r for r in records}
    for rid, r in by_id.items():
        spec = planned[rid]
        if spec.turn:
            before = by_id[f"{spec.session}-{spec.turn - 1}"]
            assert r.send_s - before.end_s >= spec.think_s > 0
    spans = [(r.send_s, r.end_s) for r in records]
    most = max(sum(s <= t < e for s, e in spans) for t, _ in spans)
    assert most <= 5
    assert summary["cache"]["cached_fraction"] > 0.3


def conversations_file(tmp_path, sessions: int = 6, lines: int = 4) -> str:
    """A trace of `sessions` conversations of `lines` turns, 12 new tokens and 3 out each."""
    rows = [
        dict(session_id=f"c{i}", input_length=12, output_length=3, hash_ids=[100 * i + k])
        for i in range(sessions)
        for k in range(lines)
    ]
    path = tmp_path / "conversations.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


def test_sessions_cut_short_by_their_context_give_back_their_turns(address, tmp_path):
    """Each conversation claims its 4 turns at the start but its context fills after 2
    (12 + 3 + 12 + 3 = 30 positions; a third turn would need 45 > 40): the run still sends
    --num-requests, from as many conversations as it takes, never more than 4 at once."""
    w = TraceWorkload(path=conversations_file(tmp_path), block_len=BLOCK, max_context=40)
    summary, records = run(address, w, seed=11, max_concurrency=4)
    check_run(summary, records)
    turns: dict[str, list[int]] = {}
    for r in records:
        session, turn = r.request_id.rsplit("-", 1)
        turns.setdefault(session, []).append(int(turn))
    assert sorted(turns.values()) == [[0, 1]] * 6
    spans = [(r.send_s, r.end_s) for r in records]
    assert max(sum(s <= t < e for s, e in spans) for t, _ in spans) <= 4


def test_an_agent_workload_without_kv_tokens_sizes_itself_from_the_cluster(address):
    w = small_agent(max_turns=2, think_s=0.0, live_context_x=0.05)
    summary, records = run(address, w, seed=10, num_requests=4)
    check_run(summary, records, n=4)
    # the fixture's decode worker: 1,024 blocks of 4 tokens, all free between runs
    assert summary["config"]["options"]["kv_tokens"] == 1024 * BLOCK
