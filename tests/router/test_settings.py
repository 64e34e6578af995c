"""RouterSettings (router/settings.py): built from a manifest in one place
(cluster/templates.py), defaults equal to the manifest's, a server key that survives the
controller's saved state (JSON), and every field either restarts the front doors or changes
in place."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cluster.templates import router_settings
from deploy.manifest import EngineSpec, RouterSpec, parse_manifest
from router.settings import SERVER_FIELDS, RouterSettings, TLSPaths

# RouterSettings field -> the RouterSpec field it comes from (same default)
FROM_ROUTER_SPEC = {
    "host": "host",
    "port": "port",
    "http_port": "http_port",
    "api_key_env": "api_key_env",
    "api_key_file": "api_key_file",
    "max_pending_requests": "max_pending_requests",
    "policy": "policy",
    "local_prefill_tokens": "local_prefill_tokens",
    "wait_for_workers_s": "wait_for_workers_seconds",
    "migration_limit": "migration_limit",
}
CONFIGURED_IN_PLACE = {
    "policy",
    "local_prefill_tokens",
    "aggregated",
    "wait_for_workers_s",
    "migration_limit",
}
POOLS = {"block_size", "hash_seed", "health_period_s"}


def manifest(**router) -> dict:
    return {
        "apiVersion": "baton/v1",
        "kind": "Cluster",
        "metadata": {"name": "t"},
        "spec": {
            "model": {"path": "tiny", "skip_tokenizer_init": True},
            "engine": {"block_size": 8, "hash_seed": "seed-1"},
            "prefill": {"replicas": 0},
            "router": router,
        },
    }


def test_defaults_are_the_manifests():
    spec, engine, settings = RouterSpec(), EngineSpec(), RouterSettings()
    for ours, theirs in FROM_ROUTER_SPEC.items():
        assert getattr(settings, ours) == getattr(spec, theirs), ours
    assert (settings.block_size, settings.hash_seed) == (engine.block_size, engine.hash_seed)


def test_every_field_restarts_the_doors_or_changes_in_place():
    names = [f.name for f in dataclasses.fields(RouterSettings)]
    assert set(SERVER_FIELDS) | CONFIGURED_IN_PLACE | POOLS == set(names)
    assert not set(SERVER_FIELDS) & (CONFIGURED_IN_PLACE | POOLS)
    assert RouterSettings.__dataclass_params__.frozen and not hasattr(RouterSettings(), "__dict__")


def test_built_from_a_manifest():
    tls = {"cert_file": "/etc/c.pem", "key_file": "/etc/k.pem"}
    m = parse_manifest(
        manifest(
            policy="round_robin",
            port=0,
            http_port=None,
            served_model_name="served",
            model_aliases=["alias"],
            local_prefill_tokens=64,
            wait_for_workers_seconds=5.0,
            migration_limit=1,
            tls=tls,
            max_pending_requests=7,
        )
    )
    assert router_settings(m) == RouterSettings(
        model="tiny",
        skip_tokenizer=True,
        host="127.0.0.1",
        port=0,
        http_port=None,
        served_model_names=("served", "alias"),
        tls=TLSPaths("/etc/c.pem", "/etc/k.pem"),
        max_pending_requests=7,
        policy="round_robin",
        local_prefill_tokens=64,
        aggregated=True,
        wait_for_workers_s=5.0,
        migration_limit=1,
        block_size=8,
        hash_seed="seed-1",
    )
    assert router_settings(parse_manifest(manifest())).served_model_names == ("tiny",)


def test_server_key_survives_the_saved_state_and_ignores_in_place_fields():
    settings = router_settings(
        parse_manifest(manifest(tls={"cert_file": "c", "key_file": "k"}, model_aliases=["a"]))
    )
    key = settings.server_key()
    assert tuple(json.loads(json.dumps(list(key)))) == key  # as the controller restores it
    changed = dataclasses.replace(settings, policy="random", migration_limit=0, aggregated=False)
    assert changed.server_key() == key
    assert dataclasses.replace(settings, port=1).server_key() != key


def test_settings_are_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        RouterSettings().port = 1  # type: ignore[misc]
