"""Every request a front door answers with an error is counted once, by door, code and reason
(baton:request_errors_total), as a real scrape of /metrics shows it: both doors over one
Router whose decode worker is real (the tiny checkpoint, aggregated), with the same API keys
and admission bound as the router actor gives them. A worker that dies, and one that reports
a failed request, stand in for what the pool then holds. The Grafana panel plots the series."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from decode_worker.worker import DecodeWorker
from kvtransfer.worker_api import Role, TokenOutput, WorkerStats
from router.admission import Admission, GrpcAdmissionInterceptor
from router.http_server import start_http_server
from router.metrics_exposition import router_scrape
from router.openai_http import create_app
from router.proto import inference_pb2 as pb
from router.proto import inference_pb2_grpc as pb_grpc
from router.router import Router
from router.security import ApiKeys, GrpcKeyInterceptor
from router.server import SERVICE, start_server
from tests.helpers import random_prompts, wait_until
from tests.router.serving import BackgroundLoop

KEY = "sk-test-errors"
AUTH = {"Authorization": f"Bearer {KEY}"}
GRPC_AUTH = (("authorization", f"Bearer {KEY}"),)
MAX_LEN = 128  # the door refuses longer prompts
BLOCKS = 16  # 64 tokens of KV: a 100-token prompt can never fit
DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "baton-dashboard.json"
PROMPT = random_prompts([6], seed=41)[0]
NEVER_FITS = random_prompts([100], seed=42)[0]
TOO_LONG = random_prompts([MAX_LEN], seed=43)[0]


class DiedAfterStats:
    """A decode worker whose process died after it answered its stats."""

    def stats(self) -> WorkerStats:
        return WorkerStats("d9", Role.DECODE, free_blocks=BLOCKS, num_blocks=BLOCKS)

    def kv_events(self) -> list:
        return []

    def local_generate(self, request) -> None:
        raise ConnectionError("connection reset by peer")

    def abort(self, request_id, propagate=True) -> None:
        raise ConnectionError("connection refused")


class ReportsFailure(DiedAfterStats):
    """A decode worker that reports the request as failed (finish_reason "error")."""

    def local_generate(self, request) -> None:
        pass

    def poll(self, request_id, wait) -> list[TokenOutput]:
        return [TokenOutput(request_id, (), "", True, "error", 0, error="out of memory")]

    def abort(self, request_id, propagate=True) -> None:
        pass


@dataclass
class Doors:
    url: str
    stub: pb_grpc.InferenceStub
    router: Router
    worker: DecodeWorker
    keys: ApiKeys
    admission: Admission


@pytest.fixture(scope="module")
def doors(tiny_llama):
    options = dict(model=tiny_llama, skip_tokenizer_init=True, block_size=4, num_kv_blocks=BLOCKS)
    worker = DecodeWorker("d0", options)
    router = Router(
        {},
        {"d0": worker},
        block_size=4,
        hash_seed="baton",
        aggregated=True,
        max_model_len=MAX_LEN,
        migration_limit=0,
    )
    keys, admission = ApiKeys([KEY]), Admission(max_pending=1)
    # as the router actor registers them (cluster/router_actor.py)
    router.metrics.read_counter("auth_failures", "Auth failures.", lambda: keys.num_refused)
    router.metrics.read_counter(
        "admission_refused", "Admission refusals.", lambda: admission.num_refused
    )
    app = create_app(
        router,
        ["tiny"],
        api_keys=keys,
        admission=admission,
        metrics_text=lambda: router_scrape(router),
    )
    interceptors = [
        GrpcKeyInterceptor(keys, router.metrics),
        GrpcAdmissionInterceptor(admission, (f"/{SERVICE}/Generate",), router.metrics),
    ]
    loop = BackgroundLoop()
    http, http_port = loop.run(start_http_server(app, "127.0.0.1", 0))
    server, port = loop.run(start_server(router, "127.0.0.1", 0, interceptors=interceptors))
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Doors(
            f"http://127.0.0.1:{http_port}",
            pb_grpc.InferenceStub(channel),
            router,
            worker,
            keys,
            admission,
        )
    finally:
        channel.close()
        loop.run(server.stop(1))
        loop.run(http.stop(grace=1.0))
        loop.close()
        worker.shutdown()


def scrape(doors: Doors) -> tuple[dict[tuple[str, str, str], float], dict[str, float]]:
    """(request_errors_total by (door, code, reason), every sample by name) of /metrics."""
    reply = httpx.get(doors.url + "/metrics", headers=AUTH, timeout=30)
    assert reply.status_code == 200
    errors, samples = {}, {}
    for family in text_string_to_metric_families(reply.text):
        for s in family.samples:
            samples[s.name] = samples.get(s.name, 0.0) + s.value
            if s.name == "baton:request_errors_total":
                key = (s.labels["door"], s.labels["code"], s.labels["reason"])
                errors[key] = s.value
    return errors, samples


# ---- what each case sends --------------------------------------------------------------
def post(doors: Doors, status: int, headers=AUTH, path="/v1/completions", **body) -> None:
    request = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, **body}
    reply = httpx.post(doors.url + path, json=request, headers=headers, timeout=60)
    assert reply.status_code == status, reply.text


def call(doors: Doors, code: grpc.StatusCode | None, ids=PROMPT, auth=GRPC_AUTH, **sampling):
    request = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=ids),
        sampling=pb.SamplingParams(max_tokens=2, **sampling),
    )
    if code is None:
        assert list(doors.stub.Generate(request, metadata=auth, timeout=60))[-1].finish_reason
        return
    with pytest.raises(grpc.RpcError) as err:
        list(doors.stub.Generate(request, metadata=auth, timeout=60))
    assert err.value.code() == code, err.value.details()


def with_pool(decode: dict, send: Callable[[Doors], None]):
    """Run send() while the decode pool is `decode`; the real worker is back afterwards."""

    def run(doors: Doors) -> None:
        doors.router.set_workers({}, decode)
        try:
            send(doors)
        finally:
            doors.router.set_workers({}, {"d0": doors.worker})

    return run


def while_one_waits(hold: Callable[[Doors], None], send: Callable[[Doors], None]):
    """send() while another request waits for a worker (the only pending one admitted);
    the waiting one then fails for want of a worker."""

    def run(doors: Doors) -> None:
        router, failed = doors.router, []

        def holding() -> None:
            try:
                hold(doors)
            except AssertionError as exc:
                failed.append(exc)

        router.configure("cache_aware", 0, 3.0, aggregated=True)
        router.set_workers({}, {})
        holder = threading.Thread(target=holding)
        holder.start()
        try:
            wait_until(lambda: doors.admission.pending == 1)
            send(doors)
        finally:
            holder.join(30)
            router.configure("cache_aware", 0, 0.0, aggregated=True)
            router.set_workers({}, {"d0": doors.worker})
        assert not failed, failed

    return run


UNAVAILABLE, EXHAUSTED = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED
CASES = {
    # name: (what is sent, the exact rise of request_errors_total)
    "http ok": (lambda d: post(d, 200), {}),
    "http unauthenticated": (
        lambda d: post(d, 401, headers={}),
        {("http", "401", "unauthenticated"): 1},
    ),
    "http invalid field": (
        lambda d: post(d, 400, temperature=-1.0),
        {("http", "400", "invalid_request"): 1},
    ),
    "http unknown model": (
        lambda d: post(d, 404, model="other"),
        {("http", "404", "model_not_found"): 1},
    ),
    "http prompt too long": (
        lambda d: post(d, 400, prompt=TOO_LONG),
        {("http", "400", "prompt_too_long"): 1},
    ),
    "http never fits": (
        lambda d: post(d, 400, prompt=NEVER_FITS),
        {("http", "400", "kv_capacity_exceeded"): 1},
    ),
    "http unknown route": (
        lambda d: post(d, 404, path="/v1/nothing"),
        {("http", "404", "unknown_route"): 1},
    ),
    "http no worker": (
        with_pool({}, lambda d: post(d, 503)),
        {("http", "503", "no_worker"): 1},
    ),
    "http worker failed": (
        with_pool({"d9": DiedAfterStats()}, lambda d: post(d, 503)),
        {("http", "503", "worker_failed"): 1},
    ),
    "http request failed": (
        with_pool({"d8": ReportsFailure()}, lambda d: post(d, 500)),
        {("http", "500", "request_failed"): 1},
    ),
    "http overloaded": (
        while_one_waits(lambda d: call(d, UNAVAILABLE), lambda d: post(d, 429)),
        {("http", "429", "overloaded"): 1, ("grpc", "UNAVAILABLE", "no_worker"): 1},
    ),
    "grpc ok": (lambda d: call(d, None), {}),
    "grpc unauthenticated": (
        lambda d: call(d, grpc.StatusCode.UNAUTHENTICATED, auth=()),
        {("grpc", "UNAUTHENTICATED", "unauthenticated"): 1},
    ),
    "grpc invalid field": (
        lambda d: call(d, grpc.StatusCode.INVALID_ARGUMENT, temperature=-1.0),
        {("grpc", "INVALID_ARGUMENT", "invalid_request"): 1},
    ),
    "grpc prompt too long": (
        lambda d: call(d, grpc.StatusCode.OUT_OF_RANGE, ids=TOO_LONG),
        {("grpc", "OUT_OF_RANGE", "prompt_too_long"): 1},
    ),
    "grpc never fits": (
        lambda d: call(d, EXHAUSTED, ids=NEVER_FITS),
        {("grpc", "RESOURCE_EXHAUSTED", "kv_capacity_exceeded"): 1},
    ),
    "grpc no worker": (
        with_pool({}, lambda d: call(d, UNAVAILABLE)),
        {("grpc", "UNAVAILABLE", "no_worker"): 1},
    ),
    "grpc worker failed": (
        with_pool({"d9": DiedAfterStats()}, lambda d: call(d, UNAVAILABLE)),
        {("grpc", "UNAVAILABLE", "worker_failed"): 1},
    ),
    "grpc request failed": (
        with_pool({"d8": ReportsFailure()}, lambda d: call(d, grpc.StatusCode.INTERNAL)),
        {("grpc", "INTERNAL", "request_failed"): 1},
    ),
    "grpc overloaded": (
        while_one_waits(lambda d: post(d, 503), lambda d: call(d, EXHAUSTED)),
        {("grpc", "RESOURCE_EXHAUSTED", "overloaded"): 1, ("http", "503", "no_worker"): 1},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_error_answer_counts_exactly_its_labels(doors, case):
    send, rise = CASES[case]
    before, samples_before = scrape(doors)
    send(doors)
    after, samples_after = scrape(doors)
    changed = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k)}
    assert changed == rise
    # the counters kept before request_errors_total still count their refusals
    for name, reason in (("auth_failures", "unauthenticated"), ("admission_refused", "overloaded")):
        total = f"baton:{name}_total"
        counted = samples_after[total] - samples_before[total]
        assert counted == sum(n for (_, _, r), n in rise.items() if r == reason), name


def test_the_dashboard_plots_the_exported_errors_by_code_and_reason(doors):
    post(doors, 404, model="other")
    _, samples = scrape(doors)
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = [
        t["expr"] for p in panels for t in p.get("targets", []) if "request_errors" in t["expr"]
    ]
    assert len(exprs) == 1
    assert set(re.findall(r"baton:[a-z0-9_]+", exprs[0])) == {"baton:request_errors_total"}
    assert "baton:request_errors_total" in samples
    assert re.search(r"sum by \((?=[^)]*code)(?=[^)]*reason)[^)]*\) \(rate\(", exprs[0])
