"""cluster.state without Ray: the saved document, taking it over after a restart (what is
gone is dropped with its pairs), and the numbering of progress lines across restarts."""

from __future__ import annotations

import json
from dataclasses import asdict

from cluster.state import EVENTS_KEPT, ClusterState, EventLog, RouterRecord
from tests.cluster.manifests import tiny_manifest
from tests.cluster.workers import TEMPLATES, worker


def running_state() -> ClusterState:
    state = ClusterState()
    state.manifest = tiny_manifest("tiny", decode=2)
    state.generation, state.restarts = 3, 1
    state.next_index.update({"prefill": 1, "decode": 2})
    for w in (
        worker("prefill-0", incarnation="i-p0", node_id="n1"),
        worker("decode-0", incarnation="i-d0", node_id="n1"),
        worker("decode-1", incarnation="i-d1", node_id="n2", draining=True),
    ):
        state.add_worker(w)
    state.pairs = {("prefill-0", "decode-1"), ("prefill-0", "decode-0")}
    state.router = RouterRecord(
        "h:router", ("tiny", True), "127.0.0.1:5000", None, {"grpc": 5000, "http": None}
    )
    for i in range(3):
        state.events.append(f"line {i}")
    return state


def saved(state: ClusterState) -> dict:
    """The snapshot as the store hands it back (JSON)."""
    return json.loads(json.dumps(state.snapshot()))


def test_snapshot_is_the_stored_document():
    state = running_state()
    assert state.snapshot() == {
        "manifest": tiny_manifest("tiny", decode=2),
        "generation": 3,
        "restarts": 1,
        "next_index": {"prefill": 1, "decode": 2},
        "workers": [
            {
                "worker_id": "prefill-0",
                "template": asdict(TEMPLATES["prefill"]),
                "incarnation": "i-p0",
                "draining": False,
                "node_id": "n1",
            },
            {
                "worker_id": "decode-0",
                "template": asdict(TEMPLATES["decode"]),
                "incarnation": "i-d0",
                "draining": False,
                "node_id": "n1",
            },
            {
                "worker_id": "decode-1",
                "template": asdict(TEMPLATES["decode"]),
                "incarnation": "i-d1",
                "draining": True,
                "node_id": "n2",
            },
        ],
        "pairs": [["prefill-0", "decode-0"], ["prefill-0", "decode-1"]],  # sorted
        "router": {
            "key": ["tiny", True],
            "address": "127.0.0.1:5000",
            "http_address": None,
            "ports": {"grpc": 5000, "http": None},
        },
        "events": ["line 0", "line 1", "line 2"],
        "num_events": 3,
    }


def test_restore_takes_over_what_still_runs_and_snapshots_the_same_again():
    before = running_state()
    after = ClusterState()
    gone = after.restore(
        saved(before),
        lambda worker_id: (f"h:{worker_id}", f"pg:{worker_id}"),
        lambda: "h:router",
    )
    assert gone == []
    assert saved(after) == saved(before)
    assert [w.worker_id for w in after.active("decode")] == ["decode-0"]
    assert [w.worker_id for w in after.draining()] == ["decode-1"]
    assert after.workers_by_id["decode-1"].template == TEMPLATES["decode"]
    assert after.workers_by_id["decode-1"].handle == "h:decode-1"
    assert after.router == before.router


def test_restore_drops_a_gone_worker_with_its_pairs_and_a_gone_router():
    state = ClusterState()
    gone = state.restore(
        saved(running_state()),
        lambda worker_id: None if worker_id == "decode-0" else ("h", "pg"),
        lambda: None,
    )
    assert gone == ["decode-0", "the router"]
    assert list(state.workers_by_id) == ["prefill-0", "decode-1"]
    assert state.pairs == {("prefill-0", "decode-1")}
    assert state.router is None
    assert (state.generation, state.restarts, state.next_index) == (
        3,
        1,
        {"prefill": 1, "decode": 2},
    )


def test_progress_lines_keep_their_numbers_across_a_restart():
    state = ClusterState()
    for i in range(EVENTS_KEPT + 5):
        state.events.append(f"line {i}")
    document = saved(state)
    assert document["num_events"] == EVENTS_KEPT + 5
    assert document["events"][0] == "line 5"  # the first 5 are not kept
    restored = ClusterState()
    restored.restore(document, lambda _: None, lambda: None)
    assert restored.events.count() == EVENTS_KEPT + 5
    assert restored.events.since(EVENTS_KEPT + 3) == ["line 203", "line 204"]
    assert restored.events.since(0)[0] == "line 5"  # what was dropped is gone
    restored.events.append("next")
    assert restored.events.since(EVENTS_KEPT + 5) == ["next"]


def test_event_log_numbers_lines_from_the_first_ever():
    log = EventLog(["c", "d"], total=4)  # "a" and "b" were dropped
    assert (log.count(), log.since(0), log.since(3), log.since(4)) == (4, ["c", "d"], ["d"], [])
    log.append("e")
    assert (log.count(), log.last(2), log.since(4)) == (5, ["d", "e"], ["e"])
    assert EventLog().count() == 0
