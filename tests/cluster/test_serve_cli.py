"""`baton serve -f MANIFEST` as a user runs it: a process that serves gRPC until SIGTERM, then
removes everything and exits 0."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import grpc
import pytest
import yaml

from engine import LLM, SamplingParams
from router.proto import inference_pb2 as pb
from router.proto import inference_pb2_grpc as pb_grpc
from tests.cluster.manifests import tiny_manifest
from tests.helpers import random_prompts

pytestmark = pytest.mark.ray

pytest.importorskip("ray")


def test_serve_from_manifest_answers_and_stops_cleanly(tiny_llama, tmp_path):
    path = tmp_path / "local.yaml"
    path.write_text(yaml.safe_dump(tiny_manifest(tiny_llama, name="serve-test")))
    proc = subprocess.Popen(
        [sys.executable, "-m", "baton", "serve", "-f", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )
    lines = []
    try:
        deadline = time.monotonic() + 300
        address = None
        while address is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "".join(lines)  # the server exited early
            lines.append(line)
            if m := re.search(r"Baton is serving .* on (\S+:\d+)", line):
                address = m.group(1)
        prompt = random_prompts([21], seed=77)[0]
        expected = LLM(
            tiny_llama, block_size=4, chunk_size=16, num_kv_blocks=256, skip_tokenizer_init=True
        ).generate([prompt], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
        stub = pb_grpc.InferenceStub(grpc.insecure_channel(address))
        replies = list(
            stub.Generate(
                pb.GenerateRequest(
                    prompt_token_ids=pb.TokenIds(ids=prompt),
                    sampling=pb.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
                ),
                timeout=60,
            )
        )
        assert [t for r in replies for t in r.token_ids] == expected.token_ids
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, "".join(lines) + out
    assert "stopped: server, workers, controller and placement groups removed" in out
