"""Router membership over fake workers (pure Python): a worker left out by set_workers takes no
new request but finishes its running ones (active_counts shows them), a request waits for a
worker while a pool is empty, duplicate request ids are refused, a worker that cannot report
its KV events does not fail requests."""

from __future__ import annotations

import threading
import time

import pytest

from engine.errors import InvalidRequestError, NoFreeBlocksError
from router.policy import NoWorkerAvailable
from router.router import Router
from tests.helpers import generate_in_thread, wait_until
from tests.router.fake_workers import FakeDecode, FakePrefill, FullDecode

PARAMS = {"max_tokens": 2, "temperature": 0.0, "seed": 1}


def run(router: Router, request_id: str, out: dict) -> threading.Thread:
    return generate_in_thread(router, request_id, [1, 2, 3, 4, 5], PARAMS, out)


def test_left_out_worker_finishes_running_requests_and_gets_no_new_ones():
    p0, d0, p1, d1 = FakePrefill(), FakeDecode(), FakePrefill(), FakeDecode()
    router = Router({"p0": p0}, {"d0": d0}, block_size=4, hash_seed="t")
    out: dict = {}
    first = run(router, "r1", out)
    wait_until(lambda: router.active_counts() == {"p0": 1, "d0": 1})
    router.set_workers({"p1": p1}, {"d1": d1})
    assert router.active_counts() == {"p0": 1, "d0": 1}  # still running on the old pair
    second = run(router, "r2", out)
    # d1 reserves r2's blocks before p1 prefills it: wait for both
    wait_until(lambda: "r2" in d1.release and p1.prefilled)
    assert p1.prefilled == ["r2"] and p0.prefilled == ["r1"] and "r2" not in d0.release
    assert router.active_counts() == {"p0": 1, "d0": 1, "p1": 1, "d1": 1}
    d0.release["r1"].set()
    first.join(10)
    assert router.active_counts() == {"p1": 1, "d1": 1}
    assert out["r1"][-1]["finish_reason"] == "length"
    assert (out["r1"][-1]["prefill_worker"], out["r1"][-1]["decode_worker"]) == ("p0", "d0")
    d1.release["r2"].set()
    second.join(10)
    assert router.active_counts() == {}
    assert sorted(router.index.workers()) == ["d1", "p1"]  # the old pair left the index


def test_request_waits_for_a_worker_while_a_pool_is_empty():
    router = Router({}, {}, block_size=4, hash_seed="t", wait_for_workers_s=30.0)
    out: dict = {}
    waiting = run(router, "r1", out)
    time.sleep(0.3)
    assert "r1" not in out  # neither failed nor served yet
    p, d = FakePrefill(), FakeDecode()
    router.set_workers({"p0": p}, {"d0": d})
    wait_until(lambda: "r1" in d.release)
    d.release["r1"].set()
    waiting.join(10)
    assert out["r1"][-1]["prefill_worker"] == "p0"


def test_no_worker_fails_once_the_wait_is_over():
    router = Router({}, {"d0": FakeDecode()}, block_size=4, hash_seed="t", wait_for_workers_s=0.2)
    start = time.monotonic()
    with pytest.raises(NoWorkerAvailable, match="no healthy prefill worker"):
        list(router.generate("r1", [1, 2, 3], PARAMS))
    assert 0.2 <= time.monotonic() - start < 5


def test_duplicate_running_request_id_is_refused():
    d = FakeDecode()
    router = Router({"p0": FakePrefill()}, {"d0": d}, block_size=4, hash_seed="t")
    out: dict = {}
    first = run(router, "same", out)
    wait_until(lambda: router.active_counts() == {"p0": 1, "d0": 1})
    with pytest.raises(InvalidRequestError, match="request id 'same' is already running"):
        list(router.generate("same", [9, 9], PARAMS))
    d.release["same"].set()
    first.join(10)
    assert out["same"][-1]["finish_reason"] == "length"


