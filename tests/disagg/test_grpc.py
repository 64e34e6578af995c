"""baton.v1.Inference over gRPC: streamed greedy tokens equal the offline engine's, usage
is reported, each bad request gets its status code and the server keeps serving."""

from __future__ import annotations

import asyncio
import threading
from contextlib import contextmanager

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decode_worker.worker import DecodeWorker
from engine import LLM, SamplingParams
from prefill_worker.worker import PrefillWorker
from router.proto import inference_pb2 as pb
from router.proto import inference_pb2_grpc as pb_grpc
from router.router import Router
from router.server import start_server
from tests.helpers import random_prompts


@contextmanager
def serving(prefill_options: dict, decode_options: dict, max_model_len: int | None = None):
    """An in-process prefill + decode pair behind a Router and the real gRPC server; yields
    (stub, channel, (prefill, decode)) and tears everything down."""
    p, d = PrefillWorker("p0", prefill_options), DecodeWorker("d0", decode_options)
    d.connect_prefill("p0", p.connect_decode("d0", d), p)
    router = Router(
        {"p0": p},
        {"d0": d},
        block_size=prefill_options["block_size"],
        hash_seed="baton",
        max_model_len=max_model_len,
    )
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    srv, port = asyncio.run_coroutine_threadsafe(start_server(router, port=0), loop).result(30)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield pb_grpc.InferenceStub(channel), channel, (p, d)
    finally:
        channel.close()
        asyncio.run_coroutine_threadsafe(srv.stop(1), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        p.shutdown()
        d.shutdown()


@pytest.fixture(scope="module")
def server(tiny_llama):
    options = dict(
        model=tiny_llama,
        skip_tokenizer_init=True,
        block_size=4,
        num_kv_blocks=256,
        chunk_size=16,
        max_model_len=200,
    )
    with serving(options, options, max_model_len=200) as (stub, channel, workers):
        yield stub, channel, options, workers


def generate(stub, ids, **sampling) -> list:
    req = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(**sampling)
    )
    return list(stub.Generate(req, timeout=60))


def test_streamed_tokens_equal_offline_engine_and_usage(server):
    stub, _, options, _ = server
    prompt = random_prompts([30], seed=301)[0]
    expected = LLM(**options).generate(
        [prompt], SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    )[0]
    replies = generate(stub, prompt, max_tokens=7, temperature=0.0, ignore_eos=True)
    assert [t for r in replies for t in r.token_ids] == expected.token_ids
    assert len(replies) >= 2  # streamed, not one final message
    last = replies[-1]
    assert last.finish_reason == "length"
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (30, 7)
    assert (last.usage.prefill_worker, last.usage.decode_worker) == ("p0", "d0")
    again = generate(stub, prompt, max_tokens=2, temperature=0.0, ignore_eos=True)
    assert again[-1].usage.cached_tokens == 28  # 7 full blocks, last token recomputed


def test_n_choices_with_logprobs_equal_the_offline_engines(server):
    stub, _, options, _ = server
    prompt = random_prompts([12], seed=305)[0]
    params = dict(max_tokens=4, temperature=1.0, seed=3, ignore_eos=True, logprobs=2)
    expected = LLM(**options).generate([prompt], SamplingParams(n=2, prompt_logprobs=1, **params))
    replies = generate(stub, prompt, n=2, prompt_logprobs=1, **params)
    tokens: dict[int, list[int]] = {0: [], 1: []}
    logprobs: dict[int, list[tuple]] = {0: [], 1: []}
    for r in replies:
        tokens[r.index] += r.token_ids
        logprobs[r.index] += [
            (lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top])
            for lp in r.logprobs
        ]
    assert [tokens[0], tokens[1]] == [o.token_ids for o in expected]
    for index, out in enumerate(expected):
        want = [lp.to_wire() for lp in out.logprobs]
        assert [t for t, _, _ in logprobs[index]] == [t for t, _, _ in want]
        assert [lp for _, lp, _ in logprobs[index]] == pytest.approx(
            [lp for _, lp, _ in want], abs=1e-4
        )
        assert [[i for i, _ in top] for _, _, top in logprobs[index]] == [
            [i for i, _ in top] for _, _, top in want
        ]
    prompt_logprobs = [(p.token_id, p.logprob) for p in replies[0].prompt_logprobs]
    want = [e.to_wire() for e in expected[0].prompt_logprobs[1:]]
    assert [t for t, _ in prompt_logprobs] == [t for t, _, _ in want] == prompt[1:]
    assert [lp for _, lp in prompt_logprobs] == pytest.approx([lp for _, lp, _ in want], abs=1e-4)
    assert sorted((r.index, r.finish_reason) for r in replies if r.finish_reason) == [
        (0, "length"),
        (1, "length"),
    ]
    assert replies[-1].usage.completion_tokens == 8


@pytest.mark.parametrize(
    ("request_kwargs", "code", "text"),
    [
        (dict(prompt_token_ids=pb.TokenIds(ids=[])), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
        (dict(), grpc.StatusCode.INVALID_ARGUMENT, "required"),
        (dict(prompt="hello"), grpc.StatusCode.INVALID_ARGUMENT, "tokenizer"),
        (
            dict(prompt_token_ids=pb.TokenIds(ids=[5]), sampling=pb.SamplingParams(temperature=-1)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "temperature",
        ),
        (
            dict(prompt_token_ids=pb.TokenIds(ids=[5] * 250)),
            grpc.StatusCode.OUT_OF_RANGE,
            "max_model_len",
        ),
    ],
)
def test_errors_have_status_codes_and_server_keeps_serving(server, request_kwargs, code, text):
    stub, _, _, workers = server
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb.GenerateRequest(**request_kwargs), timeout=30))
    assert err.value.code() == code
    assert text in err.value.details() and "Traceback" not in err.value.details()
    assert generate(stub, [5, 6, 7], max_tokens=2, ignore_eos=True)[-1].finish_reason == "length"
    for w in workers:
        w.check_integrity()


