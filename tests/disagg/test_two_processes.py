"""Disaggregated serving across two real processes on CPU (gloo): outputs equal the colocated
engine's, delta transfers move only missing blocks, dead peers and aborts free every block."""

from __future__ import annotations

import threading
import time

import pytest

from engine import LLM, CapacityError, InvalidRequestError, SamplingParams
from kvtransfer.worker_api import PromptRequest
from router.handoff import generate_disaggregated
from tests.disagg.cluster import pair, paired_workers, run_concurrently, start_worker, tokens
from tests.helpers import random_prompts

TRANSFER = {"timeout_seconds": 5.0, "lease_seconds": 4.0}


def engine_options(model: str) -> dict:
    return dict(
        model=model,
        skip_tokenizer_init=True,
        block_size=4,
        num_kv_blocks=256,
        chunk_size=16,
        max_num_batched_tokens=64,
    )


@pytest.fixture(scope="module")
def workers(tiny_llama):
    with paired_workers(engine_options(tiny_llama), TRANSFER) as both:
        yield both


def check_clean(prefill, decode) -> None:
    prefill.client.check_integrity()
    decode.client.check_integrity()
    # The decode worker's acknowledgement reaches the prefill worker after the request's
    # last token: its held blocks are freed a moment later.
    deadline = time.monotonic() + 10
    while (
        any(w.client.stats().free_blocks != 256 for w in (prefill, decode))
        and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    for w in (prefill, decode):
        assert w.client.stats().free_blocks == 256


@pytest.mark.parametrize("sampled", [False, True])
def test_disaggregated_equals_colocated(workers, tiny_llama, sampled):
    prefill, decode = workers
    prompts = random_prompts([5, 23, 40, 9, 61], seed=61 + sampled)  # 40 and 61 > one chunk
    params = [
        dict(
            max_tokens=8,
            ignore_eos=True,
            temperature=0.9 if sampled else 0.0,
            top_p=0.9,
            seed=100 + i,
        )
        for i in range(len(prompts))
    ]
    colocated = LLM(tiny_llama, skip_tokenizer_init=True, block_size=4, chunk_size=16)
    expected = [
        o.token_ids for o in colocated.generate(prompts, [SamplingParams(**p) for p in params])
    ]
    got = run_concurrently(prefill, decode, prompts, params, prefix=f"s{sampled}-")
    for i in range(len(prompts)):
        outs = got[f"s{sampled}-{i}"]
        assert outs[-1]["finish_reason"] == "length", outs[-1]
        assert tokens(outs) == expected[i]
    check_clean(prefill, decode)


def test_delta_transfer_moves_only_missing_blocks(workers):
    prefill, decode = workers
    shared = random_prompts([64], seed=71)[0]  # 16 full blocks
    a, b = (shared + tail for tail in random_prompts([6, 9], seed=72))
    greedy = dict(max_tokens=2, temperature=0.0, ignore_eos=True)
    before = decode.client.stats()
    run_concurrently(prefill, decode, [a], [greedy], prefix="delta-a")
    mid = decode.client.stats()
    run_concurrently(prefill, decode, [b], [greedy], prefix="delta-b")
    after = decode.client.stats()
    block_bytes = 2 * 2 * 4 * 2 * 16 * 4  # layers x (k, v) x block x kv heads x dim x fp32
    assert mid.blocks_received - before.blocks_received == 18  # 70 tokens: all blocks
    assert after.blocks_received - mid.blocks_received == 3  # 73 tokens: 19 - 16 cached
    assert after.bytes_received - mid.bytes_received == 3 * block_bytes
    check_clean(prefill, decode)


def test_abort_on_either_side_frees_both(workers):
    prefill, decode = workers
    prompt = random_prompts([30], seed=81)[0]
    params = dict(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    # Abort on the decode side while decoding.
    stream = generate_disaggregated(
        prefill.client,
        decode.client,
        "ab-d",
        prompt,
        params,
        prefill_id="p0",
        decode_id="d0",
        timeout=60,
    )
    assert next(stream)["token_ids"]
    assert decode.client.abort("ab-d")
    rest = list(stream)
    assert rest[-1]["finish_reason"] == "abort"
    # Abort on the prefill side between reservation and prefill reaches the decode side.
    decode.client.reserve(PromptRequest("ab-p", tuple(prompt), {**params, "seed": 5}), "p0")
    assert decode.client.stats().free_blocks < 256
    prefill.client.abort("ab-p")  # unknown there, nothing to propagate: the router's job
    decode.client.abort("ab-p")
    time.sleep(0.2)
    check_clean(prefill, decode)


def test_killing_prefill_mid_transfer_frees_reserved_blocks(tiny_llama):
    # Long prompts in small steps: the kill lands while prompts are prefilling / moving.
    opts = dict(
        engine_options(tiny_llama), block_size=16, num_kv_blocks=1024, max_num_batched_tokens=32
    )
    prefill = start_worker("prefill", "p0", opts, TRANSFER)
    decode = start_worker("decode", "d0", opts, TRANSFER)
    try:
        pair(prefill, decode)
        prompts = random_prompts([2000] * 6, seed=91)
        params = [dict(max_tokens=4, temperature=0.0, ignore_eos=True)] * 6
        results: dict[str, list[dict]] = {}
        worker = threading.Thread(
            target=lambda: results.update(
                run_concurrently(prefill, decode, prompts, params, prefix="k", timeout=30)
            )
        )
        worker.start()
        time.sleep(0.3)  # requests are reserved and prefilling / transferring
        prefill.kill()
        worker.join(60)
        deadline = time.monotonic() + TRANSFER["lease_seconds"] + TRANSFER["timeout_seconds"]
        while decode.client.stats().free_blocks != 1024 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert decode.client.stats().free_blocks == 1024
        decode.client.check_integrity()
        failed = [o for outs in results.values() for o in outs if o["finish_reason"] == "error"]
        assert failed, results
        for out in failed:
            assert "prefill worker p0" in out["error"], out
        # The decode worker keeps serving with a new prefill worker.
        fresh = start_worker("prefill", "p1", opts, TRANSFER)
        try:
            address = fresh.client.connect_decode("d0", decode.address)
            decode.client.connect_prefill("p1", address, fresh.address)
            outs = list(
                generate_disaggregated(
                    fresh.client,
                    decode.client,
                    "after",
                    prompts[0],
                    params[0],
                    prefill_id="p1",
                    decode_id="d0",
                    timeout=60,
                )
            )
            assert outs[-1]["finish_reason"] == "length" and len(tokens(outs)) == 4
        finally:
            fresh.stop()
    finally:
        decode.stop()
        prefill.stop()


def test_engine_errors_cross_rpc_as_themselves(workers):
    _, decode = workers
    params = {"max_tokens": 1, "temperature": 0.0, "seed": 1}
    with pytest.raises(CapacityError) as err:  # 256 blocks of 4 tokens: 1,100 never fit
        decode.client.reserve(PromptRequest("too-big", (5,) * 1100, params), "p0")
    assert type(err.value) is CapacityError
    assert str(err.value) == "prompt needs 276 KV blocks; this engine has only 256"
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        decode.client.reserve(PromptRequest("empty", (), params), "p0")
    assert decode.client.stats().free_blocks == 256  # nothing was reserved
