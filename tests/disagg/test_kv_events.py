"""Workers publish the engine's stored/removed block-hash events for the router's index."""

from __future__ import annotations

from engine.block_hash import hash_prompt_blocks
from kvtransfer.worker_api import PromptRequest
from prefill_worker.worker import PrefillWorker
from router.kv_index import KVIndex
from tests.helpers import random_prompts


def test_prefill_worker_events_build_the_router_index(tiny_llama):
    worker = PrefillWorker(
        "p0",
        dict(
            model=tiny_llama, skip_tokenizer_init=True, block_size=4, num_kv_blocks=8, hash_seed="s"
        ),
    )
    try:
        a, b = random_prompts([13, 21], seed=5)
        params = {"max_tokens": 1, "temperature": 0.0}
        assert worker.prefill(PromptRequest("a", tuple(a), params)).prefilled
        events = worker.kv_events()
        expected = hash_prompt_blocks(a, 4, "s")  # 3 full blocks
        assert [e.kind for e in events] == ["stored"] * 3
        assert [h for e in events for h in e.block_hashes] == expected
        assert worker.kv_events() == []  # taken once
        index = KVIndex()
        index.add_worker("p0")
        index.apply("p0", events)
        assert index.prefix_hits("p0", expected) == 3
        # b needs 6 of the 8 blocks: 4 never used, then a's blocks tail first (its partial
        # block and its third full block), so a's first two blocks stay cached.
        worker.prefill(PromptRequest("b", tuple(b), params))
        index.apply("p0", worker.kv_events())
        assert index.prefix_hits("p0", expected) == 2
        assert index.prefix_hits("p0", hash_prompt_blocks(b, 4, "s")) == 5
        worker.check_integrity()
    finally:
        worker.shutdown()
