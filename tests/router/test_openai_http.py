"""The OpenAI-compatible HTTP front door over a Router and real prefill/decode workers on the
tiny checkpoint: the real `openai` client (streamed and not) gets the offline engine's greedy
tokens, usage with cached tokens and the serving workers; raw HTTP gets every error status;
a client that goes away frees its blocks."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from decode_worker.worker import DecodeWorker
from engine import LLM, SamplingParams
from engine.errors import CapacityError, NoFreeBlocksError
from prefill_worker.worker import PrefillWorker
from router.admission import Admission
from router.http_server import start_http_server
from router.metrics import RouterMetrics
from router.openai_http import create_app
from router.router import Router
from router.security import ApiKeys
from tests.helpers import random_prompts
from tests.router.serving import BackgroundLoop, http_serving

KEY = "sk-test-http"
AUTH = {"Authorization": f"Bearer {KEY}"}
BLOCKS = 512
MAX_LEN = 1024


class WordTokenizer:
    """Stands in for a Hugging Face tokenizer: one id per character, a plain chat template."""

    chat_template = "{{ messages }}"  # read only for whether it uses `tools`

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [3 + ord(c) % 500 for c in text]

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, **_):
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"


@pytest.fixture(scope="module")
def options(tiny_llama) -> dict:
    return dict(
        model=tiny_llama,
        skip_tokenizer_init=True,
        block_size=4,
        num_kv_blocks=BLOCKS,
        chunk_size=16,
        max_model_len=MAX_LEN,
    )


@pytest.fixture(scope="module")
def offline(options):
    llm = LLM(**options)

    def greedy(prompts: list[list[int]], n: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        return [o.token_ids for o in llm.generate(prompts, params)]

    return greedy


@pytest.fixture(scope="module")
def served(options):
    """(base url, (prefill, decode), aborted request ids) of the app over an in-process
    worker pair."""
    p, d = PrefillWorker("p0", options), DecodeWorker("d0", options)
    d.connect_prefill("p0", p.connect_decode("d0", d), p)
    router = Router({"p0": p}, {"d0": d}, block_size=4, hash_seed="baton", max_model_len=MAX_LEN)
    aborted: list[str] = []
    abort = router.abort
    router.abort = lambda request_id: aborted.append(request_id) or abort(request_id)
    app = create_app(
        router,
        ["tiny", "tiny-alias"],
        tokenizer=WordTokenizer(),
        api_keys=ApiKeys([KEY]),
        metrics_text=lambda: "baton:up 1\n",
    )
    try:
        with http_serving(app) as (url, _):
            yield url, (p, d), aborted
    finally:
        p.shutdown()
        d.shutdown()


@pytest.fixture
def client(served):
    url, _, _ = served
    with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


def free_blocks(worker) -> int:
    stats = worker.stats()  # a WorkerStats (or, before that refactor, a dict)
    return stats["free_blocks"] if isinstance(stats, dict) else stats.free_blocks


def wait_all_free(workers) -> None:
    for _ in range(200):
        if all(free_blocks(w) == BLOCKS for w in workers):
            break
        time.sleep(0.05)
    assert [free_blocks(w) for w in workers] == [BLOCKS] * len(workers)
    for w in workers:
        w.check_integrity()


EXTRA = {"ignore_eos": True, "return_token_ids": True}


def test_completion_equals_offline_engine_with_usage_workers_and_cached_tokens(client, offline):
    prompt = random_prompts([30], seed=401)[0]
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt=prompt, max_tokens=7, temperature=0.0, extra_body=EXTRA
    )
    reply = raw.parse()
    assert reply.choices[0].token_ids == offline([prompt], 7)[0]
    assert reply.choices[0].finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (30, 7)
    assert reply.baton == {"prefill_worker": "p0", "decode_worker": "d0"}
    assert (raw.headers["x-baton-prefill-worker"], raw.headers["x-baton-decode-worker"]) == (
        "p0",
        "d0",
    )
    again = client.completions.create(
        model="tiny-alias", prompt=prompt, max_tokens=2, extra_body=EXTRA
    )
    assert again.usage.prompt_tokens_details.cached_tokens == 28  # 7 full blocks
    salted = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=2, extra_body={**EXTRA, "cache_salt": "b"}
    )
    assert salted.usage.prompt_tokens_details.cached_tokens == 0  # another tenant's cache


def test_streamed_completion_equals_offline_engine_and_ends_with_usage(client, offline):
    prompt = random_prompts([13], seed=402)[0]
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=6,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=EXTRA,
        )
    )
    assert [t for c in chunks[:-1] for t in c.choices[0].token_ids] == offline([prompt], 6)[0]
    assert len(chunks) >= 3  # streamed, not one final message
    assert chunks[-2].choices[0].finish_reason == "length"
    last = chunks[-1]
    assert last.choices == [] and (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        13,
        6,
    )
    assert last.usage.prompt_tokens_details.cached_tokens == 0
    assert last.baton == {"prefill_worker": "p0", "decode_worker": "d0"}


def test_chat_applies_the_template_streamed_and_not(client, offline):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = WordTokenizer().encode(WordTokenizer().apply_chat_template(messages))
    expected = offline([ids], 5)[0]
    reply = client.chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=5, temperature=0, extra_body=EXTRA
    )
    assert reply.choices[0].token_ids == expected
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage.prompt_tokens == len(ids)
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=5, temperature=0, stream=True,
            extra_body=EXTRA,
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [t for c in chunks for t in c.choices[0].token_ids] == expected
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].baton == {"prefill_worker": "p0", "decode_worker": "d0"}
    text = client.completions.create(model="tiny", prompt="hello", max_tokens=2, extra_body=EXTRA)
    assert text.usage.prompt_tokens == len("hello")


def test_24_concurrent_streams_all_finish(served, offline):
    url, workers, _ = served
    prompts = random_prompts([5 + i for i in range(24)], seed=403)
    expected = offline(prompts, 4)
    got: dict[int, list[int]] = {}

    def one(i: int) -> None:
        with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120) as c:
            chunks = c.completions.create(
                model="tiny", prompt=prompts[i], max_tokens=4, temperature=0, stream=True,
                extra_body=EXTRA,
            )  # fmt: skip
            got[i] = [t for chunk in chunks for t in chunk.choices[0].token_ids]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert [got.get(i) for i in range(24)] == expected
    wait_all_free(workers)


GOOD = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "param_or_code"),
    [
        ("/v1/completions", GOOD, {"Authorization": "Bearer wrong"}, 401, "invalid_api_key"),
        ("/v1/completions", GOOD, {}, 401, "invalid_api_key"),
        ("/v1/completions", {**GOOD, "model": "gpt-4"}, AUTH, 404, "model_not_found"),
        ("/v1/completions", {**GOOD, "n": 0}, AUTH, 400, "n"),
        ("/v1/completions", {**GOOD, "tools": []}, AUTH, 400, "tools"),
        ("/v1/completions", {**GOOD, "best_of": 2}, AUTH, 400, "best_of"),
        ("/v1/completions", {**GOOD, "temperature": -1}, AUTH, 400, "temperature"),
        ("/v1/completions", {**GOOD, "max_tokens": "many"}, AUTH, 400, "max_tokens"),
        ("/v1/completions", {**GOOD, "logprobs": 6}, AUTH, 400, "logprobs"),
        ("/v1/completions", {**GOOD, "presence_penalty": 3}, AUTH, 400, "presence_penalty"),
        ("/v1/completions", {**GOOD, "suffix": "x"}, AUTH, 400, "suffix"),
        ("/v1/completions", {**GOOD, "store": True}, AUTH, 400, "store"),
        ("/v1/completions", {**GOOD, "prompt": []}, AUTH, 400, None),
        (
            "/v1/completions",
            {**GOOD, "prompt": [5] * MAX_LEN},
            AUTH,
            400,
            "context_length_exceeded",
        ),
        ("/v1/completions", {"model": "tiny"}, AUTH, 400, "prompt"),
        ("/v1/completions", "not json", AUTH, 400, None),
        ("/v1/chat/completions", {"model": "tiny", "messages": []}, AUTH, 400, "messages"),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            AUTH,
            400,
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "audio": {}},
            AUTH,
            400,
            "audio",
        ),
    ],
)
def test_errors_have_openai_shape_and_status_and_server_keeps_serving(
    served, path, body, headers, status, param_or_code
):
    url, workers, _ = served
    content = body if isinstance(body, str) else json.dumps(body)
    reply = httpx.post(url + path, content=content, headers=headers, timeout=30)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "Traceback" not in error["message"]
    if param_or_code is not None:
        assert param_or_code in (error["param"], error["code"])
    if param_or_code and status == 400 and param_or_code == error["param"]:
        assert param_or_code in error["message"]  # the sentence names the field
    ok = httpx.post(
        url + "/v1/completions", json={**GOOD, "ignore_eos": True}, headers=AUTH, timeout=60
    )
    assert ok.json()["choices"][0]["finish_reason"] == "length"
    for w in workers:
        w.check_integrity()


def test_models_health_and_metrics(served):
    url, _, _ = served
    assert httpx.get(url + "/health").status_code == 200  # open, no key
    models = httpx.get(url + "/v1/models", headers=AUTH).json()
    assert [m["id"] for m in models["data"]] == ["tiny", "tiny-alias"]
    metrics = httpx.get(url + "/metrics", headers=AUTH)
    assert metrics.text == "baton:up 1\n"
    assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert httpx.get(url + "/nope").json()["error"]["type"] == "not_found_error"


def test_client_gone_mid_stream_or_before_the_reply_aborts_and_frees_blocks(served):
    url, workers, aborted = served
    body = {"model": "tiny", "prompt": [9] * 20, "max_tokens": MAX_LEN - 21, "ignore_eos": True}
    before = len(aborted)
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as reply:
            assert reply.status_code == 200
            lines = reply.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
        # the connection is closed here, about 1000 tokens before the end
    wait_all_free(workers)
    # one request aborted: once, or twice when a poll was in flight (router/stream.py aborts
    # again after it, in case the request registered meanwhile)
    assert 1 <= len(aborted) - before <= 2 and set(aborted[before:]) == {aborted[-1]}
    assert aborted[-1].startswith("cmpl-")
    with pytest.raises(httpx.ReadTimeout):  # 1000 decode steps take well over 0.3 s
        httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=0.3)
    wait_all_free(workers)
    assert len(aborted) >= before + 2 and aborted[-1] != aborted[before]


def test_no_worker_is_503_and_admission_refuses_past_max_pending():
    # No workers: a request waits wait_for_workers_s for one, pending at the router.
    router = Router({}, {}, block_size=4, hash_seed="baton", wait_for_workers_s=1.5)
    app = create_app(router, ["tiny"], admission=Admission(max_pending=1))
    with http_serving(app) as (url, _):
        first: dict = {}
        waiting = threading.Thread(
            target=lambda: first.update(r=httpx.post(url + "/v1/completions", json=GOOD))
        )
        waiting.start()
        time.sleep(0.5)
        refused = httpx.post(url + "/v1/completions", json=GOOD)
        assert refused.status_code == 429
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert "max_pending_requests=1" in refused.json()["error"]["message"]
        waiting.join(10)
        assert first["r"].status_code == 503
        assert "prefill" in first["r"].json()["error"]["message"]
        streamed = httpx.post(url + "/v1/completions", json={**GOOD, "stream": True})
        assert streamed.status_code == 503  # refused before any byte of the stream
        text = httpx.post(url + "/v1/completions", json={**GOOD, "prompt": "hi"})
        assert text.status_code == 400 and "tokenizer" in text.json()["error"]["message"]
        assert httpx.get(url + "/metrics").status_code == 404
        assert httpx.get(url + "/health").status_code == 503


class ScriptedRouter:
    """Stands in for Router where a worker's failure is needed: generate() raises `exc` or
    yields one failed output."""

    prefill = decode = {}
    max_model_len = 100

    def __init__(self, exc: Exception | None) -> None:
        self.exc = exc
        self.metrics = RouterMetrics()  # the door counts its error answers there

    def generate(self, request_id, prompt_token_ids, params, cache_salt=None, session=None):
        if self.exc is not None:
            raise self.exc
        yield {
            "token_ids": [],
            "text": "",
            "finished": True,
            "finish_reason": "error",
            "num_cached_tokens": 0,
            "error": "decode worker d0 died",
        }

    def abort(self, request_id: str) -> bool:
        return False


@pytest.mark.parametrize(
    ("exc", "status", "code"),
    [
        (None, 500, None),
        (NoFreeBlocksError("no free KV blocks for 30 tokens"), 429, "server_busy"),
        (CapacityError("needs 300 KV blocks; d0 has 256"), 400, "kv_capacity_exceeded"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_worker_failures_before_the_first_token_are_statuses(exc, status, code, stream):
    app = create_app(ScriptedRouter(exc), ["tiny"])
    with http_serving(app) as (url, _):
        reply = httpx.post(url + "/v1/completions", json={**GOOD, "stream": stream})
    assert reply.status_code == status
    error = reply.json()["error"]
    assert error["code"] == code and error["message"]
    if exc is None:
        assert "d0 died" in error["message"] and error["type"] == "server_error"


class EndlessRouter(ScriptedRouter):
    """A request that streams a token every 20 ms until aborted."""

    def __init__(self) -> None:
        super().__init__(None)
        self.aborted: list[str] = []

    def generate(self, request_id, prompt_token_ids, params, cache_salt=None, session=None):
        while request_id not in self.aborted:
            time.sleep(0.02)
            yield {"token_ids": [5], "text": "", "finished": False, "num_cached_tokens": 0}

    def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return True


def test_stopping_the_server_aborts_open_streams():
    router = EndlessRouter()
    loop = BackgroundLoop()
    server, port = loop.run(start_http_server(create_app(router, ["tiny"]), "127.0.0.1", 0))
    body = {**GOOD, "stream": True}
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as reply:
        lines = reply.iter_lines()
        assert next(lines).startswith("data:")
        loop.run(server.stop(grace=0.2))
        with pytest.raises(httpx.RemoteProtocolError):  # closed mid-stream
            list(lines)
    loop.close()
    assert len(router.aborted) >= 1 and router.aborted[0].startswith("cmpl-")