def test_a_worker_failing_to_report_events_does_not_fail_requests():
    d = FakeDecode()
    router = Router({"p0": FakePrefill(events_fail=True)}, {"d0": d}, block_size=4, hash_seed="t")
    out: dict = {}
    t = run(router, "r1", out)
    wait_until(lambda: "r1" in d.release)
    d.release["r1"].set()
    t.join(10)
    assert out["r1"][-1]["finish_reason"] == "length"


def test_new_block_size_drops_the_index_entries_hashed_the_old_way():
    router = Router({"p0": FakePrefill()}, {"d0": FakeDecode()}, block_size=4, hash_seed="t")
    router.index.apply("p0", [{"kind": "stored", "block_hashes": [11, 12], "parent_hash": None}])
    router.set_workers(dict(router.prefill), dict(router.decode), block_size=4, hash_seed="t")
    assert router.index.num_blocks("p0") == 2  # same hashing: kept
    router.set_workers(dict(router.prefill), dict(router.decode), block_size=8, hash_seed="t")
    assert (router.index.num_blocks("p0"), router.block_size) == (0, 8)


def test_a_block_size_without_a_hash_seed_keeps_the_seed():
    router = Router({"p0": FakePrefill()}, {"d0": FakeDecode()}, block_size=4, hash_seed="t")
    router.index.apply("p0", [{"kind": "stored", "block_hashes": [11, 12], "parent_hash": None}])
    router.set_workers(dict(router.prefill), dict(router.decode), block_size=4)
    assert (router.index.num_blocks("p0"), router.block_size, router.pools.hash_seed) == (2, 4, "t")
    router.set_workers(dict(router.prefill), dict(router.decode), block_size=8)
    assert (router.index.num_blocks("p0"), router.block_size, router.pools.hash_seed) == (0, 8, "t")


def test_request_waits_for_free_decode_blocks_instead_of_failing():
    d = FullDecode()
    router = Router(
        {"p0": FakePrefill()}, {"d0": d}, block_size=4, hash_seed="t", wait_for_workers_s=30.0
    )
    out: dict = {}
    waiting = run(router, "r1", out)
    time.sleep(0.5)
    assert "r1" not in out and d.refused == 0  # waiting, not failed, nothing reserved yet
    d.room.set()  # running requests finished
    wait_until(lambda: "r1" in d.release)
    d.release["r1"].set()
    waiting.join(10)
    assert out["r1"][-1]["finish_reason"] == "length"


def test_a_reservation_refused_for_now_is_retried():
    d = FullDecode(stale=2)
    d.room.set()
    d.release["r1"] = threading.Event()
    d.release["r1"].set()
    router = Router(
        {"p0": FakePrefill()}, {"d0": d}, block_size=4, hash_seed="t", wait_for_workers_s=30.0
    )
    out = list(router.generate("r1", [1, 2, 3, 4, 5], PARAMS))
    assert d.refused == 2 and out[-1]["finish_reason"] == "length"
    assert router.active_counts() == {}


def test_no_room_fails_at_once_without_a_wait_or_when_the_prompt_never_fits():
    router = Router({"p0": FakePrefill()}, {"d0": FullDecode()}, block_size=4, hash_seed="t")
    with pytest.raises(NoFreeBlocksError):
        list(router.generate("r1", [1, 2, 3, 4, 5], PARAMS))
    tiny = FullDecode(num_blocks=1)  # 5 tokens need 2 blocks of 4: never
    router = Router(
        {"p0": FakePrefill()}, {"d0": tiny}, block_size=4, hash_seed="t", wait_for_workers_s=30.0
    )
    start = time.monotonic()
    with pytest.raises(NoFreeBlocksError):
        list(router.generate("r1", [1, 2, 3, 4, 5], PARAMS))
    assert time.monotonic() - start < 5 and router.active_counts() == {}
