"""Manifest validation: the examples parse; each bad manifest gets its specific error naming
the field path, the bad value and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cluster.local import LocalOptions
from deploy.manifest import ManifestError, check_resources, load_manifest, parse_manifest

EXAMPLES = Path(__file__).resolve().parents[2] / "deploy" / "examples"
BASE = yaml.safe_load((EXAMPLES / "local.yaml").read_text())


def with_change(path: str, value) -> dict:
    """BASE with the value at a dotted path replaced (or a new key added)."""
    data = yaml.safe_load(yaml.safe_dump(BASE))
    *parents, leaf = path.split(".")
    node = data
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return data


@pytest.mark.parametrize("name", ["local", "cpu-multi", "gpu"])
def test_examples_are_valid(name):
    manifest = load_manifest(EXAMPLES / f"{name}.yaml")
    assert manifest.metadata.name == name


def test_local_example_is_the_serve_default():
    assert LocalOptions(resources={"CPU": 1}).manifest() == load_manifest(EXAMPLES / "local.yaml")
    flagged = (
        LocalOptions(resources={"CPU": 1}, decode=3, chunk_size=4096, kv_cache_memory_gb=0.5)
        .manifest()
        .spec
    )
    assert (
        flagged.decode.replicas,
        flagged.engine.chunk_size,
        flagged.engine.max_num_batched_tokens,
        flagged.engine.num_kv_blocks,
        flagged.engine.kv_cache_memory_gb,
    ) == (3, 4096, 4096, None, 0.5)


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        (
            "spec.decode.replicas",
            0,
            r"spec.decode.replicas: 0 is invalid: .*greater than or equal to 1",
        ),
        ("spec.prefill.replicas", -1, r"spec.prefill.replicas: -1 is invalid: .*equal to 0"),
        ("spec.decode.replicas", -2, r"spec.decode.replicas: -2 is invalid"),
        ("spec.prefill.replicas", "two", r"spec.prefill.replicas: 'two' is invalid: .*integer"),
        ("spec.engine.block_size", "big", r"spec.engine.block_size: 'big' is invalid"),
        ("spec.engine.blocksize", 16, r"spec.engine.blocksize: unknown field"),
        ("spec.prefill.replicas", True, r"spec.prefill.replicas: True is invalid: .*integer"),
        ("spec.engine.block_size", "16", r"spec.engine.block_size: '16' is invalid: .*integer"),
        ("spec.router.wait_for_workers_seconds", -1, r"wait_for_workers_seconds: -1 is invalid"),
        ("spec.extra", {}, r"spec.extra: unknown field"),
        (
            "spec.router.policy",
            "fastest",
            r"spec.router.policy: 'fastest' is invalid: .*cache_aware",
        ),
        ("spec.router.port", 70000, r"spec.router.port: 70000 is invalid"),
        ("spec.transfer.backend", "nixl", r"spec.transfer.backend: 'nixl' is invalid: .*gloo"),
        ("spec.model.dtype", "int4", r"spec.model.dtype: 'int4' is invalid"),
        ("spec.decode.resources", {"CPU": 0}, r"amount > 0"),
        (
            "spec.decode.engine",
            {"block_size": 32},
            r"same block_size .*prefill has 16, decode has 32",
        ),
        ("spec.prefill.engine", {"hash_seed": "x"}, r"same hash_seed"),
        ("spec.engine.chunk_size", 4096, r"chunk_size 4096 exceeds max_num_batched_tokens 1024"),
        ("apiVersion", "baton/v2", r"apiVersion: 'baton/v2' is invalid: .*baton/v1"),
        ("kind", "Deployment", r"kind: 'Deployment' is invalid"),
        ("metadata.name", "Bad_Name", r"metadata.name: 'Bad_Name' is invalid"),
    ],
)
def test_bad_manifests_name_field_value_and_rule(path, value, expected):
    with pytest.raises(ManifestError, match=expected):
        parse_manifest(with_change(path, value))


def test_missing_and_malformed_documents():
    with pytest.raises(ManifestError, match="metadata: missing is invalid"):
        parse_manifest({"apiVersion": "baton/v1", "kind": "Cluster"})
    with pytest.raises(ManifestError, match="not valid YAML"):
        parse_manifest("spec: [unclosed")
    with pytest.raises(ManifestError, match="a manifest is a mapping"):
        parse_manifest("- a\n- b\n")
    with pytest.raises(ManifestError, match="no such manifest file"):
        load_manifest("/nonexistent/baton.yaml")


def test_impossible_resources():
    gpu = load_manifest(EXAMPLES / "gpu.yaml")
    with pytest.raises(
        ManifestError,
        match=r"spec.prefill.resources.GPU: 1 per worker, but "
        r"the Ray cluster has 0 in total",
    ):
        check_resources(gpu, {"CPU": 16})
    with pytest.raises(ManifestError, match="4 GPU needed for all replicas, the Ray cluster has 2"):
        check_resources(gpu, {"CPU": 16, "GPU": 2})
    check_resources(gpu, {"CPU": 16, "GPU": 4})  # fits


def test_zero_prefill_workers_is_aggregated_and_needs_no_prefill_resources():
    aggregated = with_change("spec.prefill", {"replicas": 0, "resources": {"GPU": 1}})
    manifest = parse_manifest(aggregated)
    assert (manifest.spec.prefill.replicas, manifest.spec.decode.replicas) == (0, 1)
    check_resources(manifest, {"CPU": 1.0}, [{"CPU": 1.0}])  # no GPU: none is placed
    assert LocalOptions(resources={"CPU": 1}, prefill=0).manifest().spec.prefill.replicas == 0


def test_a_worker_bundle_must_fit_on_one_node():
    cpu = parse_manifest(with_change("spec.decode.resources", {"CPU": 12}))
    nodes = [{"CPU": 8.0}, {"CPU": 8.0}, {"CPU": 8.0}]
    check_resources(cpu, {"CPU": 24.0})  # the totals alone allow it
    with pytest.raises(
        ManifestError,
        match=r"spec.decode.resources.CPU: 12 per worker, but "
        r"no node has more than 8",
    ):
        check_resources(cpu, {"CPU": 24.0}, nodes)
    mixed = parse_manifest(with_change("spec.decode.resources", {"CPU": 4, "GPU": 1}))
    split = [{"CPU": 8.0}, {"CPU": 1.0, "GPU": 1.0}]
    with pytest.raises(ManifestError, match=r"spec.decode.resources: no node has all of "):
        check_resources(mixed, {"CPU": 9.0, "GPU": 1.0}, split)
    check_resources(mixed, {"CPU": 9.0, "GPU": 1.0}, [{"CPU": 4.0}, {"CPU": 5.0, "GPU": 1.0}])


def test_every_field_has_a_description():
    from pydantic import BaseModel

    from deploy.manifest import Manifest

    missing, seen = [], set()

    def walk(cls: type[BaseModel], prefix: str) -> None:
        for name, field in cls.model_fields.items():
            if not field.description:
                missing.append(prefix + name)
            for t in (field.annotation, *getattr(field.annotation, "__args__", ())):
                if isinstance(t, type) and issubclass(t, BaseModel) and t not in seen:
                    seen.add(t)
                    walk(t, f"{prefix}{name}.")

    walk(Manifest, "")
    # metadata, spec, model, engine, prefill pool, decode pool, router, router TLS, transfer
    assert missing == [] and len(seen) == 9


def test_int8_activations_is_a_manifest_engine_option():
    assert parse_manifest(
        with_change("spec.engine.int8_activations", True)
    ).spec.engine.int8_activations
    bad = with_change("spec.engine", {"int8_activations": True, "use_gguf_blocks": False})
    with pytest.raises(ManifestError, match="int8_activations needs CPU float32"):
        parse_manifest(bad)
