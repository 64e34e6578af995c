"""A manifest's KV tier settings as each worker gets them: kv_tier_path is the pools' parent
directory and each worker keeps its blocks in <kv_tier_path>/<worker id>; `baton serve` sets
the tier with --kv-tier, --kv-tier-path and --kv-tier-bytes."""

from __future__ import annotations

import argparse
import os

import pytest

from cluster.local import LocalOptions, add_serve_flags
from cluster.templates import worker_engine_options, worker_templates
from deploy.manifest import ManifestError, parse_manifest
from tests.cluster.manifests import tiny_manifest


def test_each_worker_gets_its_own_directory_under_the_manifests_path(tmp_path):
    parent = str(tmp_path / "tiers")
    manifest = parse_manifest(
        tiny_manifest("m", kv_tier="disk", kv_tier_path=parent, kv_tier_bytes=1 << 20)
    )
    templates = worker_templates(manifest)
    # The template (what the controller compares to decide a replacement) keeps the parent.
    assert templates["prefill"].engine["kv_tier_path"] == parent
    p0 = worker_engine_options(templates["prefill"].engine, "prefill-0")
    d3 = worker_engine_options(templates["decode"].engine, "decode-3")
    assert p0["kv_tier_path"] == os.path.join(parent, "prefill-0")
    assert d3["kv_tier_path"] == os.path.join(parent, "decode-3")
    assert {k: v for k, v in p0.items() if k != "kv_tier_path"} == {
        k: v for k, v in templates["prefill"].engine.items() if k != "kv_tier_path"
    }
    # The same worker id (a worker Ray restarts) gets the same directory again.
    assert worker_engine_options(templates["prefill"].engine, "prefill-0") == p0
    assert templates["prefill"].engine["kv_tier_path"] == parent  # not changed in place


def test_a_worker_without_a_tier_path_gets_its_templates_options():
    engine = worker_templates(parse_manifest(tiny_manifest("m")))["decode"].engine
    assert "kv_tier_path" not in engine
    assert worker_engine_options(engine, "decode-0") == engine


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    return parser


def test_serve_flags_set_the_kv_tier_of_both_pools(tmp_path):
    args = serve_parser().parse_args(
        ["--kv-tier", "disk", "--kv-tier-path", str(tmp_path), "--kv-tier-bytes", "1048576"]
    )
    spec = LocalOptions.from_args(args).manifest().spec
    for role in ("prefill", "decode"):
        engine = spec.engine_for(role)
        assert (engine.kv_tier, engine.kv_tier_path, engine.kv_tier_bytes) == (
            "disk",
            str(tmp_path),
            1 << 20,
        )


def test_serve_flags_of_the_kv_tier_are_checked_like_the_manifest():
    parser = serve_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-tier", "ssd"])  # not one of none, host, disk
    args = parser.parse_args(["--kv-tier", "disk"])
    with pytest.raises(ManifestError, match="kv_tier_path is required when kv_tier is disk"):
        LocalOptions.from_args(args).manifest()
    kv_tier = next(a for a in parser._actions if a.dest == "kv_tier")
    assert kv_tier.choices == ("none", "host", "disk")
    path = next(a for a in parser._actions if a.dest == "kv_tier_path")
    assert "each worker uses <kv_tier_path>/<worker id>" in path.help


@pytest.mark.ray
def test_on_ray_each_worker_opens_its_directory_and_writes_it_when_removed(tiny_llama, tmp_path):
    pytest.importorskip("ray")
    import grpc
    import ray

    from cluster.local import LocalCluster
    from cluster.ray_helpers import NAMESPACE
    from router.proto import inference_pb2 as pb
    from router.proto import inference_pb2_grpc as pb_grpc
    from tests.helpers import random_prompts

    parent = tmp_path / "tiers"
    extra = {"skip_tokenizer_init": True, "num_kv_blocks": 256}
    options = LocalOptions(
        model=tiny_llama,
        port=0,
        http_port=0,
        block_size=4,
        chunk_size=16,
        kv_tier="disk",
        kv_tier_path=str(parent),
        kv_tier_bytes=1 << 20,
        engine_extra=extra,
    )
    cluster = LocalCluster(options)
    try:
        cluster.start(log=lambda _m: None)
        stub = pb_grpc.InferenceStub(grpc.insecure_channel(cluster.address))
        prompt = random_prompts([30], seed=411)[0]  # 7 full blocks of 4
        sampling = pb.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), sampling=sampling)
        assert [t for r in stub.Generate(request, timeout=60) for t in r.token_ids]
        for worker_id in ("prefill-0", "decode-0"):
            assert (parent / worker_id / ".lock").is_file()  # opened, locked by the worker
            stats = ray.get(ray.get_actor(worker_id, namespace=NAMESPACE).stats.remote())
            assert (stats.tier_medium, stats.tier_capacity_bytes) == ("disk", 1 << 20)
    finally:
        cluster.close()  # removes the workers: each writes its KV cache's blocks first
    for worker_id in ("prefill-0", "decode-0"):
        blocks = list((parent / worker_id).glob("*.kvb"))
        assert len(blocks) >= 7, worker_id  # the prompt's full blocks, at least
