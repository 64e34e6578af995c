"""TierIndex (LRU under a byte bound, pins) and IOThread (order, pause, failures, close)."""

from __future__ import annotations

import threading

import pytest

from engine.kv_tier.index import TierEntry, TierIndex
from engine.kv_tier.io_thread import IOThread


def filled_index(sizes: list[int], capacity: int) -> TierIndex:
    index = TierIndex(capacity)
    for i, n in enumerate(sizes):
        index.add(TierEntry(block_hash=i, nbytes=n, last_use=i))
    return index


def test_make_room_picks_least_recently_used_first_and_skips_pinned():
    index = filled_index([10, 20, 30], capacity=60)
    assert index.make_room(0) == []
    assert [e.block_hash for e in index.make_room(5)] == [0]
    assert [e.block_hash for e in index.make_room(15)] == [0, 1]  # 10 is not enough
    index.get(0).pins = 1
    assert [e.block_hash for e in index.make_room(15)] == [1]
    index.get(1).pins = 2
    assert [e.block_hash for e in index.make_room(15)] == [2]
    index.get(2).pins = 1
    assert index.make_room(1) is None  # all pinned
    assert index.make_room(61) is None  # over capacity whatever is evicted
    assert index.usage_bytes == 60 and len(index) == 3  # make_room removes nothing
    index.check_integrity()


def test_touch_moves_to_the_back_and_leading_stops_at_a_miss():
    index = filled_index([1, 1, 1], capacity=3)
    index.touch(0, now=10)
    assert [e.block_hash for e in index] == [1, 2, 0]
    assert index.leading([0, 1, 7, 2]) == 2
    assert index.leading([7, 0]) == 0
    index.check_integrity()


def test_add_refuses_duplicates_and_overflow():
    index = filled_index([5], capacity=8)
    with pytest.raises(KeyError, match="already in the tier"):
        index.add(TierEntry(0, 1))
    with pytest.raises(ValueError, match="4 bytes do not fit: 5 of 8 in use"):
        index.add(TierEntry(1, 4))
    assert index.remove(0).nbytes == 5 and index.remove(0) is None
    assert index.usage_bytes == 0


def test_io_thread_runs_in_order_survives_failures_and_drains_on_close():
    done: list[int] = []

    def work(i: int) -> None:
        if i == 2:
            raise RuntimeError("boom")
        done.append(i)

    thread = IOThread(work, "test-io", depth=3)
    thread.pause()
    assert [thread.submit(i) for i in range(4)] == [True, True, True, False]
    assert not thread.has_room() and thread.pending() == 3
    thread.resume()
    assert thread.flush(timeout=30)
    assert done == [0, 1]  # 2 failed (logged), the thread kept going
    thread.pause()
    assert thread.submit(3) and thread.submit(4)
    thread.close(timeout=30)  # resumes and drains
    assert done == [0, 1, 3, 4]
    assert not thread.submit(5)


def test_io_thread_without_depth_never_refuses():
    gate = threading.Event()
    thread = IOThread(lambda _: gate.wait(30), "test-io-unbounded")
    assert all(thread.submit(i) for i in range(100))
    gate.set()
    assert thread.flush(timeout=30)
    thread.close()
