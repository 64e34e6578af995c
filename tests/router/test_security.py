"""API keys, TLS (a throwaway CA), admission and the shared error mapping, on both front
doors, without workers: a Router with empty pools answers what needs no model."""

from __future__ import annotations

import ssl
import threading
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from engine.errors import CapacityError, InvalidRequestError, NoFreeBlocksError, PromptTooLongError
from kvtransfer.control import RemoteError
from router import errors
from router.admission import Admission, GrpcAdmissionInterceptor
from router.errors import AdmissionRefused, classify
from router.openai_http import create_app
from router.policy import NoWorkerAvailable
from router.proto import inference_pb2 as pb
from router.proto import inference_pb2_grpc as pb_grpc
from router.router import Router
from router.security import (
    ApiKeys,
    GrpcKeyInterceptor,
    TLSFiles,
    add_port,
    load_api_keys,
    warn_if_exposed,
)
from router.server import SERVICE, InferenceServicer
from tests.router.serving import BackgroundLoop, http_serving
from tests.tls import make_pki

KEY = "sk-test-0123456789"


def empty_router(**kwargs) -> Router:
    return Router({}, {}, block_size=4, hash_seed="baton", **kwargs)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_keys_load_from_env_and_file_never_inline_sources(tmp_path, monkeypatch):
    monkeypatch.setenv("BATON_TEST_KEYS", "k1, k2")
    path = tmp_path / "keys"
    path.write_text("# one per line\nk3\n\n")
    assert load_api_keys(["k0"], env_var="BATON_TEST_KEYS", file=path) == ["k0", "k1", "k2", "k3"]
    monkeypatch.delenv("BATON_TEST_KEYS")
    with pytest.raises(ValueError, match="BATON_TEST_KEYS"):
        load_api_keys(env_var="BATON_TEST_KEYS")
    with pytest.raises(ValueError, match="does not exist"):
        load_api_keys(file=tmp_path / "missing")
    path.write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no key"):
        load_api_keys(file=path)


def test_key_check_counts_refusals():
    keys = ApiKeys([KEY, "other"])
    assert keys.check(f"Bearer {KEY}") and keys.check("bearer other") and keys.check(KEY)
    assert keys.num_refused == 0
    assert not keys.check(None) and not keys.check("Bearer wrong") and not keys.check("")
    assert keys.num_refused == 3
    assert ApiKeys().check(None) and not ApiKeys().enabled


def test_exposed_without_key_warns_naming_the_risk():
    assert "without an API key" in warn_if_exposed("HTTP", "0.0.0.0", ApiKeys())
    assert "anyone who can reach" in warn_if_exposed("gRPC", "10.1.2.3", ApiKeys())
    assert warn_if_exposed("HTTP", "127.0.0.1", ApiKeys()) is None
    assert warn_if_exposed("HTTP", "localhost", ApiKeys()) is None
    assert warn_if_exposed("HTTP", "0.0.0.0", ApiKeys([KEY])) is None


def test_admission_bounds_pending_requests():
    admission = Admission(max_pending=2)
    a, b = admission.admit(), admission.admit()
    with pytest.raises(AdmissionRefused, match="max_pending_requests=2"):
        admission.admit()
    assert (admission.pending, admission.num_refused) == (2, 1)
    a.release()
    a.release()  # idempotent
    assert admission.pending == 1
    admission.admit()
    b.release()
    assert admission.pending == 1
    with pytest.raises(ValueError):
        Admission(max_pending=0)


@pytest.mark.parametrize(
    ("exc", "grpc_code", "http", "code"),
    [
        (InvalidRequestError("x"), grpc.StatusCode.INVALID_ARGUMENT, 400, None),
        (PromptTooLongError("x"), grpc.StatusCode.OUT_OF_RANGE, 400, "context_length_exceeded"),
        (CapacityError("x"), grpc.StatusCode.RESOURCE_EXHAUSTED, 400, "kv_capacity_exceeded"),
        (NoFreeBlocksError("x"), grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "server_busy"),
        (AdmissionRefused("x"), grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "server_busy"),
        (errors.Unauthenticated("x"), grpc.StatusCode.UNAUTHENTICATED, 401, "invalid_api_key"),
        (errors.UnknownModel("x"), grpc.StatusCode.NOT_FOUND, 404, "model_not_found"),
        (NoWorkerAvailable("x"), grpc.StatusCode.UNAVAILABLE, 503, None),
        (RemoteError("NoFreeBlocksError", "x"), grpc.StatusCode.RESOURCE_EXHAUSTED, 429, None),
        (RuntimeError("x"), grpc.StatusCode.INTERNAL, 500, None),
    ],
)
def test_one_error_mapping_for_both_doors(exc, grpc_code, http, code):
    kind = classify(exc)
    assert (kind.grpc_code, kind.http_status) == (grpc_code, http)
    if code is not None:
        assert kind.openai_code == code


