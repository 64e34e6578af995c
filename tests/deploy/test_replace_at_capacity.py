"""Changed engine options on a Ray cluster with no room to start new workers beside the old
ones (2 CPUs, a 1 + 1 cluster of {CPU: 1} workers): workers are replaced one at a time when
the KV format stays, all at once when it changes; requests wait at the router for the new
workers and none fails."""

from __future__ import annotations

import pytest
import yaml

from baton.cli import main as baton
from cluster.controller import NAMESPACE
from cluster.local_ray import start_local_ray
from deploy.client import baton_actors
from engine import LLM, SamplingParams
from tests.cluster.manifests import tiny_manifest
from tests.deploy.streams import MAX_TOKENS, RequestStream, stream_prompt

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def full_cluster():
    start_local_ray(num_cpus=2, namespace=NAMESPACE)
    yield
    ray.shutdown()


def apply(tmp_path, manifest: dict, capsys) -> str:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(manifest))
    assert baton(["deploy", "apply", "-f", str(path)]) == 0
    return capsys.readouterr().out


def test_replace_without_spare_resources_fails_no_request(
    full_cluster, tiny_llama, tmp_path, capsys
):
    apply(tmp_path, tiny_manifest(tiny_llama, name="full"), capsys)
    assert ray.available_resources().get("CPU", 0) == 0  # no room for a second pair
    from cluster.controller import controller_handle

    controller = controller_handle()
    address = ray.get(controller.status.remote())["router"]["address"]
    with RequestStream(address, threads=2) as stream:
        stream.wait_for(3)
        out = apply(tmp_path, tiny_manifest(tiny_llama, name="full", max_num_seqs=32), capsys)
        assert "replacing one worker at a time" in out
        assert (
            "generation 2: replace 1 prefill worker(s) (options changed); replace 1 "
            "decode worker(s) (options changed)" in out
        )
        # the prefill worker leaves before its successor starts, then the decode worker
        assert (
            out.index("removed prefill-0")
            < out.index("starting prefill-1")
            < out.index("removed decode-0")
            < out.index("starting decode-1")
        )
        stream.wait_for(len(stream.results) + 3)
        out = apply(
            tmp_path,
            tiny_manifest(tiny_llama, name="full", max_num_seqs=32, hash_seed="other"),
            capsys,
        )
        assert "the KV format changes: replacing every worker at once" in out
        status = ray.get(controller.status.remote())
        assert sorted(w["worker_id"] for w in status["workers"]) == ["decode-2", "prefill-2"]
        stream.wait_for(len(stream.results) + 3)
    assert stream.errors == []
    expected = LLM(
        tiny_llama, block_size=4, chunk_size=16, num_kv_blocks=256, skip_tokenizer_init=True
    ).generate(
        [stream_prompt(k) for k, *_ in stream.results],
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
    )
    for (_, tokens, finish, _, _), exp in zip(stream.results, expected, strict=True):
        assert (tokens, finish) == (exp.token_ids, "length")
    served_by = {p for *_, p, _ in stream.results}
    assert {"prefill-0", "prefill-1", "prefill-2"} <= served_by
    assert baton(["deploy", "down"]) == 0
    assert baton_actors(NAMESPACE) == []
