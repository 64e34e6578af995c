"""Build llama.cpp's own `llama-bench`, `llama-batched-bench` and `llama-server` once.

The source is the `vendor/llama.cpp` tree of the `llama-cpp-python` sdist (a pinned
version), so the baseline is reproducible; the binaries are cached under
~/.cache/baton/llamacpp/<version>/ (override with $BATON_LLAMACPP_DIR). This is a
benchmark-only tool: nothing in Baton imports it or depends on llama.cpp.

    python -m benchmarks.llamacpp_build            # the bench targets, print the bin dir
    python -m benchmarks.llamacpp_build --server   # llama-server too (`nice -n 19`, -j1)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

SDIST_VERSION = "0.3.36"
SDIST_NAME = f"llama_cpp_python-{SDIST_VERSION}"
BENCH_TARGETS = ("llama-bench", "llama-batched-bench")
SERVER_TARGET = "llama-server"
# One configuration serves every target. LLAMA_USE_PREBUILT_UI=OFF / LLAMA_BUILD_UI=OFF keep
# the server's web-UI step from downloading files (the build fails offline without them).
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
)
# Where the measurement left the sdist; otherwise `pip download` fetches it.
KNOWN_SDIST_PATHS = (Path("/tmp/lcpp") / f"{SDIST_NAME}.tar.gz",)


def cache_dir() -> Path:
    root = os.environ.get("BATON_LLAMACPP_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "baton" / "llamacpp"
    return base / SDIST_VERSION


def bin_dir() -> Path:
    return cache_dir() / "build" / "bin"


def built(targets: tuple[str, ...] = BENCH_TARGETS) -> bool:
    return all((bin_dir() / target).is_file() for target in targets)


def _find_or_download_sdist(work: Path) -> Path:
    for candidate in (*KNOWN_SDIST_PATHS, work / f"{SDIST_NAME}.tar.gz"):
        if candidate.is_file():
            return candidate
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "-d",
            str(work),
            f"llama-cpp-python=={SDIST_VERSION}",
        ],
        check=True,
    )
    return work / f"{SDIST_NAME}.tar.gz"


def build(
    jobs: int = 2,
    log=print,
    targets: tuple[str, ...] = BENCH_TARGETS,
    niceness: int = 0,
) -> Path:
    """Build `targets` if not cached; return the directory holding them.

    `niceness` > 0 runs cmake under `nice -n niceness` (a shared machine keeps its cores).
    """
    if built(targets):
        return bin_dir()
    work = cache_dir()
    work.mkdir(parents=True, exist_ok=True)
    source = work / "src"
    if not (source / "CMakeLists.txt").is_file():
        sdist = _find_or_download_sdist(work)
        log(f"unpacking {sdist} (vendor/llama.cpp only)")
        prefix = f"{SDIST_NAME}/vendor/llama.cpp/"
        unpack = work / "unpack"
        shutil.rmtree(unpack, ignore_errors=True)
        with tarfile.open(sdist) as archive:
            members = [m for m in archive.getmembers() if m.name.startswith(prefix)]
            archive.extractall(unpack, members=members, filter="data")
        shutil.rmtree(source, ignore_errors=True)
        (unpack / prefix).rename(source)
        shutil.rmtree(unpack, ignore_errors=True)
    build_tree = work / "build"
    nice = ["nice", "-n", str(niceness)] if niceness > 0 else []
    log(f"configuring llama.cpp in {build_tree} (Release, GGML_NATIVE=ON, no CURL, no web UI)")
    subprocess.run(
        [*nice, "cmake", "-S", str(source), "-B", str(build_tree), *CMAKE_FLAGS],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    log(f"building {', '.join(targets)} with {jobs} jobs (minutes)")
    subprocess.run(
        [*nice, "cmake", "--build", str(build_tree), "-j", str(jobs), "--target", *targets],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    if not built(targets):
        raise RuntimeError(f"llama.cpp build finished but {targets} are not in {bin_dir()}")
    return bin_dir()


def build_server(jobs: int = 1, log=print) -> Path:
    """Build `llama-server` (low priority, `jobs` compilers); return its path."""
    return build(jobs=jobs, log=log, targets=(SERVER_TARGET,), niceness=19) / SERVER_TARGET


def main(argv: list[str] | None = None) -> None:
    args = argv if argv is not None else sys.argv[1:]
    if "--server" in args:
        print(build_server())
    else:
        print(build())


if __name__ == "__main__":
    main()
