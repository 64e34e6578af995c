"""Bounded runs of two load clients users point at an OpenAI-compatible server, guidellm and
aiperf, against Baton's HTTP door: each sends a few streamed requests and its result file is
read back (requests, errors, output tokens per request).

    python -m benchmarks.load_clients                       # a tiny random checkpoint, 1+1
    python -m benchmarks.load_clients --prefill 0           # aggregated
    python -m benchmarks.load_clients --url http://127.0.0.1:8000 --model NAME --tokenizer DIR
    python -m benchmarks.load_clients --aiperf "python -m aiperf"   # aiperf not on PATH

guidellm streams with `stream_options: {include_usage, continuous_usage_stats}`; aiperf counts
tokens with the server's usage (`--use-server-token-count`: a random model's text does not
re-tokenize to the ids it came from). aiperf takes a local tokenizer directory for a hub id
while HF_HUB_OFFLINE=1 is set, so it runs with that variable unset.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class LoadRun:
    """What a bounded run reported: request counts and each completed request's tokens."""

    client: str
    completed: int
    errored: int
    incomplete: int
    output_tokens: tuple[int, ...]  # per completed request, as the client counted them
    seconds: float


@dataclass(frozen=True, slots=True)
class Load:
    """A bounded load: `requests` streamed requests, `concurrency` at a time."""

    requests: int = 8
    concurrency: int = 2
    prompt_tokens: int = 32
    output_tokens: int = 16


def guidellm_command(url: str, model: str, tokenizer: str, out: Path, load: Load) -> list[str]:
    """`guidellm run` of `load` on /v1/chat/completions (streamed; ignore_eos so every
    request has exactly load.output_tokens), its JSON result written to `out`."""
    backend = {"kind": "openai_http", "target": url, "model": model}
    return [
        sys.executable,
        "-m",
        "guidellm",
        "run",
        "--backend",
        json.dumps(backend),
        "--profile",
        json.dumps({"kind": "concurrent", "streams": [load.concurrency]}),
        "--constraint",
        json.dumps({"kind": "max_requests", "count": load.requests}),
        "--tokenizer",
        json.dumps({"kind": "huggingface_auto", "model": tokenizer}),
        "--data",
        json.dumps(
            {
                "kind": "synthetic_text",
                "prompt_tokens": load.prompt_tokens,
                "output_tokens": load.output_tokens,
            }
        ),
        "--output",
        json.dumps({"kind": "json", "path": str(out)}),
        "--disable-console",
    ]


def read_guidellm(path: Path, seconds: float = 0.0) -> LoadRun:
    """The counts of guidellm's JSON result (its one benchmark)."""
    [bench] = json.loads(path.read_text())["benchmarks"]
    requests = bench["requests"]
    return LoadRun(
        "guidellm",
        completed=len(requests["successful"]),
        errored=len(requests["errored"]),
        incomplete=len(requests["incomplete"]),
        output_tokens=tuple(r["output_tokens"] for r in requests["successful"]),
        seconds=seconds,
    )


def guidellm_bodies(path: Path) -> list[dict]:
    """The request bodies guidellm sent (as its JSON result records them)."""
    [bench] = json.loads(path.read_text())["benchmarks"]
    return [json.loads(r["request_args"])["body"] for r in bench["requests"]["successful"]]


def aiperf_command(
    aiperf: list[str], url: str, model: str, tokenizer: str, out: Path, load: Load
) -> list[str]:
    """`aiperf profile` of `load` on /v1/chat/completions (streamed, ignore_eos), its
    artifacts written under `out`."""
    return [
        *aiperf,
        "profile",
        "--model",
        model,
        "--url",
        url,
        "--endpoint-type",
        "chat",
        "--streaming",
        "--tokenizer",
        tokenizer,
        "--concurrency",
        str(load.concurrency),
        "--request-count",
        str(load.requests),
        "--prompt-input-tokens-mean",
        str(load.prompt_tokens),
        "--prompt-input-tokens-stddev",
        "0",
        "--prompt-output-tokens-mean",
        str(load.output_tokens),
        "--prompt-output-tokens-stddev",
        "0",
        "--extra-inputs",
        "ignore_eos:true",
        "--use-server-token-count",
        "--output-artifact-dir",
        str(out),
        "--ui-type",
        "none",
    ]


