"""A tiny end-to-end `baton bench` over the OpenAI-compatible HTTP door: the same workload and
seed through the gRPC door and the HTTP door of two fresh, identical clusters (in-process
prefill + decode pair on the tiny checkpoint, loopback only) give the same tokens and cache
hits; KV bytes moved come from /metrics and equal what the prefill worker sent."""

from __future__ import annotations

import asyncio
import json
from contextlib import contextmanager
from pathlib import Path

import pytest

from decode_worker.worker import DecodeWorker
from perf.bench.client import GrpcClient, HttpClient, counter_rise
from perf.bench.command import main
from perf.bench.driver import BenchConfig, bench
from perf.bench.report import table
from perf.bench.workloads import PrefixRepetitionWorkload, TokenSpace
from prefill_worker.worker import PrefillWorker
from router.metrics_exposition import router_scrape
from router.openai_http import create_app
from router.router import Router
from router.security import ApiKeys, GrpcKeyInterceptor
from router.server import start_server
from tests.router.serving import http_serving

TOKENS = TokenSpace(low=3, high=512)
BLOCK = 4
KEY = "bench-key"
WORKLOAD = PrefixRepetitionWorkload(num_prefixes=3, prefix_len=20, suffix_len=6, output_len=3)


@contextmanager
def serving(checkpoint: str):
    """A fresh prefill + decode pair behind one Router with both doors (API key KEY);
    yields (grpc address, http url, prefill worker)."""
    options = dict(
        model=checkpoint,
        skip_tokenizer_init=True,
        block_size=BLOCK,
        num_kv_blocks=1024,
        chunk_size=32,
        max_model_len=256,
    )
    p, d = PrefillWorker("p0", options), DecodeWorker("d0", options)
    d.connect_prefill("p0", p.connect_decode("d0", d), p)
    router = Router({"p0": p}, {"d0": d}, block_size=BLOCK, hash_seed="baton", max_model_len=256)
    keys = ApiKeys([KEY])
    app = create_app(router, ["tiny"], api_keys=keys, metrics_text=lambda: router_scrape(router))
    try:
        with http_serving(app) as (url, loop):
            srv, port = loop.run(
                start_server(router, port=0, interceptors=[GrpcKeyInterceptor(keys)])
            )
            try:
                yield f"127.0.0.1:{port}", url, p
            finally:
                loop.run(srv.stop(1))
    finally:
        app.state.door.close()
        p.shutdown()
        d.shutdown()


@pytest.fixture
def answers(monkeypatch):
    """Every answer's token ids, by (door, request id), as the clients returned them."""
    seen: dict[tuple[str, str], list[int]] = {}
    for door, cls in (("grpc", GrpcClient), ("http", HttpClient)):
        original = cls.generate

        async def generate(self, spec, run_id, timeout, _original=original, _door=door):
            record, answer = await _original(self, spec, run_id, timeout)
            seen[(_door, spec.request_id)] = answer
            return record, answer

        monkeypatch.setattr(cls, "generate", generate)
    return seen


