"""Pulls decode -> prefill across two real processes (gloo): after turn 1 the prefill worker
obtains the blocks of its prompt and answer from the decode worker, and turn 2 (which starts
with them) computes only the rest, with the tokens and logprobs of one engine that ran both
turns; a decode worker that dies mid-pull leaves no block taken on the prefill worker."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from engine import InvalidRequestError, LLMEngine, SamplingParams
from kvtransfer.errors import TransferError, TransferTimeout
from kvtransfer.worker_api import PromptRequest, PullResult
from router.handoff import generate_disaggregated
from tests.disagg.cluster import pair, paired_workers, start_worker, tokens
from tests.disagg.test_two_processes import check_clean, engine_options
from tests.helpers import random_prompts, wait_until

TRANSFER = {"timeout_seconds": 3.0, "lease_seconds": 4.0}
BLOCK_BYTES = 2 * 2 * 4 * 2 * 16 * 4  # layers x (k, v) x block x kv heads x dim x fp32
PARAMS = dict(max_tokens=9, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def workers(tiny_llama):
    with paired_workers(engine_options(tiny_llama), TRANSFER) as both:
        yield both


def turn(prefill, decode, rid: str, prompt: list[int]) -> list[dict]:
    return list(
        generate_disaggregated(
            prefill.client,
            decode.client,
            rid,
            prompt,
            PARAMS,
            prefill_id=prefill.worker_id,
            decode_id=decode.worker_id,
            timeout=60,
        )
    )


def metric(families: list[dict], name: str) -> float:
    """The value of a family's one unlabelled sample."""
    for family in families:
        for sample, labels, value in family["samples"]:
            if sample == name and not labels:
                return value
    raise KeyError(name)


def colocated(model: str, prompts: list[list[int]]) -> list[tuple[list[int], list]]:
    """Tokens and wire logprobs of each prompt, run one after the other on one engine (the
    second hits the first one's blocks, prompt and answer, as the pulled prefill does)."""
    threads = torch.get_num_threads()
    engine = LLMEngine(**engine_options(model), num_threads=1)  # the workers' threads
    try:
        out = []
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, SamplingParams(**PARAMS))
            toks, lps = [], []
            while engine.has_unfinished():
                for o in engine.step().outputs.values():
                    toks += o.new_token_ids
                    lps += [lp.to_wire() for lp in o.logprobs or []]
            out.append((toks, lps))
        return out
    finally:
        torch.set_num_threads(threads)


def test_a_pulled_turn_serves_the_next_prompt(workers, tiny_llama):
    prefill, decode = workers
    a, u = random_prompts([22, 6], seed=111)
    first = turn(prefill, decode, "t1", a)
    run = a + tokens(first)  # 31 tokens: 7 full blocks; the decode side computed 30 of them
    p0, d0 = prefill.client.stats(), decode.client.stats()
    result = prefill.client.pull_blocks("d0", run)
    # The prefill worker held a's 5 full blocks; blocks 5 and 6 (a's tail and the answer)
    # existed only on the decode worker.
    assert result == PullResult(7, 5, 2, 2 * BLOCK_BYTES, result.seconds)
    assert result.num_cached == 7 and result.seconds > 0
    assert prefill.client.stats().blocks_pulled - p0.blocks_pulled == 2
    # the decode worker counts its answer once it has unpinned the blocks, just after sending
    wait_until(lambda: decode.client.stats().blocks_served - d0.blocks_served == 2)
    again = prefill.client.pull_blocks("d0", run)  # held now: nothing moves
    assert (again.num_present, again.num_pulled) == (7, 0)
    check_clean(prefill, decode)

    second = turn(prefill, decode, "t2", run + u)
    assert second[-1]["num_cached_tokens"] == 28  # 7 blocks from the prefill worker's cache
    (ref1, ref1_lp), (ref2, ref2_lp) = colocated(tiny_llama, [a, run + u])
    assert tokens(first) == ref1 and tokens(second) == ref2
    got_lp = [lp for o in second for lp in o["logprobs"] or []]
    assert got_lp == ref2_lp  # bit for bit: the first token's logits read the pulled KV

    p_metrics, d_metrics = prefill.client.metrics(), decode.client.metrics()
    assert metric(p_metrics, "baton:kv_pull_blocks_total") == 2
    assert metric(p_metrics, "baton:kv_pull_bytes_total") == 2 * BLOCK_BYTES
    assert metric(p_metrics, "baton:kv_pull_seconds_count") == 1  # the one pull that moved KV
    assert metric(d_metrics, "baton:kv_pull_served_blocks_total") == 2
    assert metric(d_metrics, "baton:kv_pull_served_bytes_total") == 2 * BLOCK_BYTES
    assert metric(d_metrics, "baton:kv_pull_served_seconds_count") == 1
    check_clean(prefill, decode)