def read_aiperf(out: Path, seconds: float = 0.0) -> LoadRun:
    """The counts of aiperf's per-request records (profile_export.jsonl)."""
    records = [json.loads(line) for line in (out / "profile_export.jsonl").read_text().splitlines()]
    done = [r for r in records if not r.get("error")]
    return LoadRun(
        "aiperf",
        completed=len(done),
        errored=len(records) - len(done),
        incomplete=sum(bool(r["metadata"].get("was_cancelled")) for r in records),
        output_tokens=tuple(int(r["metrics"]["output_sequence_length"]["value"]) for r in done),
        seconds=seconds,
    )


def run_client(command: list[str], env: dict[str, str], timeout: float = 600) -> float:
    """Run one client to the end; its wall time (a failure raises with its output)."""
    start = time.monotonic()
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"{shlex.join(command[:4])} ... exited {done.returncode}:\n{done.stdout[-3000:]}\n"
            f"{done.stderr[-3000:]}"
        )
    return time.monotonic() - start


def offline_env(offline: bool) -> dict[str, str]:
    """This process's environment with the Hugging Face offline switches on or off."""
    env = dict(os.environ)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if offline:
            env[name] = "1"
        else:
            env.pop(name, None)
    return env


def run_both(
    url: str, model: str, tokenizer: str, work: Path, load: Load, aiperf: list[str]
) -> list[LoadRun]:
    """guidellm then aiperf, one after the other (a client shares the CPUs with the server)."""
    out = work / "guidellm.json"
    seconds = run_client(guidellm_command(url, model, tokenizer, out, load), offline_env(True))
    runs = [read_guidellm(out, seconds)]
    artifacts = work / "aiperf"
    command = aiperf_command(aiperf, url, model, tokenizer, artifacts, load)
    seconds = run_client(command, offline_env(False))
    runs.append(read_aiperf(artifacts, seconds))
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server (default: start a local cluster)")
    parser.add_argument("--model", help="served name (with --url) or checkpoint to serve")
    parser.add_argument("--tokenizer", help="tokenizer directory (default: the checkpoint)")
    parser.add_argument("--prefill", type=int, default=1, help="prefill workers (0: aggregated)")
    parser.add_argument("--aiperf", default="aiperf", help="the aiperf command")
    parser.add_argument("--requests", type=int, default=Load().requests)
    parser.add_argument("--concurrency", type=int, default=Load().concurrency)
    parser.add_argument("--output-tokens", type=int, default=Load().output_tokens)
    args = parser.parse_args(argv)
    load = Load(args.requests, args.concurrency, output_tokens=args.output_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cluster = None
        if args.url:
            url, model, tokenizer = args.url, args.model, args.tokenizer
        else:
            cluster, model, tokenizer = _start_cluster(work, args.model, args.prefill)
            url = cluster.http_address
        try:
            runs = run_both(url, model, tokenizer or model, work, load, shlex.split(args.aiperf))
        finally:
            if cluster is not None:
                cluster.close()
    head = ("client", "completed", "errored", "incomplete", "tokens", "s")
    print("{:10} {:>9} {:>7} {:>10} {:>7} {:>6}".format(*head))
    for r in runs:
        print(
            f"{r.client:10} {r.completed:9d} {r.errored:7d} {r.incomplete:10d} "
            f"{sum(r.output_tokens):7d} {r.seconds:6.1f}"
        )
    expected = load.requests * load.output_tokens
    ok = all(
        r.completed == load.requests and not r.errored and sum(r.output_tokens) == expected
        for r in runs
    )
    return 0 if ok else 1


def _start_cluster(work: Path, model: str | None, prefill: int):
    """A local cluster from a manifest, serving `model` (default: a tiny random checkpoint)
    under the name "tiny"; returns (cluster, served name, tokenizer directory)."""
    from benchmarks.checkpoints import make_checkpoint
    from cluster.local import LocalCluster
    from deploy.manifest import parse_manifest

    path = model or str(make_checkpoint(work, "llama", tokenizer=True))
    manifest = {
        "apiVersion": "baton/v1",
        "kind": "Cluster",
        "metadata": {"name": "load-clients"},
        "spec": {
            "model": {"path": path},
            "engine": {"block_size": 16, "num_kv_blocks": 1024, "chunk_size": 512},
            "prefill": {"replicas": prefill},
            "decode": {"replicas": 1},
            "router": {"port": 0, "http_port": 0, "served_model_name": "tiny"},
        },
    }
    cluster = LocalCluster(parse_manifest(manifest)).start(log=lambda _m: None)
    return cluster, "tiny", path


if __name__ == "__main__":
    sys.exit(main())
