"""A prefill worker asked to send KV to a decode worker it has no pair group with (one of them
was restarted and the controller has not paired them again yet) fails fast with UnknownPeer
before any prefill work, and the Router neither fails the request (it used to be INTERNAL) nor
counts a migration: it marks both workers unhealthy and waits for the controller's next health
report, then serves the request with the colocated engine's tokens. Without a report within
wait_for_workers_s the client gets UNAVAILABLE, as it does through the gRPC door when the
migration limit is passed."""

from __future__ import annotations

import grpc
import pytest

from decode_worker.worker import DecodeWorker
from engine import LLM, SamplingParams
from kvtransfer import UnknownPeer
from kvtransfer.worker_api import PromptRequest
from prefill_worker.worker import PrefillWorker
from router.errors import UNAVAILABLE, classify
from router.proto import inference_pb2 as pb
from router.proto import inference_pb2_grpc as pb_grpc
from router.router import Router
from router.server import start_server
from tests.helpers import generate_in_thread, random_prompts, wait_until
from tests.router.serving import BackgroundLoop

PARAMS = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
NUM_BLOCKS = 128


@pytest.fixture
def workers(tiny_llama):
    options = dict(
        model=tiny_llama,
        skip_tokenizer_init=True,
        block_size=4,
        num_kv_blocks=NUM_BLOCKS,
        chunk_size=16,
        hash_seed="t",
    )
    prefill, decode = PrefillWorker("p0", options), DecodeWorker("d0", options)
    yield options, prefill, decode
    prefill.shutdown()
    decode.shutdown()


def test_prefill_to_an_unpaired_decode_worker_fails_before_prefilling(workers):
    _, prefill, _ = workers
    request = PromptRequest("r", tuple(random_prompts([9], seed=3)[0]), {**PARAMS, "seed": 1})
    with pytest.raises(UnknownPeer, match="'p0' is not paired with decode worker 'd0'"):
        prefill.prefill(request, "d0", None)
    stats = prefill.stats()
    assert (stats.num_requests, stats.num_held, stats.free_blocks) == (0, 0, NUM_BLOCKS)
    assert stats.cache_queries == 0  # nothing was prefilled


def test_router_waits_for_the_pair_then_serves(workers):
    options, prefill, decode = workers
    router = Router(
        {"p0": prefill}, {"d0": decode}, block_size=4, hash_seed="t", wait_for_workers_s=60
    )
    prompt = random_prompts([13], seed=4)[0]
    out: dict = {}
    thread = generate_in_thread(router, "r", prompt, PARAMS, out)
    wait_until(lambda: router.pools.health() == {"p0": False, "d0": False}, timeout=30)
    assert "r" not in out  # waiting, not failed

    # What the controller does before its next health report: pair them again.
    decode.connect_prefill("p0", prefill.connect_decode("d0", decode), prefill)
    router.update_membership({"healthy": {"p0": True, "d0": True}, "restarted": []})
    thread.join(60)
    expected = LLM(**options).generate([prompt], SamplingParams(**PARAMS))[0].token_ids
    assert [t for o in out["r"] for t in o["token_ids"]] == expected
    assert out["r"][-1]["num_migrations"] == 0 and router.num_migrations == 0
    for w in (prefill, decode):
        wait_until(lambda w=w: w.stats().num_in_flight == 0, timeout=10)
        w.check_integrity()
        assert w.stats().free_blocks == NUM_BLOCKS


def test_no_pair_within_the_wait_is_unavailable(workers):
    _, prefill, decode = workers
    router = Router(
        {"p0": prefill}, {"d0": decode}, block_size=4, hash_seed="t", wait_for_workers_s=1.0
    )
    with pytest.raises(Exception) as err:
        list(router.generate("r", random_prompts([6], seed=5)[0], PARAMS))
    assert classify(err.value) is UNAVAILABLE, err.value
    assert decode.stats().free_blocks == NUM_BLOCKS  # its reservation was aborted


class DroppingDecodeWorker(DecodeWorker):
    """A real decode worker whose connection drops once its first tokens went out (what a
    killed worker looks like to the router)."""

    def poll(self, request_id: str, timeout: float = 1.0):
        outs = super().poll(request_id, timeout)
        if outs:
            self.abort(request_id, propagate=True)
            raise ConnectionResetError(f"{self.worker_id}: connection reset")
        return outs


def test_migration_limit_passed_is_unavailable_on_grpc(tiny_llama):
    """MigrationLimitExceeded reaches a gRPC client as UNAVAILABLE with the router's message
    (it was UNKNOWN: 'Unexpected <class MigrationLimitExceeded>')."""
    options = dict(
        model=tiny_llama, skip_tokenizer_init=True, block_size=4, num_kv_blocks=NUM_BLOCKS
    )
    prefill, decode = PrefillWorker("p0", options), DroppingDecodeWorker("d0", options)
    decode.connect_prefill("p0", prefill.connect_decode("d0", decode), prefill)
    router = Router(
        {"p0": prefill}, {"d0": decode}, block_size=4, hash_seed="baton", migration_limit=0
    )
    loop = BackgroundLoop()
    server, port = loop.run(start_server(router, port=0))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            request = pb.GenerateRequest(
                prompt_token_ids=pb.TokenIds(ids=random_prompts([9], seed=6)[0]),
                sampling=pb.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
            )
            with pytest.raises(grpc.RpcError) as err:
                list(pb_grpc.InferenceStub(channel).Generate(request, timeout=60))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        assert "failed on workers d0 (migration_limit=0)" in err.value.details()
    finally:
        loop.run(server.stop(1))
        loop.close()
        prefill.shutdown()
        decode.shutdown()
