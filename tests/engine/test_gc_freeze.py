"""freeze_startup_objects: garbage of start-up is collected, what is alive is frozen."""

from __future__ import annotations

import gc
import weakref

from engine.gc_freeze import freeze_startup_objects


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def test_collects_start_up_garbage_then_freezes_what_is_alive():
    alive = Node()
    garbage = Node()
    garbage.other = Node()
    garbage.other.other = garbage  # a cycle: only the collector frees it
    dead = weakref.ref(garbage)
    del garbage
    try:
        frozen = freeze_startup_objects()
        assert dead() is None  # collected before the freeze, not kept forever
        # other threads of the process may free frozen objects since, never freeze more
        assert 0 < gc.get_freeze_count() <= frozen
        # a frozen object is in no generation a collection scans
        assert all(obj is not alive for g in range(3) for obj in gc.get_objects(generation=g))
    finally:
        gc.unfreeze()  # the rest of the test session collects as usual
    assert any(obj is alive for obj in gc.get_objects(generation=2))
