"""A worker's disk KV tier across restarts, with real worker processes: its directory is
<kv_tier_path>/<worker id> (as the controller gives it); killed and started again with the same
id, the worker re-indexes the directory, publishes the blocks as `stored` KV events with
medium disk, and serves a prompt from them (the same tokens, the prefix not computed); stopped
normally, it first writes what its KV cache held; as a decode worker it counts its tier hits
in a reservation, so the prefill worker sends only the rest."""

from __future__ import annotations

import os
import time

from cluster.templates import worker_engine_options
from engine import LLMEngine, SamplingParams
from engine.block_hash import hash_prompt_blocks
from engine.options import EngineOptions
from router.handoff import generate_disaggregated, generate_local
from tests.disagg.cluster import pair, start_worker, tokens
from tests.disagg.test_two_processes import engine_options
from tests.helpers import random_prompts, run_to_completion

TRANSFER = {"timeout_seconds": 5.0, "lease_seconds": 4.0}
BS = 4
PROMPT, BIG, C, TAIL = random_prompts([27, 44, 21, 6], seed=131)
SEED = EngineOptions().hash_seed
GREEDY = dict(max_tokens=3, temperature=0.0, ignore_eos=True, seed=1)


def decode_options(model: str, parent: str) -> dict:
    """decode-0's engine options: a 12-block KV cache over a disk tier in parent/decode-0."""
    template = dict(
        engine_options(model),
        num_kv_blocks=12,
        kv_tier="disk",
        kv_tier_bytes=1 << 20,
        kv_tier_path=parent,
    )
    return worker_engine_options(template, "decode-0")


def local(decode, rid: str, prompt: list[int]) -> list[dict]:
    return list(generate_local(decode.client, rid, prompt, GREEDY, timeout=60))


def wait_for(cond, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)
    return value


def stored_on_disk(decode, want: set[int]) -> set[int]:
    """The hashes a freshly started worker announces, once they include `want` (every event
    must be a `stored` one with medium disk: nothing else happened on it yet)."""
    events: list = []

    def seen() -> bool:
        events.extend(decode.client.kv_events())
        return want <= {h for e in events for h in e.block_hashes}

    wait_for(seen)
    assert all(e.kind == "stored" and e.medium == "disk" for e in events), events
    return {h for e in events for h in e.block_hashes}


def files(directory: str) -> set[int]:
    return {int(n[: -len(".kvb")], 16) for n in os.listdir(directory) if n.endswith(".kvb")}


def test_a_killed_worker_reopens_its_tier_and_serves_from_it(tiny_llama, tmp_path):
    parent = str(tmp_path / "tiers")
    options = decode_options(tiny_llama, parent)
    directory = options["kv_tier_path"]
    assert directory == os.path.join(parent, "decode-0")
    prompt_hashes = hash_prompt_blocks(PROMPT, BS, SEED)  # 6 full blocks

    decode = start_worker("decode", "decode-0", options, TRANSFER)
    try:
        first = tokens(local(decode, "a", PROMPT))
        local(decode, "big", BIG)  # 12 blocks: all of a's go to the disk tier
        wait_for(lambda: decode.client.stats().tier_blocks >= 7)
        decode.kill()  # no shutdown: only what the tier had written survives
    finally:
        decode.stop()

    decode = start_worker("decode", "decode-0", options, TRANSFER)  # the same id: same dir
    try:
        announced = stored_on_disk(decode, set(prompt_hashes))
        assert announced == files(directory)
        stats = decode.client.stats()
        assert (stats.tier_medium, stats.tier_blocks) == ("disk", len(announced))
        outs = local(decode, "a2", PROMPT)
        assert tokens(outs) == first
        assert outs[-1]["num_cached_tokens"] == 24  # 6 blocks from the tier, 3 tokens computed
        stats = decode.client.stats()
        assert (stats.tier_hits, stats.tier_blocks_read) == (6, 6)
        local(decode, "c", C)  # C's blocks stay on the device ...
    finally:
        decode.stop()  # ... until a normal stop writes them to the tier

    c_hashes = hash_prompt_blocks(C, BS, SEED)  # 5 full blocks
    assert set(c_hashes) <= files(directory)
    decode = start_worker("decode", "decode-0", options, TRANSFER)
    prefill = start_worker("prefill", "prefill-0", engine_options(tiny_llama), TRANSFER)
    try:
        assert set(c_hashes) <= stored_on_disk(decode, set(c_hashes))
        pair(prefill, decode)
        before = decode.client.stats()
        prompt = C + TAIL  # 27 tokens, 7 blocks: C's 5 full blocks are in the decode's tier
        outs = list(
            generate_disaggregated(
                prefill.client,
                decode.client,
                "c2",
                prompt,
                GREEDY,
                prefill_id="prefill-0",
                decode_id="decode-0",
                timeout=60,
            )
        )
        after = decode.client.stats()
        assert after.blocks_received - before.blocks_received == 7 - 5  # only the rest moved
        assert after.tier_blocks_read - before.tier_blocks_read == 5
        reference = LLMEngine(**engine_options(tiny_llama))
        reference.add_request("c2", prompt, SamplingParams(**GREEDY))
        assert tokens(outs) == run_to_completion(reference)["c2"]
        decode.client.check_integrity()
    finally:
        prefill.stop()
        decode.stop()
