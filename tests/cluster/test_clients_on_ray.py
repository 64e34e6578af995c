"""The clients users run, against a real local Ray cluster started from a manifest, in both
shapes (aggregated: no prefill pool; disaggregated: 1 prefill + 1 decode), on the tiny Llama
with its tokenizer: the `openai` SDK (parse into a pydantic model, forced tool calls streamed
and not, chat logprobs equal to the offline engine's, n=2 with a seed), the OpenAI Agents SDK
and LangChain running a bounded tool loop, the gRPC door's structured output + logprobs + n,
lm-eval's local-completions loglikelihoods equal to its own `hf` model's, and a guidellm run
with no errors."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Literal

import agents
import grpc
import jsonschema
import openai
import pytest
from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field

from benchmarks.load_clients import (
    Load,
    guidellm_bodies,
    guidellm_command,
    offline_env,
    read_guidellm,
    run_client,
)
from cluster.local import LocalCluster
from deploy.manifest import parse_manifest
from engine import LLM, SamplingParams
from router.chat_template import ChatRenderer
from router.proto import inference_pb2 as pb
from router.proto import inference_pb2_grpc as pb_grpc
from router.tool_calls import call_text, structural_tag
from tests.cluster.clients import AnswerAfterTool, loglikelihoods, write_task
from tests.cluster.manifests import tiny_manifest
from tests.router.test_agents_end_to_end import ASK, TOOLS, WEATHER, Pick, same_logprobs

pytestmark = pytest.mark.ray

MODEL = "tiny"
ENGINE = dict(block_size=16, num_kv_blocks=1024, chunk_size=512, max_model_len=4096)
SHAPES = {"aggregated": 0, "disaggregated": 1}
PICK = to_strict_json_schema(Pick)


class Forecast(BaseModel):
    sunny: bool


@pytest.fixture(scope="module", params=list(SHAPES))
def cluster(request, tiny_llama_tok):
    manifest = tiny_manifest(tiny_llama_tok, prefill=SHAPES[request.param], **ENGINE)
    manifest["spec"]["model"]["skip_tokenizer_init"] = False
    manifest["spec"]["router"]["served_model_name"] = MODEL
    c = LocalCluster(parse_manifest(manifest)).start(log=lambda _m: None)
    yield c
    c.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_tok):
    from engine.tokenizer import load_tokenizer

    return load_tokenizer(tiny_llama_tok)


@pytest.fixture(scope="module")
def offline(tiny_llama_tok):
    return LLM(tiny_llama_tok, **ENGINE)


@pytest.fixture
def client(cluster):
    with openai.OpenAI(
        base_url=f"{cluster.http_address}/v1", api_key="unused", max_retries=0, timeout=120
    ) as c:
        yield c


def offline_reply(offline, tokenizer, messages, tools=None, **sampling):
    ids = ChatRenderer(tokenizer).render(messages, tools)
    return offline.generate([ids], SamplingParams(**{"temperature": 0.0, **sampling}))[0]


def test_openai_parse_returns_the_pydantic_model(client, offline, tokenizer):
    reply = client.chat.completions.parse(
        model=MODEL, messages=ASK, response_format=Pick, temperature=0, max_completion_tokens=300
    )
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Pick)
    assert Pick.model_validate_json(message.content) == message.parsed
    want = offline_reply(offline, tokenizer, ASK, max_tokens=300, structured_output={"json": PICK})
    assert message.content == want.text


def test_required_tool_calls_streamed_assemble_into_the_non_streamed_ones(
    client, offline, tokenizer
):
    kwargs = dict(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_completion_tokens=300,
    )
    reply = client.chat.completions.create(**kwargs)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    for _, arguments in calls:
        jsonschema.validate(json.loads(arguments), WEATHER)
    with client.chat.completions.stream(**kwargs) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == calls
    tag = structural_tag([("get_weather", WEATHER)], parallel=True)
    want = offline_reply(
        offline, tokenizer, ASK, TOOLS, max_tokens=300, structured_output={"structural_tag": tag}
    )
    assert "\n".join(call_text(n, a) for n, a in calls) == want.text


def test_chat_logprobs_are_the_offline_engines(client, offline, tokenizer):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        temperature=0,
        max_completion_tokens=6,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    out = offline_reply(offline, tokenizer, ASK, max_tokens=6, logprobs=3, ignore_eos=True)
    same_logprobs(reply.choices[0].logprobs.content, out, tokenizer)


def test_n_two_choices_with_a_seed_are_reproducible(client, offline, tokenizer):
    request = dict(model=MODEL, messages=ASK, n=2, seed=11, temperature=1.0)
    extra = {"ignore_eos": True, "return_token_ids": True}
    first = client.chat.completions.create(**request, max_completion_tokens=5, extra_body=extra)
    again = client.chat.completions.create(**request, max_completion_tokens=5, extra_body=extra)
    expected = offline.generate(
        [ChatRenderer(tokenizer).render(ASK)],
        SamplingParams(n=2, seed=11, temperature=1.0, max_tokens=5, ignore_eos=True),
    )
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.token_ids for c in first.choices] == [o.token_ids for o in expected]
    assert [c.token_ids for c in again.choices] == [c.token_ids for c in first.choices]
    assert expected[0].token_ids != expected[1].token_ids  # two draws, not one twice
    assert first.usage.completion_tokens == 10


def _weather_tool(calls: list):
    @agents.function_tool
    def get_weather(
        city: Literal["Paris", "Oslo", "Lima"], days: Annotated[int, Field(ge=1, le=7)]
    ) -> str:
        """The weather forecast of a city.

        Args:
            city: the city
            days: how many days ahead
        """
        calls.append({"city": city, "days": days})
        return f"sunny in {city} for {days} days"

    return get_weather


@pytest.mark.parametrize(("api", "streamed"), [("chat", False), ("responses", True)])
def test_agents_sdk_runs_a_bounded_tool_loop_to_its_output_type(cluster, api, streamed):
    agents.set_tracing_disabled(True)
    calls: list[dict] = []
    tool = _weather_tool(calls)

    async def run():
        http = openai.AsyncOpenAI(
            base_url=f"{cluster.http_address}/v1", api_key="unused", max_retries=0, timeout=120
        )
        kind = OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel
        agent = Agent(
            name="forecaster",
            instructions="Answer with the forecast.",
            tools=[tool],
            model=AnswerAfterTool(kind(MODEL, http)),
            output_type=Forecast,
            model_settings=ModelSettings(
                tool_choice="get_weather", temperature=0, max_tokens=300, parallel_tool_calls=False
            ),
        )
        question = "Weather in Paris for 2 days?"
        if not streamed:
            return await Runner.run(agent, question, max_turns=3)
        result = Runner.run_streamed(agent, question, max_turns=3)
        async for _ in result.stream_events():
            pass
        return result

    result = asyncio.run(run())
    assert len(calls) == 1
    jsonschema.validate(calls[0], tool.params_json_schema)
    assert isinstance(result.final_output, Forecast)
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"]
    assert result.new_items[1].output == f"sunny in {calls[0]['city']} for {calls[0]['days']} days"


def test_langchain_bind_tools_loop_calls_the_tool_then_answers(cluster):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    calls: list[dict] = []

    @tool
    def get_weather(
        city: Literal["Paris", "Oslo", "Lima"], days: Annotated[int, Field(ge=1, le=7)]
    ) -> str:
        """The weather forecast of a city."""
        calls.append({"city": city, "days": days})
        return f"sunny in {city} for {days} days"

    llm = ChatOpenAI(
        model=MODEL,
        base_url=f"{cluster.http_address}/v1",
        api_key="unused",
        temperature=0,
        max_tokens=300,
        max_retries=0,
        timeout=120,
    )
    messages = [HumanMessage("Weather in Paris for 2 days?")]
    for turn in range(3):
        choice = "get_weather" if turn == 0 else "none"
        bound = llm.bind_tools([get_weather], tool_choice=choice, parallel_tool_calls=False)
        reply = bound.invoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            messages.append(ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"]))
    assert turn == 1 and len(calls) == 1
    jsonschema.validate(calls[0], get_weather.tool_call_schema.model_json_schema())
    assert isinstance(messages[-1].content, str) and not messages[-1].tool_calls


def test_grpc_structured_output_logprobs_and_n_equal_the_offline_engines(
    cluster, offline, tokenizer
):
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(cluster.address))
    sampling = dict(max_tokens=300, temperature=1.0, seed=7, n=2, logprobs=2)
    request = pb.GenerateRequest(
        messages=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in ASK]),
        sampling=pb.SamplingParams(
            **sampling, structured_output=pb.StructuredOutput(json=json.dumps(PICK))
        ),
    )
    replies = list(stub.Generate(request, timeout=120))
    expected = offline.generate(
        [ChatRenderer(tokenizer).render(ASK)],
        SamplingParams(**sampling, structured_output={"json": PICK}),
    )
    for index, want in enumerate(expected):
        mine = [r for r in replies if r.index == index]
        assert [t for r in mine for t in r.token_ids] == want.token_ids
        assert "".join(r.text for r in mine) == want.text
        jsonschema.validate(json.loads(want.text), PICK)
        got = [
            (lp.token_id, lp.logprob, [t.token_id for t in lp.top])
            for r in mine
            for lp in r.logprobs
        ]
        wire = [lp.to_wire() for lp in want.logprobs]
        assert [(t, [i for i, _ in top]) for t, _, top in wire] == [(t, top) for t, _, top in got]
        assert [lp for _, lp, _ in got] == pytest.approx([lp for _, lp, _ in wire], abs=1e-4)
        assert [r.finish_reason for r in mine if r.finish_reason] == ["stop"]
    assert replies[-1].usage.completion_tokens == sum(len(o.token_ids) for o in expected)


@pytest.fixture(scope="module")
def lm_eval_task(tmp_path_factory):
    return write_task(tmp_path_factory.mktemp("lm_eval"))


@pytest.fixture(scope="module")
def hf_loglikelihoods(lm_eval_task, tiny_llama_tok):
    with pytest.MonkeyPatch.context() as mp:
        for name, value in offline_env(True).items():
            mp.setenv(name, value)
        args = {"pretrained": tiny_llama_tok, "dtype": "float32"}
        return loglikelihoods(lm_eval_task, "hf", args, batch_size=2)


@pytest.mark.parametrize("batch_size", [1, 2])
def test_lm_eval_local_completions_loglikelihoods_equal_its_hf_models(
    cluster, tiny_llama_tok, lm_eval_task, hf_loglikelihoods, monkeypatch, batch_size
):
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    args = {
        "model": MODEL,
        "base_url": f"{cluster.http_address}/v1/completions",
        "tokenizer": tiny_llama_tok,
        "tokenizer_backend": "huggingface",
        "tokenized_requests": True,
        "max_retries": 1,
    }
    served = loglikelihoods(lm_eval_task, "local-completions", args, batch_size)
    assert sorted(served) == sorted(hf_loglikelihoods) and len(served) == 11
    for key, (logprob, greedy) in hf_loglikelihoods.items():
        assert served[key][0] == pytest.approx(logprob, abs=1e-4), key
        assert served[key][1] == greedy, key


def test_guidellm_streamed_run_completes_without_errors(cluster, tiny_llama_tok, tmp_path):
    load = Load(requests=8, concurrency=2, prompt_tokens=32, output_tokens=16)
    out = tmp_path / "guidellm.json"
    command = guidellm_command(cluster.http_address, MODEL, tiny_llama_tok, out, load)
    run_client(command, offline_env(True))
    run = read_guidellm(out)
    assert (run.completed, run.errored, run.incomplete) == (8, 0, 0)
    assert run.output_tokens == (16,) * 8
    options = {json.dumps(b["stream_options"], sort_keys=True) for b in guidellm_bodies(out)}
    assert options == {'{"continuous_usage_stats": true, "include_usage": true}'}
