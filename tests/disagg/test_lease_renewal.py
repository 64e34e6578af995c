"""A prefill that takes longer than the lease is not taken for a lost one: while it computes,
the prefill worker renews the decode worker's reservation (a third of a lease at a time), and
the request completes with the offline engine's tokens. A reservation nobody renews still
lapses (tests/disagg/test_metrics_e2e.py)."""

from __future__ import annotations

import threading
import time

from decode_worker.worker import DecodeWorker
from engine import LLM, SamplingParams
from prefill_worker.worker import PrefillWorker
from router.handoff import generate_disaggregated
from tests.helpers import random_prompts

LEASE_S = 1.0
GREEDY = dict(max_tokens=5, temperature=0.0, ignore_eos=True)


def test_prefill_slower_than_the_lease_keeps_its_reservation(tiny_llama):
    options = dict(model=tiny_llama, skip_tokenizer_init=True, block_size=4, num_kv_blocks=64)
    transfer = {"lease_seconds": LEASE_S, "timeout_seconds": 10.0}
    p, d = PrefillWorker("p0", options, transfer), DecodeWorker("d0", options, transfer)
    try:
        d.connect_prefill("p0", p.connect_decode("d0", d), p)
        prompt = random_prompts([30], seed=77)[0]
        want = LLM(**options).generate([prompt], SamplingParams(**GREEDY))[0].token_ids
        # One step of the prefill engine takes 3.5 leases (a long chunk on a busy machine):
        # the request waits behind it, its reservation made before.
        step = threading.Thread(target=p.loop.run, args=(time.sleep, 3.5 * LEASE_S))
        step.start()
        time.sleep(0.1)
        start = time.monotonic()
        outs = list(
            generate_disaggregated(
                p, d, "slow", prompt, GREEDY, prefill_id="p0", decode_id="d0", timeout=60
            )
        )
        step.join()
        assert time.monotonic() - start > 3 * LEASE_S  # it did wait past the lease
        assert outs[-1]["finish_reason"] == "length", outs[-1].get("error")
        assert [t for o in outs for t in o["token_ids"]] == want
        assert d.transfer_metrics.failures._value.get() == 0  # the lease never lapsed
        d.check_integrity()
        p.check_integrity()
    finally:
        p.shutdown()
        d.shutdown()