def test_pulls_need_a_paired_decode_worker_and_valid_tokens(workers):
    prefill, _ = workers
    with pytest.raises(TransferError, match="not paired with decode worker 'd9'"):
        prefill.client.pull_blocks("d9", [1, 2, 3, 4])
    with pytest.raises(InvalidRequestError, match=r"token_ids out of range \[0, 512\)"):
        prefill.client.pull_blocks("d0", [1, 2, 3, 4000])
    assert prefill.client.pull_blocks("d0", [1, 2, 3]) == PullResult(0, 0, 0)  # no full block


def test_retention_fields_are_checked_by_the_workers(workers):
    prefill, decode = workers
    params = {"max_tokens": 1, "temperature": 0.0, "seed": 1}
    too_long = PromptRequest("r", (5,) * 9, params, None, "chat", 601.0)
    with pytest.raises(InvalidRequestError, match="at most max_retention_seconds=600"):
        decode.client.reserve(too_long, "p0")
    with pytest.raises(InvalidRequestError, match="at most max_retention_seconds=600"):
        prefill.client.prefill(too_long)
    no_session = PromptRequest("r", (5,) * 9, params, None, None, 60.0)
    with pytest.raises(InvalidRequestError, match="retention_seconds needs a session_id"):
        decode.client.local_generate(no_session)
    kept = PromptRequest("kept", (5,) * 9, params, None, "chat", 60.0)
    assert prefill.client.prefill(kept).prefilled
    check_clean(prefill, decode)


def test_a_decode_worker_that_dies_mid_pull_leaves_no_block_taken(tiny_llama):
    prefill = start_worker("prefill", "p0", engine_options(tiny_llama), TRANSFER)
    decode = start_worker("decode", "d0", engine_options(tiny_llama), TRANSFER)
    try:
        pair(prefill, decode)
        a = random_prompts([22], seed=121)[0]
        run = a + tokens(turn(prefill, decode, "t1", a))
        check_clean(prefill, decode)
        os.kill(decode.process.pid, signal.SIGSTOP)  # it no longer answers asks ...
        # A caller that gives up first: its pull still ends by itself and frees its blocks.
        with pytest.raises(TransferTimeout, match="did not finish within 1"):
            prefill.client.pull_blocks("d0", run, timeout=1.0)
        assert prefill.client.stats().free_blocks < 256  # the pull is still waiting
        wait_until(lambda: prefill.client.stats().free_blocks == 256, timeout=10)
        outcome: dict = {}

        def pull() -> None:
            try:
                outcome["result"] = prefill.client.pull_blocks("d0", run)
            except Exception as exc:  # noqa: BLE001 - inspected below
                outcome["error"] = exc

        start = time.monotonic()
        puller = threading.Thread(target=pull)
        puller.start()
        time.sleep(0.5)  # the prefill worker waits for the answer, its blocks taken
        decode.kill()  # ... and dies
        puller.join(30)
        assert isinstance(outcome.get("error"), TransferTimeout), outcome
        assert "did not answer pull" in str(outcome["error"])
        assert time.monotonic() - start < TRANSFER["timeout_seconds"] + 5
        stats = prefill.client.stats()
        assert stats.free_blocks == 256 and stats.blocks_pulled == 0
        prefill.client.check_integrity()
        assert metric(prefill.client.metrics(), "baton:kv_pull_failures_total") == 2
        # The prefill worker keeps serving; its cache holds a's blocks only, as before.
        result = prefill.client.prefill(PromptRequest("after", tuple(run), {"max_tokens": 1}))
        assert result.prefilled and result.num_cached_tokens == 20
    finally:
        decode.stop()
        prefill.stop()
