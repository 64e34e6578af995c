"""`baton bench --url A --url B`: the side-by-side table from exact records, the options, what
each kind of server is sent and how its stream is counted, and one real run against a Baton
HTTP door (the same server under two labels: the same greedy answers, every token counted)."""

from __future__ import annotations

import json

import pytest

from perf.bench.command import main
from perf.bench.report import summarize
from perf.bench.servers import chunk_tokens, reconcile, request_fields, server_kind
from perf.bench.side_by_side import parse_streams, side_by_side_table, targets_of
from perf.bench.timeline import RequestRecord
from perf.bench.workloads import SharedPrefixWorkload, ShortPromptWorkload, TokenSpace, replay
from tests.bench.test_http_bench import BLOCK, KEY, serving


def record(rid: str, send: float, times: list[float], status: str = "OK") -> RequestRecord:
    return RequestRecord(rid, send, times[-1] if times else send, tuple((t, 1) for t in times), 8,
                         status=status)  # fmt: skip


def test_table_shows_each_server_beside_the_others():
    fast = summarize([record("a", 0.0, [0.1, 0.2, 0.3]), record("b", 0.0, [0.3, 0.4, 0.5])])
    slow = summarize([record("a", 0.0, [1.0, 2.0, 3.0]), record("b", 0.0, [], "HTTP_500")])
    text = side_by_side_table({4: {"baton": fast, "llama.cpp": slow}, 16: {"baton": fast}}, "t")
    assert text.splitlines() == [
        "t",
        "                            baton        llama.cpp",
        "4 streams",
        "  TTFT p50 ms               200.0           1000.0",
        "  TTFT p99 ms               298.0           1000.0",
        "  ITL p50 ms                100.0           1000.0",
        "  ITL p99 ms                100.0           1000.0",
        "  output tok/s               12.0              1.0",
        "  requests ok                 2/2              1/2",
        "  errors                        0  1 (HTTP_500 x1)",
        "16 streams",
        "  TTFT p50 ms               200.0                -",
        "  TTFT p99 ms               298.0                -",
        "  ITL p50 ms                100.0                -",
        "  ITL p99 ms                100.0                -",
        "  output tok/s               12.0                -",
        "  requests ok                 2/2                -",
        "  errors                        0                -",
    ]


def test_options():
    assert targets_of(["127.0.0.1:8080/", "http://h:1"], ["llama.cpp"]) == [
        targets_of(["http://127.0.0.1:8080"], ["llama.cpp"])[0],
        targets_of(["http://h:1"], ["h:1"])[0],
    ]
    assert targets_of(["h:1"])[0].label == "h:1"
    with pytest.raises(ValueError, match="labels must differ"):
        targets_of(["h:1", "h:2"], ["x", "x"])
    with pytest.raises(ValueError, match="2 --label for 1 --url"):
        targets_of(["h:1"], ["x", "y"])
    assert parse_streams("1,4,16") == [1, 4, 16]
    for bad in ("0,4", "four", ""):
        with pytest.raises(ValueError, match="--streams"):
            parse_streams(bad)


def test_each_kind_of_server_is_asked_for_exactly_max_tokens():
    assert server_kind({"data": [{"id": "m", "owned_by": "llamacpp"}]}) == "llamacpp"
    assert server_kind({"data": [{"id": "m", "owned_by": "vllm"}]}) == "vllm"
    assert server_kind({"data": [{"id": "m", "owned_by": "baton"}]}) == "baton"
    assert server_kind({"data": [{"id": "m", "owned_by": "someone"}]}) == "openai"
    assert request_fields("baton", 64) == {"ignore_eos": True, "return_token_ids": True}
    assert request_fields("llamacpp", 64) == {
        "ignore_eos": True,
        "n_predict": 64,
        "cache_prompt": True,
    }
    assert request_fields("vllm", 64)["min_tokens"] == 64
    with pytest.raises(ValueError, match="unknown server kind"):
        request_fields("tgi", 1)


def test_stream_chunks_are_counted_with_or_without_token_ids():
    assert chunk_tokens({"text": "ab", "token_ids": [5, 6]}) == [5, 6]
    assert chunk_tokens({"text": "a", "finish_reason": None}) == 1
    assert chunk_tokens({"text": "", "finish_reason": None}) == 1  # an incomplete character
    assert chunk_tokens({"text": "a", "finish_reason": "length"}) == 1
    assert chunk_tokens({"text": "", "finish_reason": "length"}) == 0
    chunks = [(0.1, 1), (0.2, 1), (0.3, 1)]
    reconcile(chunks, 5)  # the usage says 5: two tokens came without a chunk of their own
    assert chunks == [(0.1, 1), (0.2, 1), (0.3, 3)]
    reconcile(chunks, 2)
    assert chunks == [(0.1, 1), (0.2, 1)]
    reconcile(chunks, None)
    assert chunks == [(0.1, 1), (0.2, 1)]


