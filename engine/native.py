"""C kernels for the CPU path: compiled once per machine with the system C compiler, cached
under $BATON_KERNEL_DIR (default ~/.cache/baton/kernels), loaded with ctypes.

Libraries link the OpenMP runtime by its soname (libgomp.so.1); torch has already loaded its
own copy under that soname, so a kernel's parallel loop runs on torch's thread pool rather
than on a second one competing for the same cores. Where the CPU lacks AVX2/FMA/F16C or no
compiler works, load_native returns None and callers keep their torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import subprocess
import tempfile
from pathlib import Path

import torch  # noqa: F401 - loads torch's libgomp before any kernel library

logger = logging.getLogger(__name__)

CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
CPU_FLAGS = ("avx2", "fma", "f16c")


def kernel_dir() -> Path:
    """Where compiled libraries are cached: $BATON_KERNEL_DIR or ~/.cache/baton/kernels."""
    env = os.environ.get("BATON_KERNEL_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "baton" / "kernels"


@functools.cache
def cpu_supports() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        flags = next(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        ).split()
    except (OSError, StopIteration):
        return False
    return all(f in flags for f in CPU_FLAGS)


def _build(source: Path, target: Path) -> None:
    """Compile source into target atomically (a concurrent build loses the rename harmlessly)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}-", dir=target.parent)
    os.close(fd)
    try:
        compiler = os.environ.get("CC", "cc")
        subprocess.run(
            [compiler, *CFLAGS, "-o", tmp, str(source)],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def source_files(source: Path) -> list[Path]:
    """source and every file it includes with `#include "..."` (relative to the including
    file, as the compiler resolves them), recursively, each once: what a build depends on."""
    seen: list[Path] = []
    pending = [source.resolve()]
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.append(path)
        for name in _LOCAL_INCLUDE.findall(path.read_text()):
            pending.append((path.parent / name).resolve())
    return seen


def library_path(source: Path) -> Path:
    """Where source's library is cached: keyed by a hash of source, the files it includes (a
    change in one rebuilds every library using it) and CFLAGS."""
    text = b"".join(path.read_bytes() for path in source_files(source))
    digest = hashlib.sha256(text + " ".join(CFLAGS).encode()).hexdigest()[:16]
    return kernel_dir() / f"{source.stem}-{digest}.so"


@functools.cache
def load_native(source: Path) -> ctypes.CDLL | None:
    """The compiled library of a C source file, or None (logged once) where it cannot run."""
    if not cpu_supports():
        logger.info(
            "%s needs an x86-64 CPU with %s; using the torch path", source.name, "/".join(CPU_FLAGS)
        )
        return None
    target = library_path(source)
    try:
        if not target.is_file():
            _build(source, target)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning(
            "could not build %s (%s); using the torch path", source.name, str(detail).strip()[:500]
        )
        return None


@functools.cache
def _load_kernel(source: Path, signatures: tuple) -> ctypes.CDLL | None:
    lib = load_native(source)
    if lib is None:
        return None
    for name, argtypes in signatures:
        function = getattr(lib, name)
        function.argtypes = list(argtypes)
        function.restype = ctypes.c_int  # every Baton kernel returns a status (or a flag)
    return lib


def load_kernel_library(source: Path, **signatures: list) -> ctypes.CDLL | None:
    """load_native(source) with each named function's argtypes set (restype int: all of
    Baton's kernels return a status), or None where it cannot run here. Cached per source and
    signatures."""
    return _load_kernel(source, tuple((n, tuple(a)) for n, a in signatures.items()))
