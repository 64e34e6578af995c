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


@functools.cache
def load_native(source: Path) -> ctypes.CDLL | None:
    """The compiled library of a C source file, or None (logged once) where it cannot run."""
    if not cpu_supports():
        logger.info(
            "%s needs an x86-64 CPU with %s; using the torch path", source.name, "/".join(CPU_FLAGS)
        )
        return None
    digest = hashlib.sha256(source.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:16]
    target = kernel_dir() / f"{source.stem}-{digest}.so"
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