def test_comparison_workloads():
    tokens = TokenSpace(low=3, high=512)
    shared = replay(SharedPrefixWorkload(system_len=40, user_len=5, output_len=7), tokens, 1, 4)
    assert {s.prompt_token_ids[:40] for s in shared} == {shared[0].prompt_token_ids[:40]}
    assert len({s.prompt_token_ids[40:] for s in shared}) == 4
    assert [len(s.prompt_token_ids) for s in shared] == [45] * 4
    assert [s.max_tokens for s in shared] == [7] * 4
    short = replay(ShortPromptWorkload(), tokens, 1, 3)
    assert [(len(s.prompt_token_ids), s.max_tokens) for s in short] == [(256, 64)] * 3


def test_two_labels_of_one_baton_door(tiny_llama, tmp_path, capsys):
    out = tmp_path / "side"
    with serving(tiny_llama) as (_, url, _):
        argv = ["--url", url, "--label", "first", "--url", url, "--label", "second"]
        argv += ["--api-key", KEY, "--streams", "1,2", "--num-requests", "4", "--warmup", "1"]
        argv += ["--workload", "shared-prefix", "-o", "system_len=24", "-o", "user_len=8"]
        argv += ["-o", "output_len=3", "--vocab-size", "512", "--block-size", str(BLOCK)]
        assert main([*argv, "--no-progress", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "shared-prefix (seed 0, 4 requests a run)"
    assert lines[1].split() == ["first", "second"]
    assert [line.split() for line in lines if "requests ok" in line] == [
        ["requests", "ok", "4/4", "4/4"]
    ] * 2
    runs = json.loads((out / "side_by_side.json").read_text())["runs"]
    assert [(r["streams"], r["label"]) for r in runs] == [
        (1, "first"), (1, "second"), (2, "first"), (2, "second")
    ]  # fmt: skip
    for run in runs:
        s = run["summary"]
        assert (s["completed"], s["failed"]) == (4, 0)
        assert s["config"]["server_kind"] == "baton"
        assert s["config"]["max_concurrency"] == run["streams"]
        assert s["throughput"]["output_tokens_per_s"] > 0
        # each stream count draws its own prompts (seed + streams), the warm-up the first and
        # the run the next four: the warm-up cached the system prompt (6 blocks), so every
        # measured prompt of the first label hits it, and only it; the second label (the same
        # server) is sent the same prompts again and hits all but their last block
        assert (s["config"]["seed"], s["config"]["skip_sessions"]) == (run["streams"], 1)
        hit_blocks = 6 if run["label"] == "first" else 7
        assert s["cache"]["cached_tokens"] == 4 * hit_blocks * BLOCK


def test_a_request_on_a_connection_closed_before_any_reply_is_sent_again():
    """A server that drops the first connection unanswered (as a kept-alive connection closed
    under a new request) and answers the second: the request succeeds, counted once."""
    import asyncio

    from perf.bench.client import HttpClient
    from perf.bench.workloads import RequestSpec

    events = [
        {"choices": [{"text": "a", "finish_reason": None}]},
        {"choices": [{"text": "b", "finish_reason": None}]},
        {"choices": [{"text": "", "finish_reason": "length"}], "usage": {"completion_tokens": 2}},
    ]
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    seen = []

    async def handle(reader, writer):
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        length = int(head.lower().split("content-length:")[1].split("\r\n")[0])
        seen.append(json.loads(await reader.readexactly(length)))
        if len(seen) > 1:
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n"
                + f"content-length: {len(body)}\r\n\r\n{body}".encode()
            )
            await writer.drain()
        writer.close()

    async def run():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = HttpClient(f"http://127.0.0.1:{port}", 0.0, model="m", kind="llamacpp")
        try:
            return await client.generate(RequestSpec("s", 0, (5, 6, 7), 2), "run", 10.0)
        finally:
            await client.close()
            server.close()

    record, answer = asyncio.run(run())
    assert record.status == "OK" and record.output_tokens == 2 and answer == []
    assert len(seen) == 2 and seen[0] == seen[1]
    assert seen[0]["n_predict"] == 2 and seen[0]["prompt"] == [5, 6, 7]
