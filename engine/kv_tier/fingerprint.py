"""The model fingerprint a tier's blocks are stamped with: which weights, which arithmetic.

KV is only reusable by an engine that would have computed the same values: the same checkpoint
files and the options that change the model's arithmetic (dtype, GGUF blocks, int8
activations). The checkpoint part hashes every file's name and size and, for files over
SAMPLE_LIMIT bytes, SAMPLES evenly spaced chunks of CHUNK bytes (reading whole weights at each
start-up would cost seconds per GB). A retrained checkpoint changes far more than one chunk;
an edit that leaves every size and sampled byte alone goes unnoticed, so give a modified model
a fresh kv_tier_path.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

CHUNK = 64 * 1024
SAMPLES = 64
SAMPLE_LIMIT = SAMPLES * CHUNK  # files up to this size are hashed whole


def checkpoint_digest(model_dir: str | os.PathLike) -> str:
    """Hex digest of the regular files directly in model_dir (names, sizes, sampled bytes)."""
    h = hashlib.blake2b(digest_size=16)
    for p in sorted(Path(model_dir).iterdir()):
        if not p.is_file():
            continue
        size = p.stat().st_size
        h.update(f"{p.name}\0{size}\0".encode())
        with open(p, "rb") as f:
            if size <= SAMPLE_LIMIT:
                h.update(f.read())
                continue
            step = (size - CHUNK) // (SAMPLES - 1)
            for i in range(SAMPLES):
                f.seek(i * step)
                h.update(f.read(CHUNK))
    return h.hexdigest()


def model_fingerprint(model_dir: str | os.PathLike, **arithmetic: object) -> str:
    """checkpoint_digest plus the options that change the computed KV (name=value, sorted)."""
    options = ",".join(f"{k}={arithmetic[k]}" for k in sorted(arithmetic))
    return f"{checkpoint_digest(model_dir)};{options}"
