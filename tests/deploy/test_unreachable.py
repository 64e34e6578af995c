"""Every `baton deploy` command answers within seconds, in one line, with exit code 1
when the Ray cluster it would use cannot be reached: none at all, a stale ray_current_cluster
file naming a closed port, an --address nobody listens on. Each command is a process, as a
user runs it; none starts Ray, and Ray's temp dir is a tmp dir ($RAY_TMPDIR), never /tmp/ray."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from deploy.client import CONNECT_TIMEOUT_S
from deploy.ray_address import NoAddress, RayAddress, host_port, probe, ray_address_file, resolve
from tests.cluster.manifests import tiny_manifest

LIMIT_S = 15.0
WHAT_TO_DO = "start one with `ray start --head`, or pass --address"


def closed_port() -> int:
    """A local port nothing listens on (bound once to find it, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_tmp(tmp_path, monkeypatch) -> Path:
    """Ray's temp dir for this test (`$RAY_TMPDIR/ray`), and no $RAY_ADDRESS."""
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return tmp_path / "ray"


def deploy_commands(tmp_path: Path) -> list[list[str]]:
    manifest = tmp_path / "cluster.yaml"
    manifest.write_text(yaml.safe_dump(tiny_manifest("tiny")))
    return [
        ["status"],
        ["status", "--json"],
        ["apply", "-f", str(manifest)],
        ["scale", "decode=2"],
        ["down"],
    ]


def run_all(tmp_path: Path, extra: list[str], expected: str) -> None:
    """Each deploy command (with `extra` arguments) exits 1 within LIMIT_S, printing exactly
    `error: {expected}` and nothing else."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    for command in deploy_commands(tmp_path):
        start = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-m", "baton", "deploy", *command, *extra],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )
        elapsed = time.monotonic() - start
        assert (out.returncode, out.stdout, out.stderr) == (1, "", f"error: {expected}\n"), command
        assert elapsed < LIMIT_S, (command, elapsed)


def test_no_cluster_at_all(ray_tmp, tmp_path):
    path = ray_tmp / "ray_current_cluster"
    expected = (
        f"no Ray cluster to connect to: no --address, no $RAY_ADDRESS and no {path} "
        f"(which `ray start --head` writes); {WHAT_TO_DO}"
    )
    run_all(tmp_path, [], expected)
    run_all(tmp_path, ["--address", "auto"], expected)


def test_stale_cluster_file_naming_a_closed_port(ray_tmp, tmp_path):
    address = f"127.0.0.1:{closed_port()}"
    ray_tmp.mkdir()
    path = ray_tmp / "ray_current_cluster"
    path.write_text(address + "\n")  # what a killed `ray start --head` leaves behind
    expected = (
        f"cannot connect to a Ray cluster at '{address}' (from the ray_current_cluster file "
        f"{path}): Connection refused (the file is stale: that cluster is gone); {WHAT_TO_DO}"
    )
    run_all(tmp_path, [], expected)
    run_all(tmp_path, ["--address", "auto"], expected)


def test_address_nobody_listens_on(ray_tmp, tmp_path, monkeypatch):
    address = f"127.0.0.1:{closed_port()}"
    run_all(
        tmp_path,
        ["--address", address],
        f"cannot connect to a Ray cluster at '{address}' (from --address): Connection "
        f"refused; {WHAT_TO_DO}",
    )
    monkeypatch.setenv("RAY_ADDRESS", address)
    run_all(
        tmp_path,
        [],
        f"cannot connect to a Ray cluster at '{address}' (from $RAY_ADDRESS): Connection "
        f"refused; {WHAT_TO_DO}",
    )


def test_an_address_that_accepts_connections_but_is_no_ray_cluster(ray_tmp, tmp_path):
    # Ray itself would retry for minutes, printing its own warnings; the command gives up
    # after CONNECT_TIMEOUT_S with one line and keeps Ray's output off the terminal.
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        address = f"127.0.0.1:{listening.getsockname()[1]}"
        start = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-m", "baton", "deploy", "status", "--address", address],
            capture_output=True,
            text=True,
            env={**os.environ, "RAY_AUTH_MODE": "disabled"},
            timeout=60,
            check=False,
        )
        elapsed = time.monotonic() - start
    expected = (
        f"error: cannot connect to a Ray cluster at '{address}' (from --address): no Ray "
        f"cluster answered there within {CONNECT_TIMEOUT_S:g} s; {WHAT_TO_DO}\n"
    )
    assert (out.returncode, out.stdout, out.stderr) == (1, "", expected)
    assert CONNECT_TIMEOUT_S <= elapsed < CONNECT_TIMEOUT_S + 5.0


# ---- address resolution, in process ---------------------------------------------------------
def test_address_comes_from_the_flag_then_ray_address_then_the_cluster_file(ray_tmp, monkeypatch):
    with pytest.raises(NoAddress, match="no --address, no \\$RAY_ADDRESS and no "):
        resolve(None)
    ray_tmp.mkdir()
    ray_tmp.joinpath("ray_current_cluster").write_text("10.0.0.1:6379\n")
    assert ray_address_file() == ray_tmp / "ray_current_cluster"
    recorded = RayAddress("10.0.0.1:6379", str(ray_tmp / "ray_current_cluster"))
    assert resolve(None) == recorded
    assert resolve("auto") == recorded
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    assert resolve(None) == recorded
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")
    assert resolve(None) == RayAddress("10.0.0.2:6379", "$RAY_ADDRESS")
    assert resolve("auto") == RayAddress("10.0.0.2:6379", "$RAY_ADDRESS")
    assert resolve("10.0.0.3:6379") == RayAddress("10.0.0.3:6379", "--address")


def test_ray_temp_dir_follows_rays_own_rule(monkeypatch):
    monkeypatch.delenv("RAY_TMPDIR", raising=False)
    monkeypatch.delenv("TMPDIR", raising=False)
    assert ray_address_file() == Path("/tmp/ray/ray_current_cluster")
    monkeypatch.setenv("TMPDIR", "/scratch")
    assert ray_address_file() == Path("/scratch/ray/ray_current_cluster")
    monkeypatch.setenv("RAY_TMPDIR", "/ray-tmp")
    assert ray_address_file() == Path("/ray-tmp/ray/ray_current_cluster")


def test_host_port_and_probe():
    assert host_port("127.0.0.1:6379") == ("127.0.0.1", 6379)
    assert host_port("ray://head:10001") == ("head", 10001)
    assert host_port("[::1]:6379") == ("::1", 6379)
    for bad in ("not-an-address", "head:", ":6379", "head:http", "head:70000"):
        assert host_port(bad) is None, bad
    assert probe("not-an-address") == "not a HOST:PORT address"
    assert probe(f"127.0.0.1:{closed_port()}") == "Connection refused"
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        assert probe(f"127.0.0.1:{listening.getsockname()[1]}") is None
