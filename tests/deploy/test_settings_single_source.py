"""Each engine, transfer and router setting has one definition (engine/options.py,
kvtransfer/options.py, router/policy_names.py); the manifest, EngineConfig, the policy
registry and `baton serve` must agree with it (the generated docs/configuration.md is checked by
test_config_reference.py)."""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
from pathlib import Path
from typing import Literal, get_args, get_origin

import pytest

from cluster.local import SERVE_FLAGS, LocalOptions, add_serve_flags
from deploy.manifest import (
    ENGINE_OPTIONS_ELSEWHERE,
    MODEL_FIELDS,
    EngineSpec,
    ManifestError,
    ModelSpec,
    RouterSpec,
    TransferSpec,
    parse_manifest,
)
from engine.config import DTYPES, EngineConfig
from engine.errors import InvalidRequestError
from engine.options import DTYPE_NAMES, RULES, EngineOptions
from kvtransfer.backends import BACKENDS
from kvtransfer.options import BACKEND_NAMES, TransferOptions, TransferOptionsError
from router.policy import POLICIES, make_policy
from router.policy_names import DEFAULT_POLICY, POLICY_NAMES
from tests.deploy.test_manifest import with_change

ROOT = Path(__file__).resolve().parents[2]
ENGINE = {f.name: f for f in dataclasses.fields(EngineOptions)}
TRANSFER = {f.name: f for f in dataclasses.fields(TransferOptions)}


def spec_rules(info) -> dict:
    """The bounds of a pydantic field, as option() metadata names them."""
    out = {}
    for constraint in info.metadata:
        for name in ("ge", "gt", "le", "min_length"):
            if getattr(constraint, name, None) is not None:
                out[name] = getattr(constraint, name)
    if get_origin(info.annotation) is Literal:
        out["choices"] = get_args(info.annotation)
    return out


def option_rules(f: dataclasses.Field) -> dict:
    return {k: f.metadata[k] for k in RULES if k in f.metadata}


def assert_same(info, f: dataclasses.Field) -> None:
    """A manifest field carries the option's default, description, type and bounds."""
    assert (info.default, info.description) == (f.default, f.metadata["description"]), f.name
    assert spec_rules(info) == option_rules(f), f.name
    if "choices" not in f.metadata:
        assert info.annotation == f.type, f.name


def test_the_manifest_imports_no_torch():
    code = (
        "import sys, deploy.manifest, engine.options, kvtransfer.options, router.policy_names\n"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_every_engine_option_is_in_the_manifest_or_named_elsewhere():
    assert set(ENGINE_OPTIONS_ELSEWHERE) <= set(ENGINE)
    assert set(EngineSpec.model_fields) == set(ENGINE) - set(ENGINE_OPTIONS_ELSEWHERE)
    for name, info in EngineSpec.model_fields.items():
        assert_same(info, ENGINE[name])
    assert set(ModelSpec.model_fields) == set(MODEL_FIELDS)
    for spec_name, option_name in MODEL_FIELDS.items():
        assert option_name in ENGINE_OPTIONS_ELSEWHERE
        assert_same(ModelSpec.model_fields[spec_name], ENGINE[option_name])


def test_engine_config_is_the_engine_options():
    assert [f.name for f in dataclasses.fields(EngineConfig)] == list(ENGINE)
    assert dataclasses.asdict(EngineConfig()) == dataclasses.asdict(EngineOptions())
    assert EngineSpec().model_dump() == {
        k: v for k, v in dataclasses.asdict(EngineConfig()).items() if k in EngineSpec.model_fields
    }
    assert tuple(DTYPES) == DTYPE_NAMES
    assert EngineConfig().kv_cache_memory_gb == EngineSpec().kv_cache_memory_gb == 2.0


def test_transfer_spec_is_the_transfer_options():
    assert set(TransferSpec.model_fields) == set(TRANSFER)
    for name, info in TransferSpec.model_fields.items():
        assert_same(info, TRANSFER[name])
    assert TransferSpec().model_dump() == dataclasses.asdict(TransferOptions())
    assert BACKEND_NAMES == tuple(BACKENDS)


def test_router_policy_names_are_the_registry():
    assert tuple(POLICIES) == POLICY_NAMES
    policy = RouterSpec.model_fields["policy"]
    assert get_args(policy.annotation) == POLICY_NAMES
    assert policy.default == DEFAULT_POLICY == RouterSpec().policy
    for name in POLICY_NAMES:
        make_policy(name)


def _outside(rules: dict):
    """A value the rules of an option reject."""
    if "choices" in rules:
        return "not-a-choice"
    if "min_length" in rules:
        return ""
    if "le" in rules:
        return rules["le"] + 1
    return rules["ge"] - 1 if "ge" in rules else rules["gt"]


MANIFEST_PATH = {
    **{option: f"spec.model.{key}" for key, option in MODEL_FIELDS.items()},
    **{name: f"spec.engine.{name}" for name in EngineSpec.model_fields},
}


@pytest.mark.parametrize("name", [n for n, f in ENGINE.items() if option_rules(f)])
def test_engine_and_manifest_reject_the_same_values(name):
    value = _outside(option_rules(ENGINE[name]))
    with pytest.raises(InvalidRequestError, match=f"{name}="):
        EngineConfig(**{name: value})
    path = MANIFEST_PATH.get(name)
    if path is None:
        return  # not in the manifest (ENGINE_OPTIONS_ELSEWHERE)
    with pytest.raises(ManifestError, match=rf"{re.escape(path)}: {re.escape(repr(value))}"):
        parse_manifest(with_change(path, value))


@pytest.mark.parametrize("name", list(TRANSFER))
def test_transfer_options_and_manifest_reject_the_same_values(name):
    value = _outside(option_rules(TRANSFER[name]))
    with pytest.raises(TransferOptionsError, match=f"{name}="):
        TransferOptions(**{name: value})
    with pytest.raises(ManifestError, match=rf"spec.transfer.{name}: {re.escape(repr(value))}"):
        parse_manifest(with_change(f"spec.transfer.{name}", value))


def test_the_engine_cross_field_check_is_the_manifests():
    with pytest.raises(InvalidRequestError, match="chunk_size 4096 exceeds"):
        EngineConfig(chunk_size=4096, max_num_batched_tokens=1024)
    with pytest.raises(ManifestError, match="chunk_size 4096 exceeds"):
        parse_manifest(with_change("spec.prefill.engine", {"chunk_size": 4096}))


def test_serve_flags_come_from_the_manifest_fields():
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    actions = {a.dest: a for a in parser._actions}
    assert set(SERVE_FLAGS) <= {f.name for f in dataclasses.fields(LocalOptions)}
    assert actions["policy"].choices == POLICY_NAMES
    assert ENGINE["chunk_size"].metadata["description"] in actions["chunk_size"].help
    assert actions["kv_cache_memory_gb"].type is float
    args = parser.parse_args(["--threads", "2", "--policy", "random", "--chunk-size", "2048"])
    spec = LocalOptions.from_args(args).manifest().spec
    assert (spec.prefill.threads, spec.decode.threads, spec.router.policy) == (2, 2, "random")
    assert (spec.engine.chunk_size, spec.engine.max_num_batched_tokens) == (2048, 2048)
    with pytest.raises(SystemExit):
        parser.parse_args(["--policy", "fastest"])