@pytest.fixture(scope="module")
def grpc_tls_server(pki):
    """The real servicer behind the key and admission interceptors, over mutual TLS; with
    no worker, a request waits 1.5 s at the router (pending), then fails UNAVAILABLE."""
    loop = BackgroundLoop()
    keys = ApiKeys([KEY])
    admission = GrpcAdmissionInterceptor(Admission(max_pending=1), (f"/{SERVICE}/Generate",))

    async def start():
        server = grpc.aio.server(interceptors=[GrpcKeyInterceptor(keys), admission])
        router = empty_router(wait_for_workers_s=1.5)
        pb_grpc.add_InferenceServicer_to_server(InferenceServicer(router), server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        tls = TLSFiles(pki.server_cert, pki.server_key, client_ca_file=pki.ca)
        port = add_port(server, "127.0.0.1:0", tls)
        await server.start()
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        return server, port

    server, port = loop.run(start())
    yield port, keys
    loop.run(server.stop(1))
    loop.close()


def grpc_channel(pki, port: int, client_cert: bool = True) -> grpc.Channel:
    ca = open(pki.ca, "rb").read()
    if client_cert:
        creds = grpc.ssl_channel_credentials(
            ca, open(pki.client_key, "rb").read(), open(pki.client_cert, "rb").read()
        )
    else:
        creds = grpc.ssl_channel_credentials(ca)
    return grpc.secure_channel(f"localhost:{port}", creds)


def test_grpc_over_mutual_tls_needs_key_but_health_is_open(grpc_tls_server, pki):
    port, keys = grpc_tls_server
    with grpc_channel(pki, port) as channel:
        stub = pb_grpc.InferenceStub(channel)
        request = pb.AbortRequest(request_id="nope")
        before = keys.num_refused
        for metadata in [(), (("authorization", "Bearer wrong"),)]:
            with pytest.raises(grpc.RpcError) as err:
                stub.Abort(request, metadata=metadata, timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:  # a streaming method is refused the same way
            list(stub.Generate(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5]))))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert keys.num_refused == before + 3
        ok = stub.Abort(request, metadata=(("authorization", f"Bearer {KEY}"),), timeout=10)
        assert ok.found is False
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_grpc_admission_refuses_past_max_pending(grpc_tls_server, pki):
    port, _ = grpc_tls_server
    auth = (("authorization", f"Bearer {KEY}"),)
    request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5, 6]))
    with grpc_channel(pki, port) as channel:
        stub = pb_grpc.InferenceStub(channel)
        codes: list = []

        def waiting() -> None:
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(request, metadata=auth, timeout=10))
            codes.append(err.value.code())

        thread = threading.Thread(target=waiting)
        thread.start()
        time.sleep(0.5)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request, metadata=auth, timeout=10))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_pending_requests=1" in err.value.details()
        thread.join(10)
        assert codes == [grpc.StatusCode.UNAVAILABLE]  # the first waited for a worker


def test_grpc_mutual_tls_refuses_a_client_without_certificate(grpc_tls_server, pki):
    port, _ = grpc_tls_server
    with grpc_channel(pki, port, client_cert=False) as channel:
        with pytest.raises(grpc.RpcError) as err:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def client_context(pki, client_cert: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=pki.ca)
    if client_cert:
        context.load_cert_chain(pki.client_cert, pki.client_key)
    return context


def test_http_over_tls_with_key_and_open_health(pki):
    app = create_app(empty_router(), ["tiny"], api_keys=ApiKeys([KEY]))
    with http_serving(app, TLSFiles(pki.server_cert, pki.server_key)) as (url, _):
        with httpx.Client(base_url=url, verify=client_context(pki, False)) as http:
            health_reply = http.get("/health")  # open; no worker yet
            assert health_reply.status_code == 503
            assert health_reply.json() == {
                "status": "no healthy prefill or decode worker",
                "serving": False,
                "mode": "disaggregated",
                "pools": {
                    "prefill": {"healthy": 0, "workers": 0},
                    "decode": {"healthy": 0, "workers": 0},
                },
            }
            refused = http.get("/v1/models")
            assert refused.status_code == 401
            assert refused.json()["error"]["type"] == "authentication_error"
            models = http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
            assert [m["id"] for m in models.json()["data"]] == ["tiny"]
        with httpx.Client(base_url=url, verify=True) as http:  # the system CAs don't know it
            with pytest.raises(httpx.ConnectError):
                http.get("/health")


def test_http_mutual_tls_refuses_a_client_without_certificate(pki):
    app = create_app(empty_router(), ["tiny"])
    tls = TLSFiles(pki.server_cert, pki.server_key, client_ca_file=pki.ca)
    with http_serving(app, tls) as (url, _):
        with httpx.Client(base_url=url, verify=client_context(pki, True)) as http:
            assert http.get("/health").status_code == 503
        with httpx.Client(base_url=url, verify=client_context(pki, False)) as http:
            with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
                http.get("/health")


def test_http_listening_socket_is_tcp_so_connections_get_nodelay():
    """asyncio sets TCP_NODELAY on accepted connections only when the listening socket is
    IPPROTO_TCP; with protocol 0 a short SSE response waited ~40 ms on Nagle + delayed ACK
    (benchmarks/front_doors.py)."""
    import asyncio
    import socket

    from fastapi import FastAPI

    from router.http_server import start_http_server

    async def listening_protocols() -> list[int]:
        server, _ = await start_http_server(FastAPI(), "127.0.0.1", 0)
        try:
            return [sock.proto for sock in server._server.servers[0].sockets]
        finally:
            await server.stop(grace=0.5)

    assert asyncio.run(listening_protocols()) == [socket.IPPROTO_TCP]