def block_bytes(checkpoint: Path) -> int:
    cfg = json.loads((checkpoint / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * BLOCK * cfg["num_key_value_heads"] * head_dim * 4


def test_http_door_run_equals_grpc_run(tiny_llama, answers, tmp_path, capsys):
    config = BenchConfig(num_requests=12, block_size=BLOCK, timeout_s=60, max_concurrency=1)
    runs = {}
    for door in ("grpc", "http"):
        with serving(tiny_llama) as (grpc_address, url, prefill):
            address = url if door == "http" else grpc_address
            runs[door] = asyncio.run(
                bench(address, WORKLOAD, TOKENS, config, door=door, api_key=KEY)
            )
            stats = prefill.stats()
            if door == "http":  # the CLI: a wrong key and an unknown model, as HTTP codes
                base = ["--door", "http", "--address", url, "--num-requests", "2"]
                base += ["--vocab-size", "512", "--block-size", str(BLOCK), "--no-progress"]
                base += ["--workload", "random", "-o", "input_len=8", "-o", "output_len=2"]
                assert main([*base, "--api-key", "wrong", "--model", "tiny"]) == 1
                assert "HTTP_401 x2" in capsys.readouterr().out
                out = tmp_path / "bad-model"
                argv = [*base, "--api-key", KEY, "--model", "nope", "--out", str(out)]
                assert main([*argv, "--no-plots"]) == 1
                data = json.loads((out / "results.json").read_text())
                assert data["failures"] == {"HTTP_404": 2}
                assert "KV bytes moved" in capsys.readouterr().out
    (g, g_records), (h, h_records) = runs["grpc"], runs["http"]
    for summary, records in runs.values():
        assert summary["completed"] == 12 and summary["failed"] == 0, summary["failures"]
        assert all((r.prefill_worker, r.decode_worker) == ("p0", "d0") for r in records)
        assert all(r.output_tokens == 3 and r.ttft > 0 for r in records)
    assert [r.request_id for r in h_records] == [r.request_id for r in g_records]
    assert [r.prompt_tokens for r in h_records] == [r.prompt_tokens for r in g_records]
    ids = [r.request_id for r in g_records]  # not the CLI runs' ("r...")
    assert [answers["http", i] for i in ids] == [answers["grpc", i] for i in ids]
    assert all(len(answers["http", i]) == 3 for i in ids)
    assert [r.cached_tokens for r in h_records] == [r.cached_tokens for r in g_records]
    assert [r.cached_tokens for r in h_records] == [r.oracle_cached_tokens for r in h_records]
    assert h["cache"] == g["cache"] and h["cache"]["cached_fraction"] > 0.3
    # KV bytes: from /metrics over HTTP; the gRPC door has no metrics page (null)
    assert g["kv"]["kv_bytes_moved"] is None
    # engine steps: likewise, per worker, from /metrics (every request decoded 2 tokens on d0)
    assert g["engine_steps"] == {}
    assert set(h["engine_steps"]) == {"p0", "d0"}
    assert all(w["steps"] > 0 and w["busy_s"] > 0 for w in h["engine_steps"].values())
    assert h["engine_steps"]["d0"]["steps"] >= 2
    d0 = h["engine_steps"]["d0"]
    assert f"engine d0                   {d0['steps']} steps, {d0['busy_s']:.1f} s" in table(h)
    assert h["kv"]["transfers"] == 12  # one per request (all prefilled remotely on p0)
    assert h["kv"]["transfer_s"] > 0
    moved = h["kv"]["kv_bytes_moved"]
    assert moved == stats.bytes_sent == stats.blocks_sent * block_bytes(Path(tiny_llama)) > 0
    assert h["config"]["door"] == "http" and h["load_balance"]["decode"]["requests"] == {"d0": 12}


def test_counter_rise_over_a_run_per_worker():
    before = {
        "kv_bytes": 100.0,
        "kv_time": [1.0, 0.25],  # a count no worker's step count shares
        "steps": {"p0": [3.0, 0.5], "d0": [10.0, 1.0]},
    }
    after = {
        "kv_bytes": 612.0,
        "kv_time": [3.0, 0.5],
        "steps": {"p0": [5.0, 0.75], "d0": [30.0, 4.0], "d1": [2.0, 0.2]},
        "sums": {
            "tier_read_bytes": 4096.0,
            "tier_written_bytes": 8192.0,
            "tier_dropped_writes": 3.0,
            "tier_loads": 2.0,
            "tier_load_s": 0.5,
            "pulls": 3.0,
            "pull_decisions:pull": 3.0,
        },
    }
    before["sums"] = {"pulls": 1.0, "pull_decisions:pull": 1.0, "tier_dropped_writes": 1.0}
    assert counter_rise(before, after) == {
        "kv_bytes_moved": 512,
        "kv_transfers": 2,
        "kv_transfer_s": 0.25,
        "engine_steps": {
            "d0": {"steps": 20, "busy_s": 3.0},
            "d1": {"steps": 2, "busy_s": 0.2},  # a worker that joined during the run
            "p0": {"steps": 2, "busy_s": 0.25},
        },
        "tier_read_bytes": 4096,
        "tier_written_bytes": 8192,
        "tier_dropped_writes": 2,
        "tier_loads": 2,
        "tier_load_s": 0.5,
        "pulls": 2,
        "pull_bytes": 0,
        "pull_decisions": {"pull": 2},
    }
    # no prefill workers: no KV bytes family at all
    nothing = {"kv_bytes": None, "kv_time": [0.0, 0.0], "steps": {}}
    assert counter_rise(nothing, nothing) == {
        "kv_bytes_moved": None,
        "kv_transfers": 0,
        "kv_transfer_s": 0.0,
        "engine_steps": {},
        "tier_read_bytes": 0,
        "tier_written_bytes": 0,
        "tier_dropped_writes": 0,
        "tier_loads": 0,
        "tier_load_s": 0.0,
        "pulls": 0,
        "pull_bytes": 0,
        "pull_decisions": {},
    }
