"""cluster.plan: the exact steps of a reconcile for each case, without Ray."""

from __future__ import annotations

from cluster.plan import (
    Current,
    EnsureRouter,
    Note,
    Pair,
    Plan,
    Pool,
    Publish,
    Retire,
    Running,
    Start,
    Strategy,
    plan,
)
from cluster.templates import WorkerTemplate

ROOM = "not enough free resources ({free}) to start the new workers beside the old ones"


def template(role: str, max_num_seqs: int = 8, hash_seed: str = "0") -> WorkerTemplate:
    engine = {
        "model": "tiny",
        "dtype": "float32",
        "block_size": 4,
        "hash_seed": hash_seed,
        "max_num_seqs": max_num_seqs,
    }
    return WorkerTemplate(role, engine, {"backend": "gloo"}, {"CPU": 1}, 1)


def cluster(*worker_ids: str, has_router: bool = True, **options) -> Current:
    """Running workers (role from the id's prefix) with the template `options` give."""
    return Current(
        tuple(Running(w, template(w.split("-")[0], **options)) for w in worker_ids), has_router
    )


def want(prefill: int, decode: int, **options) -> dict[str, Pool]:
    return {
        "prefill": Pool(template("prefill", **options), prefill),
        "decode": Pool(template("decode", **options), decode),
    }


def test_first_apply_starts_everything_beside_nothing_even_without_free_resources():
    # No router yet: always a surge (Ray places the bundles or the start times out).
    assert plan(cluster(has_router=False), want(1, 1), {}) == Plan(
        Strategy.SURGE,
        (Start("prefill", 1), Start("decode", 1), Pair(), EnsureRouter(), Publish()),
        ("add 1 prefill worker(s)", "add 1 decode worker(s)"),
    )


def test_same_manifest_changes_nothing():
    assert plan(cluster("prefill-0", "decode-0"), want(1, 1), {"CPU": 0.0}) == Plan(
        Strategy.SURGE, (Pair(), EnsureRouter(), Publish()), ()
    )


def test_scale_up_starts_beside_the_running_workers_when_free_resources_hold_them():
    free = {"CPU": 2.0}  # exactly what the two new workers need
    assert plan(cluster("prefill-0", "decode-0"), want(2, 2), free) == Plan(
        Strategy.SURGE,
        (Start("prefill", 1), Start("decode", 1), Pair(), EnsureRouter(), Publish()),
        ("add 1 prefill worker(s)", "add 1 decode worker(s)"),
    )


def test_scale_down_retires_the_newest_workers_after_publishing_the_rest():
    current = cluster("prefill-0", "prefill-1", "prefill-2", "decode-0", "decode-1")
    assert plan(current, want(1, 1), {"CPU": 0.0}) == Plan(
        Strategy.SURGE,
        (Pair(), EnsureRouter(), Retire(("prefill-1", "prefill-2", "decode-1"))),
        ("remove 2 prefill worker(s)", "remove 1 decode worker(s)"),
    )


def test_changed_options_with_room_start_the_new_workers_before_the_old_ones_leave():
    assert plan(cluster("prefill-0", "decode-0"), want(1, 1, max_num_seqs=32), {"CPU": 2}) == Plan(
        Strategy.SURGE,
        (
            Start("prefill", 1),
            Start("decode", 1),
            Pair(),
            EnsureRouter(),
            Retire(("prefill-0", "decode-0")),
        ),
        (
            "replace 1 prefill worker(s) (options changed)",
            "replace 1 decode worker(s) (options changed)",
        ),
    )


def test_rolling_replace_when_there_is_no_room_and_the_kv_format_stays():
    free = {"CPU": 1.0}  # one new worker would fit, two do not
    assert plan(cluster("prefill-0", "decode-0"), want(1, 1, max_num_seqs=32), free) == Plan(
        Strategy.ROLLING,
        (
            EnsureRouter(),
            Note(ROOM.format(free=free) + ": replacing one worker at a time"),
            Publish(),
            Retire(("prefill-0",)),
            Start("prefill", 1),
            Pair(),
            Publish(),
            Retire(("decode-0",)),
            Start("decode", 1),
            Pair(),
            Publish(),
            Pair(),
            Publish(),
        ),
        (
            "replace 1 prefill worker(s) (options changed)",
            "replace 1 decode worker(s) (options changed)",
        ),
    )


