"""baton.v1.Inference's sampling fields (penalties, logit_bias, min_tokens, logprobs, n,
structured output) reach the router as the sampling dict, and its replies carry each
message's choice index, logprobs and the prompt's logprobs (over a scripted router)."""

from __future__ import annotations

import asyncio
import threading
from contextlib import contextmanager

import grpc
import pytest

from router.proto import inference_pb2 as pb
from router.proto import inference_pb2_grpc as pb_grpc
from router.server import start_server
from tests.router.scripted import ScriptedRouter


@contextmanager
def grpc_serving(router, tokenizer):
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    srv, port = asyncio.run_coroutine_threadsafe(
        start_server(router, port=0, tokenizer=tokenizer), loop
    ).result(30)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield pb_grpc.InferenceStub(channel)
    finally:
        channel.close()
        asyncio.run_coroutine_threadsafe(srv.stop(1), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)


def test_every_sampling_field_reaches_the_sampling_dict(tokenizer):
    router = ScriptedRouter(tokenizer, ["red"])
    sampling = pb.SamplingParams(
        max_tokens=5,
        temperature=0.5,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.25,
        logit_bias={7: -100.0, 9: 2.5},
        min_tokens=2,
        n=2,
        structured_output=pb.StructuredOutput(
            choice=pb.ChoiceList(choices=["red", "blue"]), disable_any_whitespace=True
        ),
    )
    with grpc_serving(router, tokenizer) as stub:
        request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5, 6, 7]), sampling=sampling)
        list(stub.Generate(request, timeout=30))
        schema = pb.StructuredOutput(json='{"type": "object"}')
        list(
            stub.Generate(
                pb.GenerateRequest(
                    prompt="x", sampling=pb.SamplingParams(structured_output=schema)
                ),
                timeout=30,
            )
        )
    assert router.calls[0] == (
        [5, 6, 7],
        {
            "max_tokens": 5,
            "temperature": 0.5,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.25,
            "repetition_penalty": 1.25,
            "min_tokens": 2,
            "n": 2,
            "logit_bias": {7: -100.0, 9: 2.5},
            "structured_output": {"choice": ["red", "blue"], "disable_any_whitespace": True},
            "ignore_eos": False,
        },
    )
    assert router.calls[1][1]["structured_output"] == {"json": '{"type": "object"}'}


def test_replies_carry_choice_index_logprobs_and_prompt_logprobs(tokenizer):
    texts = ["red", "green blue"]
    router = ScriptedRouter(tokenizer, texts, step=1)
    sampling = pb.SamplingParams(n=2, logprobs=2, prompt_logprobs=1)
    with grpc_serving(router, tokenizer) as stub:
        request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5, 6, 7]), sampling=sampling)
        replies = list(stub.Generate(request, timeout=30))
    by_choice: dict[int, list[int]] = {0: [], 1: []}
    for r in replies:
        by_choice[r.index] += r.token_ids
        assert [lp.token_id for lp in r.logprobs] == list(r.token_ids)
        for lp in r.logprobs:
            assert lp.logprob == -0.25
            assert [(t.token_id, t.logprob) for t in lp.top] == [
                (lp.token_id, -0.25),
                ((lp.token_id + 1) % 512, -2.0),
            ]
    assert [by_choice[0], by_choice[1]] == [tokenizer.encode(t) for t in texts]
    assert [(p.token_id, p.logprob) for p in replies[0].prompt_logprobs] == [(6, -0.25), (7, -0.25)]
    assert all(not r.prompt_logprobs for r in replies[1:])
    ends = [(r.index, r.finish_reason) for r in replies if r.finish_reason]
    assert sorted(ends) == [(0, "stop"), (1, "stop")]
    last = replies[-1]
    assert last.usage.completion_tokens == sum(len(tokenizer.encode(t)) for t in texts)


@pytest.mark.parametrize(
    ("sampling", "words"),
    [
        (pb.SamplingParams(structured_output=pb.StructuredOutput()), "must set one of"),
        (
            pb.SamplingParams(structured_output=pb.StructuredOutput(regex="(")),
            "structured_output.regex",
        ),
        (pb.SamplingParams(presence_penalty=3), "presence_penalty"),
        (pb.SamplingParams(logprobs=21), "logprobs"),
    ],
)
def test_bad_values_are_invalid_argument_naming_the_field(tokenizer, sampling, words):
    router = ScriptedRouter(tokenizer, ["x"])
    with grpc_serving(router, tokenizer) as stub, pytest.raises(grpc.RpcError) as err:
        request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5]), sampling=sampling)
        list(stub.Generate(request, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in err.value.details()
    assert router.calls == []