def test_health_status_and_cancel_frees_blocks(server):
    stub, channel, _, (p, d) = server
    health = health_pb2_grpc.HealthStub(channel)
    reply = health.Check(health_pb2.HealthCheckRequest(service="baton.v1.Inference"))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    status = stub.ClusterStatus(pb.ClusterStatusRequest())
    assert sorted((w.worker_id, w.role, w.healthy) for w in status.workers) == [
        ("d0", "decode", True),
        ("p0", "prefill", True),
    ]
    call = stub.Generate(
        pb.GenerateRequest(
            request_id="long",
            prompt_token_ids=pb.TokenIds(ids=[9] * 20),
            sampling=pb.SamplingParams(max_tokens=150, ignore_eos=True),
        ),
        timeout=60,
    )
    next(call)
    call.cancel()
    for _ in range(100):
        if d.stats().free_blocks == 256 and p.stats().free_blocks == 256:
            break
        threading.Event().wait(0.05)
    assert d.stats().free_blocks == 256 and p.stats().free_blocks == 256
    d.check_integrity()


def test_32_concurrent_streams_all_complete(server):
    stub, _, options, (p, d) = server
    prompts = random_prompts([5 + i for i in range(32)], seed=302)
    expected = LLM(**options).generate(
        prompts, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    )
    got: dict[int, list[int]] = {}

    def one(i: int) -> None:
        replies = generate(stub, prompts[i], max_tokens=5, temperature=0.0, ignore_eos=True)
        assert replies[-1].finish_reason == "length"
        got[i] = [t for r in replies for t in r.token_ids]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [got.get(i) for i in range(32)] == [e.token_ids for e in expected]
    d.check_integrity()
    p.check_integrity()


def test_deadline_exceeded_aborts_and_frees_blocks(server):
    stub, _, _, (p, d) = server
    request = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=[11] * 20),
        sampling=pb.SamplingParams(max_tokens=179, ignore_eos=True),
    )
    with pytest.raises(grpc.RpcError) as err:  # 179 decode steps take well over 0.2 s
        list(stub.Generate(request, timeout=0.2))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    for _ in range(100):
        if d.stats().free_blocks == 256 and p.stats().free_blocks == 256:
            break
        threading.Event().wait(0.05)
    assert d.stats().free_blocks == 256 and p.stats().free_blocks == 256


def test_admission_refusal_is_resource_exhausted(tiny_llama):
    # The decode worker has 16 blocks (64 tokens): a 100-token prompt cannot be reserved.
    options = dict(
        model=tiny_llama, skip_tokenizer_init=True, block_size=4, chunk_size=16, max_model_len=200
    )
    with serving(dict(options, num_kv_blocks=256), dict(options, num_kv_blocks=16)) as (
        stub,
        _,
        (p, d),
    ):
        with pytest.raises(grpc.RpcError) as err:
            generate(stub, [5] * 100, max_tokens=2)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "KV blocks" in err.value.details()
        assert generate(stub, [5] * 20, max_tokens=2, ignore_eos=True)[-1].finish_reason == (
            "length"
        )
        d.check_integrity()
        p.check_integrity()


class DroppedConnection:
    """A worker whose connection drops on one call (its process died): `method` raises."""

    def __init__(self, worker, method: str) -> None:
        self.worker, self.method = worker, method

    def __getattr__(self, name):
        if name == self.method:
            raise ConnectionError("connection reset by peer")
        return getattr(self.worker, name)


@contextmanager
def door(router: Router):
    """The real gRPC server over `router`; yields a stub."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    srv, port = asyncio.run_coroutine_threadsafe(start_server(router, port=0), loop).result(30)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield pb_grpc.InferenceStub(channel)
    finally:
        asyncio.run_coroutine_threadsafe(srv.stop(1), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)


def test_prefill_pool_lost_under_a_request_prefills_it_on_the_decode_worker(server):
    """The only prefill worker fails under the request: it moves to a local prefill on the
    decode worker and completes with the offline engine's tokens."""
    _, _, options, (p, d) = server
    router = Router(
        {"p0": DroppedConnection(p, "prefill")},
        {"d0": d},
        block_size=options["block_size"],
        hash_seed="baton",
        wait_for_workers_s=0.0,
    )
    prompt = random_prompts([20], seed=41)[0]
    greedy = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = LLM(**options).generate([prompt], SamplingParams(**greedy))[0].token_ids
    with door(router) as stub:
        replies = generate(stub, prompt, **greedy)
    assert [t for r in replies for t in r.token_ids] == want
    assert (replies[-1].usage.prefill_worker, replies[-1].usage.decode_worker) == ("d0", "d0")
    assert router.num_migrations == 1
    d.check_integrity()


def test_request_with_no_worker_left_to_move_to_is_unavailable(server):
    """Prefill worker and then the decode worker fail under the request: no worker is left,
    and the client gets UNAVAILABLE naming both, not UNKNOWN and an exception class."""
    _, _, options, (p, d) = server
    router = Router(
        {"p0": DroppedConnection(p, "prefill")},
        {"d0": DroppedConnection(d, "local_generate")},
        block_size=options["block_size"],
        hash_seed="baton",
        wait_for_workers_s=0.0,
    )
    with door(router) as stub:
        with pytest.raises(grpc.RpcError) as err:
            generate(stub, [5] * 20, max_tokens=4)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "request failed on workers p0, d0 and could not move" in err.value.details()
    assert "Unexpected" not in err.value.details()
    d.check_integrity()
    assert d.stats().num_requests == 0
