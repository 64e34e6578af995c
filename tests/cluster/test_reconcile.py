"""The controller's decisions around a reconcile, without Ray: scale's manifest and its
errors, one Baton cluster per Ray cluster, what plan() is given, which leaving workers a drain
still waits for, what a restarted controller removes as never recorded, and when the router
must be restarted rather than reconfigured."""

from __future__ import annotations

import copy

import pytest

from cluster.drain import busy_workers
from cluster.plan import Current, Pool, Running
from cluster.reconcile import check_pools, check_same_cluster, current, desired, with_replicas
from cluster.recovery import orphan_actors, orphan_groups
from cluster.router_lifecycle import addresses
from cluster.state import ClusterState, NoCluster, RouterRecord
from cluster.templates import router_settings
from deploy.manifest import ManifestError, parse_manifest
from router.settings import RouterSettings, TLSPaths
from tests.cluster.manifests import tiny_manifest
from tests.cluster.workers import TEMPLATES, worker


# ---- scale and apply ---------------------------------------------------------------------
def test_scale_names_existing_pools():
    check_pools({"prefill": 0, "decode": 3})
    with pytest.raises(ValueError, match=r"unknown pool \['decoder'\]: choose prefill or decode"):
        check_pools({"decoder": 2})


def test_with_replicas_changes_a_copy():
    applied = tiny_manifest("tiny", prefill=1, decode=1)
    before = copy.deepcopy(applied)
    scaled = with_replicas(applied, {"decode": 3})
    assert applied == before  # recorded only once the cluster matches
    assert scaled["spec"]["decode"] == {"replicas": 3}
    assert scaled["spec"]["prefill"] == {"replicas": 1}
    assert {k: v for k, v in scaled["spec"].items() if k != "decode"} == {
        k: v for k, v in applied["spec"].items() if k != "decode"
    }
    with pytest.raises(NoCluster, match="no manifest applied yet"):
        with_replicas(None, {"decode": 3})


def test_a_ray_cluster_runs_one_baton_cluster():
    applied = tiny_manifest("tiny", name="alpha")
    check_same_cluster(None, parse_manifest(tiny_manifest("tiny", name="beta")))
    check_same_cluster(applied, parse_manifest(tiny_manifest("tiny", decode=4, name="alpha")))
    with pytest.raises(ManifestError, match="runs Baton cluster 'alpha'") as err:
        check_same_cluster(applied, parse_manifest(tiny_manifest("tiny", name="beta")))
    assert str(err.value).startswith("metadata.name: 'beta' is invalid")


def test_plan_sees_the_active_workers_pool_by_pool_and_the_manifest_pools():
    state = ClusterState()
    for w in (
        worker("decode-0"),
        worker("prefill-0"),
        worker("decode-1", draining=True),
        worker("decode-2"),
    ):
        state.add_worker(w)
    assert current(state) == Current(
        (
            Running("prefill-0", TEMPLATES["prefill"]),
            Running("decode-0", TEMPLATES["decode"]),
            Running("decode-2", TEMPLATES["decode"]),
        ),
        has_router=False,
    )
    state.router = RouterRecord("h")
    assert current(state).has_router
    m = parse_manifest(tiny_manifest("tiny", prefill=0, decode=2))
    assert desired(TEMPLATES, m) == {
        "prefill": Pool(TEMPLATES["prefill"], 0),
        "decode": Pool(TEMPLATES["decode"], 2),
    }


# ---- drain -------------------------------------------------------------------------------
def test_a_drain_waits_for_the_larger_count_and_not_for_dead_workers():
    routed = {"decode-0": 2, "prefill-0": 0, "decode-9": 5}  # decode-9 is not leaving
    in_flight = {"decode-0": 1, "prefill-0": 3, "decode-1": 0}  # decode-2 did not answer
    leaving = ["decode-0", "prefill-0", "decode-1", "decode-2"]
    assert busy_workers(leaving, routed, in_flight) == {"decode-0": 2, "prefill-0": 3}
    assert busy_workers(leaving, routed, {"decode-1": 0}) == {}


# ---- recovery ------------------------------------------------------------------------------
def test_a_restarted_controller_removes_only_unrecorded_baton_workers_and_groups():
    actors = [
        {"namespace": "baton", "name": "decode-0"},
        {"namespace": "baton", "name": "decode-1"},  # started, never recorded
        {"namespace": "baton", "name": "baton-router"},
        {"namespace": "baton", "name": "baton-controller"},
        {"namespace": "other", "name": "prefill-7"},
        {"namespace": "baton", "name": "prefill-2"},  # started, never recorded
    ]
    assert orphan_actors(actors, {"decode-0", "prefill-0"}) == ["decode-1", "prefill-2"]
    tables = [
        {"name": "baton-decode-0", "state": "CREATED"},
        {"name": "baton-decode-1", "state": "PENDING"},
        {"name": "baton-prefill-3", "state": "REMOVED"},
        {"name": "theirs", "state": "CREATED"},
        {"name": None, "state": "CREATED"},
    ]
    assert orphan_groups(tables, {"decode-0"}) == ["baton-decode-1"]


# ---- the router ----------------------------------------------------------------------------
def test_only_a_change_of_what_the_servers_run_with_restarts_the_router():
    spec = tiny_manifest("tiny")
    base = router_settings(parse_manifest(spec)).server_key()
    in_place = copy.deepcopy(spec)
    in_place["spec"]["router"].update(policy="round_robin", migration_limit=1)
    in_place["spec"]["prefill"]["replicas"] = 0  # aggregated: also set in place
    assert router_settings(parse_manifest(in_place)).server_key() == base
    moved = copy.deepcopy(spec)
    moved["spec"]["router"]["port"] = 5051
    assert router_settings(parse_manifest(moved)).server_key() != base
    assert base == ("tiny", True, "127.0.0.1", 0, 0, ["tiny"], None, None, None, None, None)


def test_router_addresses():
    options = RouterSettings(host="10.0.0.5")
    assert addresses(options, {"grpc": 5000, "http": 8000}) == (
        "10.0.0.5:5000",
        "http://10.0.0.5:8000",
    )
    assert addresses(options, {"grpc": 5000, "http": None}) == ("10.0.0.5:5000", None)
    tls = RouterSettings(host="10.0.0.5", tls=TLSPaths(cert_file="c", key_file="k"))
    assert addresses(tls, {"grpc": 5000, "http": 8443}) == (
        "10.0.0.5:5000",
        "https://10.0.0.5:8443",
    )
