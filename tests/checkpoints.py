"""Checkpoints as a job writes them, for the tests of what persists and fences them."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def commit_step(root: Path, step: int, size: int = 1000, *, epoch: int = 0) -> bytes:
    """A committed checkpoint as any job writes it: files, manifest last, renamed into place.

    Returns the data it wrote (state.bin)."""
    staging = root / f".step-{step}.tmp"
    staging.mkdir(parents=True)
    data = os.urandom(size)
    (staging / "state.bin").write_bytes(data)
    files = {"state.bin": {"sha256": hashlib.sha256(data).hexdigest(), "size": size}}
    (staging / "manifest.json").write_text(json.dumps({"step": step, "epoch": epoch, "files": files}))
    staging.rename(root / f"step-{step}")
    return data
