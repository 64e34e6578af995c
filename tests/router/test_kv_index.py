"""KVIndex: exact leading prefix hits from stored/removed events, per worker."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_hash import hash_prompt_blocks
from engine.block_pool import BlockPool, KVEvent
from router.kv_index import KVIndex, PrefixHits, UnknownWorker

SEED = "router-test-seed"
BS = 4


def blocks(first: int, n_blocks: int, shared: int = 0) -> list[int]:
    """Hashes of an n-block prompt whose first `shared` blocks equal those of prompt 0."""
    tokens = [t for t in range(shared * BS)] + [first + t for t in range((n_blocks - shared) * BS)]
    return hash_prompt_blocks(tokens, BS, SEED)


def stored(hashes: list[int]) -> list[KVEvent]:
    """One stored event per block, carrying its parent, as BlockPool.cache_block emits."""
    return [KVEvent("stored", (h,), hashes[i - 1] if i else None) for i, h in enumerate(hashes)]


def index_with(**workers: list[int]) -> KVIndex:
    index = KVIndex()
    for w, hashes in workers.items():
        index.add_worker(w)
        index.apply(w, stored(hashes))
    return index


A = blocks(0, 8)  # prompt 0: 8 blocks
B = blocks(1000, 8, shared=3)  # shares exactly its first 3 blocks with A


def test_stored_events_give_leading_prefix_hits():
    index = index_with(p0=A[:5])
    assert B[:3] == A[:3] and B[3] != A[3]
    assert index.prefix_hits("p0", A) == 5
    assert index.prefix_hits("p0", B) == 3
    assert index.prefix_hits("p0", A[:2]) == 2
    assert index.prefix_hits("p0", []) == 0
    assert index.prefix_hits("p0", blocks(5000, 8)) == 0  # first block differs
    assert index.prefix_hits("nobody", A) == 0
    assert index.num_blocks("p0") == 5


def test_removing_a_middle_block_cuts_the_run():
    index = index_with(p0=A, p1=A)
    index.apply("p0", [KVEvent("removed", (A[3],))])
    assert index.prefix_hits("p0", A) == 3  # blocks 4..7 are held but no longer a prefix
    assert index.num_blocks("p0") == 7
    assert index.prefix_hits("p1", A) == 8  # other workers' entries are untouched
    index.apply("p0", stored([A[3]]))
    assert index.prefix_hits("p0", A) == 8
    index.check_integrity()


def test_events_apply_in_order_within_a_batch():
    index = index_with(p0=[])
    index.apply("p0", [KVEvent("stored", (A[0],)), KVEvent("removed", (A[0],))])
    assert index.prefix_hits("p0", A) == 0
    index.apply("p0", [KVEvent("removed", (A[0],)), KVEvent("stored", (A[0], A[1]))])
    assert index.prefix_hits("p0", A) == 2
    # Duplicates and removals of absent hashes are no-ops.
    index.apply("p0", [KVEvent("stored", (A[0],)), KVEvent("removed", (A[7],))])
    assert index.num_blocks("p0") == 2
    index.check_integrity()


def test_index_follows_a_real_block_pool():
    pool = BlockPool(num_blocks=4)
    tokens = list(range(4 * BS))
    hashes = hash_prompt_blocks(tokens, BS, SEED)
    table = pool.allocate(4)
    for i, (block, h) in enumerate(zip(table, hashes, strict=True)):
        parent = hashes[i - 1] if i else 0
        pool.cache_block(block, h, (parent, tuple(tokens[i * BS : (i + 1) * BS]), ()))
    pool.free(list(reversed(table)))  # tail first: blocks 3 and 2 are evicted first
    index = index_with(d0=[])
    index.apply("d0", pool.take_events())
    assert index.prefix_hits("d0", hashes) == 4
    pool.allocate(2)
    index.apply("d0", pool.take_events())
    assert index.prefix_hits("d0", hashes) == 2
    assert index.num_blocks("d0") == pool.num_cached_blocks == 2


def test_remove_worker_drops_everything():
    index = index_with(p0=A, p1=B[:4])
    index.remove_worker("p0")
    assert index.workers() == ["p1"]
    assert index.prefix_hits("p0", A) == 0
    assert index.num_blocks("p0") == 0
    assert index.best(A) == {"p1": 3}
    index.check_integrity()
    index.remove_worker("p0")  # idempotent
    with pytest.raises(UnknownWorker, match="add_worker"):
        index.apply("p0", stored(A))  # late events do not resurrect a removed worker
    index.add_worker("p0")  # a restarted worker starts empty
    assert index.prefix_hits("p0", A) == 0
    index.add_worker("p1")  # re-adding keeps entries
    assert index.prefix_hits("p1", B) == 4


def test_dict_form_events_as_they_arrive_over_rpc():
    wire = msgpack.packb([dataclasses.asdict(e) for e in stored(A[:6])])
    events = msgpack.unpackb(wire)
    assert isinstance(events[0], dict) and isinstance(events[0]["block_hashes"], list)
    index = index_with(p0=[])
    index.apply("p0", events)
    index.apply("p0", [{"kind": "removed", "block_hashes": [A[5]], "parent_hash": None}])
    index.apply("p0", [{"kind": "stored", "block_hashes": [A[6]]}])  # parent_hash optional
    assert index.prefix_hits("p0", A) == 5
    assert index.num_blocks("p0") == 6


@pytest.mark.parametrize(
    "bad",
    [
        {"kind": "evicted", "block_hashes": [1]},
        {"block_hashes": [1]},
        {"kind": "stored"},
        ("stored", [1]),
    ],
)
def test_a_bad_event_rejects_the_whole_batch(bad):
    index = index_with(p0=[])
    with pytest.raises(ValueError):
        index.apply("p0", [KVEvent("stored", (A[0],)), bad])
    assert index.num_blocks("p0") == 0


def test_best_orders_workers_by_hits_then_id():
    index = index_with(p2=A[:2], p0=A[:5], p1=B, p3=[])
    assert list(index.best(A).items()) == [("p0", 5), ("p1", 3), ("p2", 2), ("p3", 0)]
    assert list(index.best(B).items()) == [("p1", 8), ("p0", 3), ("p2", 2), ("p3", 0)]
    assert index.best([]) == {"p0": 0, "p1": 0, "p2": 0, "p3": 0}


# ---- media: the KV cache ("device") and the KV tier ("host", "disk") -----------------------
def on(medium: str, kind: str, hashes: list[int]) -> KVEvent:
    return KVEvent(kind, tuple(hashes), medium=medium)


def test_a_block_evicted_to_the_tier_is_a_tier_hit_after_the_device_run():
    index = index_with(d0=A[:6])
    # The KV cache evicts blocks 3..5; the tier stores them (as an engine's events say).
    index.apply("d0", [on("device", "removed", A[3:6]), on("disk", "stored", A[3:6])])
    assert index.hits("d0", A) == PrefixHits(device=3, tier=3, medium="disk")
    assert index.prefix_hits("d0", A) == 3  # the KV cache's run alone
    assert (index.num_blocks("d0"), index.num_blocks("d0", "disk")) == (3, 3)
    # The tier run starts where the device run stops: block 0 only in the tier is no hit
    # for a prompt whose device run is 0 ... unless the tier holds block 0 too.
    index.apply("d0", [on("device", "removed", A[:1])])
    assert index.hits("d0", A) == PrefixHits(0, 0, None)
    index.apply("d0", [on("disk", "stored", A[:3])])
    assert index.hits("d0", A) == PrefixHits(0, 6, "disk")
    index.check_integrity()


def test_a_tier_eviction_keeps_the_device_copy_and_vice_versa():
    index = index_with(d0=[])
    index.apply(
        "d0",
        [
            on("device", "stored", A[:4]),
            on("host", "stored", A[:4]),  # written back while still cached
            on("host", "removed", A[:2]),  # the tier evicts its copies of blocks 0, 1
        ],
    )
    assert index.hits("d0", A) == PrefixHits(4, 0, None)  # the device still holds all four
    index.apply("d0", [on("device", "removed", A[2:4])])
    assert index.hits("d0", A) == PrefixHits(2, 2, "host")  # blocks 2, 3: the tier's copies
    index.apply("d0", [on("device", "removed", A[:2]), on("device", "stored", A[:1])])
    assert index.hits("d0", A) == PrefixHits(1, 0, None)  # block 1 is nowhere now
    assert (index.num_blocks("d0"), index.num_blocks("d0", "host")) == (1, 2)
    index.check_integrity()


def test_dict_events_carry_their_medium():
    index = index_with(d0=[])
    wire = msgpack.unpackb(msgpack.packb([dataclasses.asdict(on("disk", "stored", A[:3]))]))
    index.apply("d0", wire)
    index.apply("d0", [{"kind": "stored", "block_hashes": [A[0]]}])  # no medium: device
    assert index.hits("d0", A) == PrefixHits(1, 2, "disk")
    with pytest.raises(ValueError, match="medium must be a string"):
        index.apply("d0", [{"kind": "stored", "block_hashes": [A[5]], "medium": 3}])


def test_a_restart_empties_the_device_and_host_entries_but_keeps_the_disk_ones():
    index = index_with(d0=A[:2], p0=A[:3])
    index.apply("d0", [on("disk", "stored", A[2:5])])
    index.apply("p0", [on("host", "stored", A[3:5])])
    # The restarted d0 re-announces what its disk tier kept before the restart is reported.
    index.apply("d0", [on("disk", "stored", A[:2])])
    index.restart_worker("d0")
    index.restart_worker("p0")
    assert index.hits("d0", A) == PrefixHits(0, 5, "disk")
    assert index.hits("p0", A) == PrefixHits(0, 0, None)
    assert (index.num_blocks("d0"), index.num_blocks("p0", "host")) == (0, 0)
    index.restart_worker("nobody")  # no-op
    index.remove_worker("d0")
    index.add_worker("d0")
    assert index.hits("d0", A) == PrefixHits(0, 0, None)  # removal forgets every medium
    index.check_integrity()


# ---- equivalence with a brute-force replay ---------------------------------------------------
POOL = A + B[3:]  # 13 distinct hashes; A and B share their first 3
WORKERS = ["w0", "w1", "w2"]
MEDIA = ["device", "disk"]
op = st.one_of(
    st.tuples(
        st.sampled_from(["stored", "removed"]),
        st.sampled_from(WORKERS),
        st.lists(st.sampled_from(POOL), max_size=5),
        st.sampled_from(MEDIA),
    ),
    st.tuples(
        st.sampled_from(["add", "drop", "restart"]),
        st.sampled_from(WORKERS),
        st.just([]),
        st.just(""),
    ),
)


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(op, max_size=40),
    queries=st.lists(st.lists(st.sampled_from(POOL), max_size=8), max_size=4),
)
def test_index_equals_brute_force_replay(ops, queries):
    index, model = KVIndex(), {}  # model: worker -> medium -> hashes
    for kind, worker, hashes, medium in ops:
        if kind == "add":
            index.add_worker(worker)
            model.setdefault(worker, {m: set() for m in MEDIA})
        elif kind == "drop":
            index.remove_worker(worker)
            model.pop(worker, None)
        elif kind == "restart":
            index.restart_worker(worker)
            if worker in model:
                model[worker]["device"] = set()
        elif worker not in model:
            with pytest.raises(UnknownWorker):
                index.apply(worker, [KVEvent(kind, tuple(hashes), medium=medium)])
        else:
            index.apply(worker, [KVEvent(kind, tuple(hashes), medium=medium)])
            held = model[worker][medium]
            (held.update if kind == "stored" else held.difference_update)(hashes)
    index.check_integrity()

    def run(held: set, prompt: list[int]) -> int:
        n = 0
        while n < len(prompt) and prompt[n] in held:
            n += 1
        return n

    def brute(worker: str, prompt: list[int]) -> PrefixHits:
        media = model.get(worker, {m: set() for m in MEDIA})
        device = run(media["device"], prompt)
        tier = run(media["disk"], prompt[device:])
        return PrefixHits(device, tier, "disk" if tier else None)

    assert index.workers() == sorted(model)
    for prompt in [A, B, *queries]:
        assert index.best(prompt) == {w: brute(w, prompt).device for w in model}
        for w in WORKERS:
            assert index.hits(w, prompt) == brute(w, prompt)
            assert index.prefix_hits(w, prompt) == brute(w, prompt).device
            for m in MEDIA:
                assert index.num_blocks(w, m) == len(model.get(w, {}).get(m, ()))
