"""The session extension fields at both front doors: `session_id` / `retention_seconds` in the
bodies of /v1/chat/completions, /v1/completions and /v1/responses (the `openai` SDK sends them
as extra_body) and in gRPC GenerateRequest reach Router.generate as a SessionHint; a bad value
is a 400 naming the field / INVALID_ARGUMENT, and nothing reaches the router."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import openai
import pytest

from perf.bench.client import GrpcClient, HttpClient
from perf.bench.specs import RequestSpec
from router.openai_http import create_app
from router.proto import inference_pb2 as pb
from router.server import start_server
from router.sessions import SessionHint
from tests.router.scripted import ScriptedRouter
from tests.router.serving import BackgroundLoop, http_serving
from tests.router.test_grpc_fields import grpc_serving

ASK = [{"role": "user", "content": "Weather in Paris?"}]


def test_the_openai_bodies_carry_the_session(tokenizer):
    router = ScriptedRouter(tokenizer, ["sunny"])
    with http_serving(create_app(router, ["tiny"], tokenizer=tokenizer)) as (url, _):
        with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
            client.chat.completions.create(
                model="tiny",
                messages=ASK,
                extra_body={"session_id": "agent-7", "retention_seconds": 120},
            )
            client.completions.create(
                model="tiny", prompt=[5, 6, 7], extra_body={"session_id": "agent-7"}
            )
            client.responses.create(
                model="tiny",
                input="Weather?",
                extra_body={"session_id": "agent-8", "retention_seconds": 1.5},
            )
            client.chat.completions.create(model="tiny", messages=ASK)
    assert router.sessions == [
        SessionHint("agent-7", 120.0),
        SessionHint("agent-7", None),
        SessionHint("agent-8", 1.5),
        None,
    ]


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"retention_seconds": 30}, "retention_seconds", "retention_seconds needs a session_id"),
        ({"session_id": "s", "retention_seconds": 601}, "retention_seconds", "at most max_ret"),
        ({"session_id": "s", "retention_seconds": 0}, "retention_seconds", "greater than 0"),
        ({"session_id": ""}, "session_id", "at least 1 character"),
        ({"session_id": "x" * 257}, "session_id", "at most 256 characters"),
    ],
)
def test_a_bad_session_field_is_a_400_naming_it(tokenizer, fields, param, message):
    router = ScriptedRouter(tokenizer, ["sunny"])
    with http_serving(create_app(router, ["tiny"], tokenizer=tokenizer)) as (url, _):
        chat = httpx.post(
            f"{url}/v1/chat/completions", json={"model": "tiny", "messages": ASK, **fields}
        )
        responses = httpx.post(
            f"{url}/v1/responses", json={"model": "tiny", "input": "hi", **fields}
        )
    assert router.calls == []
    for reply in (chat, responses):
        assert reply.status_code == 400
        error = reply.json()["error"]
        assert error["param"] == param and message in error["message"], error


def test_grpc_carries_the_session_and_refuses_bad_fields(tokenizer):
    router = ScriptedRouter(tokenizer, ["sunny"])
    ids = pb.TokenIds(ids=[5, 6, 7])
    with grpc_serving(router, tokenizer) as stub:
        list(
            stub.Generate(
                pb.GenerateRequest(
                    prompt_token_ids=ids, session_id="agent-7", retention_seconds=45.0
                ),
                timeout=30,
            )
        )
        list(stub.Generate(pb.GenerateRequest(prompt_token_ids=ids, session_id="a"), timeout=30))
        list(stub.Generate(pb.GenerateRequest(prompt_token_ids=ids), timeout=30))
        refused = []
        for bad in (
            dict(retention_seconds=5.0),
            dict(session_id="s", retention_seconds=900.0),
            dict(session_id=""),
        ):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(pb.GenerateRequest(prompt_token_ids=ids, **bad), timeout=30))
            refused.append((e.value.code(), e.value.details()))
    assert router.sessions == [SessionHint("agent-7", 45.0), SessionHint("a"), None]
    assert refused == [
        (
            grpc.StatusCode.INVALID_ARGUMENT,
            "retention_seconds needs a session_id (the blocks are kept for a session)",
        ),
        (
            grpc.StatusCode.INVALID_ARGUMENT,
            "retention_seconds=900 is invalid: at most max_retention_seconds=600",
        ),
        (
            grpc.StatusCode.INVALID_ARGUMENT,
            "session_id='' is invalid: a string of 1 to 256 characters",
        ),
    ]


def test_the_bench_clients_send_the_session_unique_to_their_run(tokenizer):
    router = ScriptedRouter(tokenizer, ["sunny"])
    spec = RequestSpec("g0", 1, (5, 6, 7), 2, session_id="g0", retention_seconds=30.0)
    plain = RequestSpec("r0", 0, (5, 6, 7), 2)
    loop = BackgroundLoop()
    server, port = loop.run(start_server(router, port=0, tokenizer=tokenizer))
    try:

        async def grpc_run() -> None:
            client = GrpcClient(f"127.0.0.1:{port}", 0.0)
            for s in (spec, plain):
                record, _ = await client.generate(s, "run1", 30)
                assert record.ok, record.error
            await client.close()

        asyncio.run(grpc_run())
        with http_serving(create_app(router, ["tiny"], tokenizer=tokenizer)) as (url, _):

            async def http_run() -> None:
                client = HttpClient(url, 0.0, model="tiny")
                record, _ = await client.generate(spec, "run2", 30)
                assert record.ok, record.error
                await client.close()

            asyncio.run(http_run())
    finally:
        loop.run(server.stop(1))
        loop.close()
    assert router.sessions == [SessionHint("run1-g0", 30.0), None, SessionHint("run2-g0", 30.0)]
