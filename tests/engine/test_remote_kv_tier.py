"""The decode side's KV tier in a hand-off: a reservation counts the decode engine's tier hits
after its device hits (loaded while the prefill engine computes), the prefill engine sends only
the blocks after them, and the tokens equal a colocated engine's. Two engines in one process,
blocks copied between their caches (the transport is tested in tests/disagg)."""

from __future__ import annotations

import threading

import pytest
import torch

from engine import LLMEngine, SamplingParams
from engine.kv_tier import KVTier
from tests.engine.test_remote_kv import copy_blocks
from tests.helpers import random_prompts, run_to_completion

BS = 4
OPTS = dict(skip_tokenizer_init=True, block_size=BS, chunk_size=16)
A, B = random_prompts([27, 40], seed=21)
A2 = A + random_prompts([5], seed=22)[0]  # the next turn: A's 6 full blocks, then new ones
GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


@pytest.fixture
def tier_options(request, tmp_path) -> dict:
    extra = {"kv_tier_path": str(tmp_path / "tier")} if request.param == "disk" else {}
    return dict(kv_tier=request.param, kv_tier_bytes=1 << 20, **extra)


def expected_tokens(model: str) -> dict[str, list[int]]:
    """a, b, a2 one after another on one engine without a tier."""
    engine = LLMEngine(model, num_kv_blocks=128, **OPTS)
    out = {}
    for rid, prompt in (("a", A), ("b", B), ("a2", A2)):
        engine.add_request(rid, prompt, GREEDY)
        out |= run_to_completion(engine)
    return out


class Handoff:
    """Prefill on one engine, hand the blocks the decode engine lacks to it."""

    def __init__(self, model: str, **decode_options) -> None:
        self.prefill = LLMEngine(model, num_kv_blocks=128, **OPTS)
        # 12 blocks: b (11 blocks) evicts a's blocks 1..6 from the device cache
        self.decode = LLMEngine(model, num_kv_blocks=12, **OPTS, **decode_options)
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}  # tokens the decode engine computed, per request

    def reserve(self, rid: str, prompt: list[int]) -> tuple[list[int], list[int], int]:
        """Prefill `prompt`; reserve on the decode side; copy the blocks it lacks. Returns
        (prefill block ids, decode block ids, blocks the decode side had or is loading)."""
        self.prefill.add_request(rid, prompt, GREEDY, prefill_only=True)
        seed = self.prefill.seed_of(rid)
        self.first = {}
        while self.prefill.has_unfinished():
            for out in self.prefill.step().outputs.values():
                self.first[rid] = out.new_token_ids[0]
        dst, n_hit = self.decode.reserve_remote(rid, prompt, GREEDY, seed)
        src = self.prefill.held_block_ids(rid)
        copy_blocks(self.prefill, src[n_hit:], self.decode, dst[n_hit:])
        return src, dst, n_hit

    def complete(self, rid: str) -> None:
        self.decode.complete_remote(rid, self.first[rid])
        assert self.prefill.release_held(rid)

    def run(self) -> None:
        while self.decode.has_unfinished():
            result = self.decode.step()
            for rid, n in result.scheduled.items():
                self.computed[rid] = self.computed.get(rid, 0) + n
            for rid, out in result.outputs.items():
                self.tokens.setdefault(rid, []).extend(out.new_token_ids)
        self.decode.check_integrity()

    def turn(self, rid: str, prompt: list[int]) -> int:
        """One whole hand-off; returns the blocks the decode side did not receive."""
        _, _, n_hit = self.reserve(rid, prompt)
        self.complete(rid)
        self.run()
        return n_hit

    def first_turns(self) -> None:
        """a, then b, whose blocks push a's blocks 1..6 out of the decode's device cache."""
        assert self.turn("a", A) == 0
        assert self.turn("b", B) == 0
        tier = self.decode.kv_tier
        if tier is not None:
            assert tier.flush(timeout=30)


def block(engine: LLMEngine, block_id: int) -> torch.Tensor:
    return torch.stack([layer[:, block_id] for layer in engine.kv_caches]).clone()


@pytest.mark.parametrize("tier_options", ["host", "disk"], indirect=True)
def test_tier_hits_on_the_decode_side_are_loaded_not_received(tiny_llama, tier_options):
    run = Handoff(tiny_llama, **tier_options)
    run.first_turns()
    src, dst, n_hit = run.reserve("a2", A2)
    # a's head block is still on the device, blocks 1..5 come from the tier: 6 of a2's 8
    # blocks are not received (block 6 differs: a's held a's first output token there).
    assert n_hit == 6
    assert run.decode.num_tier_blocks("a2") == 5
    run.complete("a2")  # waits for the load
    for s, d in zip(src[:n_hit], dst[:n_hit], strict=True):  # the prefill engine's bytes
        assert torch.equal(
            block(run.decode, d).view(torch.int32), block(run.prefill, s).view(torch.int32)
        )
    run.run()
    assert run.tokens == expected_tokens(tiny_llama)
    assert run.computed["a2"] == 2  # two decode steps: nothing of the prompt recomputed
    s = run.decode.kv_tier.stats()
    assert (s.loads, s.blocks_read) == (1, 5)
    run.decode.close()


def test_without_a_tier_the_decode_side_counts_its_device_hits_only(tiny_llama):
    run = Handoff(tiny_llama)
    run.first_turns()
    _, _, n_hit = run.reserve("a2", A2)
    assert n_hit == 1 and run.decode.num_tier_blocks("a2") == 0
    run.complete("a2")
    run.run()
    assert run.tokens == expected_tokens(tiny_llama)


def paused(model: str) -> tuple[Handoff, KVTier]:
    """The first turns done on a decode engine with a host tier whose loads are paused."""
    run = Handoff(model, kv_tier="host", kv_tier_bytes=1 << 20)
    run.first_turns()
    run.decode.kv_tier.pause_loads()
    return run, run.decode.kv_tier


def test_a_load_still_running_when_the_kv_arrives_is_waited_for(tiny_llama):
    run, tier = paused(tiny_llama)
    _, _, n_hit = run.reserve("a2", A2)
    assert n_hit == 6
    threading.Timer(0.2, tier.resume_loads).start()
    run.complete("a2")  # blocks until the resumed load is done
    run.run()
    assert run.tokens == expected_tokens(tiny_llama)
    assert run.computed["a2"] == 2
    assert tier.stats().blocks_read == 5


def test_a_load_that_does_not_finish_in_time_is_stopped_and_its_blocks_computed(tiny_llama):
    run, tier = paused(tiny_llama)
    run.decode.remote_tier_wait_s = 0.0
    _, _, n_hit = run.reserve("a2", A2)
    assert n_hit == 6  # the prefill engine sent blocks 6 and 7 only
    run.complete("a2")  # the load is dropped: blocks 1..5 are computed here
    tier.resume_loads()
    run.run()
    assert run.tokens == expected_tokens(tiny_llama)
    # From block 1 on: 33 tokens (32 prompt + the first token) less 4 on the device, then one
    # decode step for the third token.
    assert run.computed["a2"] == 33 - 4 + 1
    assert tier.stats().blocks_read == 0


def test_abort_during_the_decode_sides_tier_load_frees_every_block(tiny_llama):
    run, tier = paused(tiny_llama)
    run.reserve("a2", A2)
    assert run.decode.abort("a2")  # the queued load is dropped before the blocks are freed
    out = run.decode.step().outputs["a2"]
    assert out.finish_reason == "abort"
    run.decode.check_integrity()
    assert run.decode.pool.num_free_blocks == 12
    tier.resume_loads()
    assert run.decode.num_tier_blocks("a2") == 0
