"""cluster.pairing and cluster.placement without Ray: which prefill/decode workers get a group
(same KV key, not yet paired), a worker's pairs, new worker ids and their actor resources."""

from __future__ import annotations

import dataclasses

from cluster.pairing import missing_pairs, pairs_of
from cluster.placement import actor_resources, next_worker_id
from cluster.state import ClusterState
from tests.cluster.workers import TEMPLATES, worker


def ids(pairs) -> list[tuple[str, str]]:
    return [(p.worker_id, d.worker_id) for p, d in pairs]


def test_every_prefill_worker_pairs_with_every_decode_worker_not_paired_yet():
    prefill = [worker("prefill-0"), worker("prefill-1")]
    decode = [worker("decode-0"), worker("decode-1")]
    assert ids(missing_pairs(prefill, decode, set())) == [
        ("prefill-0", "decode-0"),
        ("prefill-0", "decode-1"),
        ("prefill-1", "decode-0"),
        ("prefill-1", "decode-1"),
    ]
    have = {("prefill-0", "decode-1"), ("prefill-1", "decode-0")}
    assert ids(missing_pairs(prefill, decode, have)) == [
        ("prefill-0", "decode-0"),
        ("prefill-1", "decode-1"),
    ]
    assert missing_pairs([], decode, set()) == []  # aggregated: nothing to pair


def test_workers_of_different_kv_keys_are_never_paired():
    d = TEMPLATES["decode"]
    other_seed = dataclasses.replace(d, engine={**d.engine, "hash_seed": "other"})
    more_seqs = dataclasses.replace(d, engine={**d.engine, "max_num_seqs": 7})
    decode = [worker("decode-0", other_seed), worker("decode-1", more_seqs)]
    # Another hash seed cannot read the prefill worker's blocks; another batch size can.
    assert ids(missing_pairs([worker("prefill-0")], decode, set())) == [("prefill-0", "decode-1")]


def test_pairs_of_a_worker():
    pairs = [("prefill-0", "decode-0"), ("prefill-1", "decode-0"), ("prefill-1", "decode-1")]
    assert pairs_of("decode-0", pairs) == [("prefill-0", "decode-0"), ("prefill-1", "decode-0")]
    assert pairs_of("prefill-1", pairs) == [("prefill-1", "decode-0"), ("prefill-1", "decode-1")]
    assert pairs_of("decode-9", pairs) == []


def test_worker_ids_count_on_per_role_and_are_never_reused():
    state = ClusterState()
    state.next_index["decode"] = 4  # decode-0..3 existed (a restarted controller keeps this)
    assert [next_worker_id(state, "decode") for _ in range(2)] == ["decode-4", "decode-5"]
    assert next_worker_id(state, "prefill") == "prefill-0"
    assert state.next_index == {"prefill": 1, "decode": 6}


def test_actor_resources_split_cpus_gpus_and_custom_resources():
    assert actor_resources({"CPU": 2.0}) == {"num_cpus": 2.0, "num_gpus": 0, "resources": None}
    assert actor_resources({"GPU": 1.0, "CPU": 4.0, "accelerator_type:H100": 0.5}) == {
        "num_cpus": 4.0,
        "num_gpus": 1.0,
        "resources": {"accelerator_type:H100": 0.5},
    }
