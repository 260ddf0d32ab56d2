"""The checkpoint layout every job and the agent agree on (docs/job-contract.md); standard library only.

A checkpoint is a directory `step-<N>/` holding the job's files and `manifest.json`, which lists each
file's size and sha256. The manifest is written last and the directory is renamed into place, so a
`step-<N>/` with a readable manifest is committed; anything else (dot-prefixed staging directories,
a directory without a manifest) is ignored. `latest.json` names the newest committed step.
"""

from __future__ import annotations

import hashlib
import json
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from trainstack_job.contract import LATEST, MANIFEST, STEP_DIR_PREFIX

STEP_DIR = re.compile(rf"^{STEP_DIR_PREFIX}(\d+)$")
__all__ = ["LATEST", "MANIFEST", "STEP_DIR", "CheckpointRefusedError"]


class CheckpointRefusedError(Exception):
    """S3 refused to hand over a file of a confirmed checkpoint (access denied, a key it cannot decrypt with,
    an outage outlasting botocore's retries), or the agent refused it: its manifest names a file outside the
    step's folder, which restoring (as root) would write anywhere on the instance. Unlike a damaged checkpoint
    it is not skipped for nothing: with no older checkpoint left, restore fails rather than start the job
    over, which would write a lower step over the one `latest.json` names.

    Defined beside the layout, not in the persister (bootstrap/checkpoint_store.py raises it): the trainer
    run by hand (training/__main__.py) ends on it in one line without importing the agent."""


def step_dir_name(step: int) -> str:
    return f"{STEP_DIR_PREFIX}{step}"


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(4 * 2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def latest_json(step: int, epoch: int | None, token: int | None = None) -> bytes:
    """`latest.json`'s body. `token` is the job lease's fencing token of the writer (the agent's persister
    when the job has a lease); it is left out otherwise, so unfenced writers write what they always did."""
    value: dict[str, Any] = {
        "step": step,
        "epoch": epoch,
        "dir": step_dir_name(step),
        "written_at": now_iso(),
    }
    if token is not None:
        value["token"] = token
    return json.dumps(value).encode()


def build_manifest(directory: Path, *, step: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The manifest of every regular file under `directory` (relative POSIX names), manifest excluded."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        name = path.relative_to(directory).as_posix()
        if name == MANIFEST:
            continue
        files[name] = {"sha256": sha256_file(path), "size": path.stat().st_size}
    return {"step": step, **(extra or {}), "written_at": now_iso(), "files": files}


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The manifest of a committed step directory, or None when there is none (not committed)."""
    try:
        value = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("files"), dict):
        return None
    return value


def verify_dir(directory: Path) -> tuple[dict[str, Any] | None, str]:
    """(manifest, "") if every listed file has its recorded size and sha256, else (None, why not)."""
    manifest = read_manifest(directory)
    if manifest is None:
        return None, f"{directory / MANIFEST} missing or unreadable"
    for name, meta in manifest["files"].items():
        path = directory / name
        if not path.is_file() or path.stat().st_size != meta["size"]:
            return None, f"{path} missing or truncated"
        if sha256_file(path) != meta["sha256"]:
            return None, f"{path} sha256 mismatch"
    return manifest, ""


def committed_steps(root: Path) -> list[int]:
    """Steps with a committed directory under `root` (a readable manifest), newest first."""
    steps = []
    try:
        entries = list(root.iterdir())
    except FileNotFoundError:
        return []
    for entry in entries:
        match = STEP_DIR.match(entry.name)
        if match and entry.is_dir() and read_manifest(entry) is not None:
            steps.append(int(match.group(1)))
    return sorted(steps, reverse=True)