def test_rolling_replace_removes_extra_outdated_workers_first_and_adds_the_rest_last():
    # prefill: 2 outdated, want 1 -> one replaced, one removed up front;
    # decode: 1 outdated, want 2 -> one replaced, one added after it.
    current = cluster("prefill-0", "prefill-1", "decode-0")
    assert plan(current, want(1, 2, max_num_seqs=32), {"CPU": 0.0}) == Plan(
        Strategy.ROLLING,
        (
            EnsureRouter(),
            Note(ROOM.format(free={"CPU": 0.0}) + ": replacing one worker at a time"),
            Retire(("prefill-1",)),
            Retire(("prefill-0",)),
            Start("prefill", 1),
            Pair(),
            Publish(),
            Retire(("decode-0",)),
            Start("decode", 1),
            Pair(),
            Publish(),
            Start("decode", 1),
            Pair(),
            Publish(),
        ),
        (
            "replace 1 prefill worker(s) (options changed)",
            "remove 1 prefill worker(s)",
            "replace 1 decode worker(s) (options changed)",
            "add 1 decode worker(s)",
        ),
    )


def test_all_at_once_replace_when_there_is_no_room_and_the_kv_format_changes():
    free = {"CPU": 0.0}
    assert plan(cluster("prefill-0", "decode-0"), want(1, 1, hash_seed="other"), free) == Plan(
        Strategy.ALL_AT_ONCE,
        (
            EnsureRouter(),
            Note(
                ROOM.format(free=free) + ", and the KV format changes: replacing every worker "
                "at once; requests wait at the router meanwhile"
            ),
            Retire(("prefill-0", "decode-0")),
            Start("prefill", 1),
            Start("decode", 1),
            Pair(),
            Publish(),
        ),
        (
            "replace 1 prefill worker(s) (options changed)",
            "replace 1 decode worker(s) (options changed)",
        ),
    )


def test_no_room_and_nothing_to_replace_starts_the_new_workers_anyway():
    # A scale-up the free resources cannot hold: each new worker waits for its bundle
    # (and the start fails after timeouts.PLACEMENT_S if none frees up).
    free = {"CPU": 1.0}
    assert plan(cluster("prefill-0", "decode-0"), want(1, 3), free) == Plan(
        Strategy.ROLLING,
        (
            EnsureRouter(),
            Note(
                ROOM.format(free=free)
                + ": starting them anyway (they need {'CPU': 2.0}), each waiting for room"
            ),
            Publish(),
            Start("decode", 2),
            Pair(),
            Publish(),
        ),
        ("add 2 decode worker(s)",),
    )


def test_only_workers_whose_template_changed_are_replaced():
    # prefill-0 is outdated, prefill-1 already has the new options: one replacement.
    current = Current(
        (
            Running("prefill-0", template("prefill")),
            Running("prefill-1", template("prefill", max_num_seqs=32)),
            Running("decode-0", template("decode", max_num_seqs=32)),
        ),
        has_router=True,
    )
    assert plan(current, want(2, 1, max_num_seqs=32), {"CPU": 1.0}) == Plan(
        Strategy.SURGE,
        (Start("prefill", 1), Pair(), EnsureRouter(), Retire(("prefill-0",))),
        ("replace 1 prefill worker(s) (options changed)",),
    )


def test_scale_prefill_to_zero_retires_every_prefill_worker_after_the_router_goes_aggregated():
    # EnsureRouter (which switches the router to aggregated) comes before the Retire: new
    # requests prefill on their decode worker while the prefill workers drain.
    current = cluster("prefill-0", "prefill-1", "decode-0")
    assert plan(current, want(0, 1), {"CPU": 0.0}) == Plan(
        Strategy.SURGE,
        (Pair(), EnsureRouter(), Retire(("prefill-0", "prefill-1"))),
        ("remove 2 prefill worker(s)",),
    )


def test_first_apply_with_zero_prefill_starts_only_decode_workers():
    assert plan(cluster(has_router=False), want(0, 2), {}) == Plan(
        Strategy.SURGE,
        (Start("decode", 2), Pair(), EnsureRouter(), Publish()),
        ("add 2 decode worker(s)",),
    )


def test_scale_prefill_from_zero_starts_pairs_then_publishes_them():
    assert plan(cluster("decode-0", "decode-1"), want(2, 2), {"CPU": 2.0}) == Plan(
        Strategy.SURGE,
        (Start("prefill", 2), Pair(), EnsureRouter(), Publish()),
        ("add 2 prefill worker(s)",),
    )


def test_scale_prefill_from_zero_without_room_starts_them_anyway():
    # The router stays aggregated until the last Publish names the new prefill workers.
    free = {"CPU": 1.0}
    assert plan(cluster("decode-0"), want(2, 1), free) == Plan(
        Strategy.ROLLING,
        (
            EnsureRouter(),
            Note(
                ROOM.format(free=free)
                + ": starting them anyway (they need {'CPU': 2.0}), each waiting for room"
            ),
            Publish(),
            Start("prefill", 2),
            Pair(),
            Publish(),
        ),
        ("add 2 prefill worker(s)",),
    )
