"""Vendored wheels for trainstack:networkIsolation: instances that cannot reach PyPI install the boot-time
packages, and a job its requirements, from files `pulumi up` puts in the stack's own bucket.

Each wheel is checked here against its lock's sha256 before preview passes, and again by pip on the
instance (--require-hashes): the lock travels in the hash-checked code bundle, so a wheel object changed in
the bucket is refused there. The wheels go to S3 as their own objects under code/wheels/ (file assets, not
in Pulumi state), never inside the bundle, whose bytes are part of the launch template's inputs.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from trainstack_job.bootlock import LockEntry, LockError, canonical, parse_lock
from trainstack_job.contract import BucketPrefix
from trainstack_job.jobfile import VENDORED_WHEELS_DIR

REPO_ROOT = Path(__file__).resolve().parent.parent
INSTANCE_LOCK = REPO_ROOT / "bootstrap" / "requirements-instance.lock.txt"
# `make wheels` fills it (gitignored build/): the lock's wheels for the DLAMI's CPython on x86_64 Linux.
INSTANCE_WHEELS_DIR = REPO_ROOT / "build" / "wheels" / "instance"
# install-agent.sh's default WHEELS_PREFIX; the instance role reads code/.
WHEELS_PREFIX = f"{BucketPrefix.CODE.value}wheels/"
# A job's vendored wheels: a folder of this name next to its requirements file.
JOB_WHEELS_DIR_NAME = VENDORED_WHEELS_DIR
_WHEEL = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-[^-]+-[^-]+-[^-]+\.whl$")


class WheelsError(ValueError):
    """Wheels that cannot serve a lock offline; the message says which and how to fetch them."""


@dataclass(frozen=True)
class VendoredWheel:
    path: Path
    entry: LockEntry


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def vendored_wheels(lock: Path, wheels_dir: Path) -> list[VendoredWheel]:
    """The wheels in `wheels_dir` that the lock names with a matching sha256: at least one per entry.

    Raises WheelsError naming every locked package with no such wheel (missing, or changed since locked).
    """
    try:
        entries = parse_lock(lock.read_text(encoding="utf-8"))
    except (OSError, LockError) as exc:
        raise WheelsError(f"{lock}: {exc}") from exc
    by_name = {entry.name: entry for entry in entries}
    found: list[VendoredWheel] = []
    for path in sorted(wheels_dir.glob("*.whl")) if wheels_dir.is_dir() else []:
        match = _WHEEL.match(path.name)
        entry = by_name.get(canonical(match.group("name"))) if match else None
        if entry is None or match is None or canonical(match.group("version")) != canonical(entry.version):
            continue
        if _sha256(path) in entry.hashes:
            found.append(VendoredWheel(path, entry))
    covered = {wheel.entry.name for wheel in found}
    missing = [f"{e.name}=={e.version}" for e in entries if e.name not in covered]
    if missing:
        raise WheelsError(
            f"{wheels_dir} lacks a wheel matching {lock.name}'s hashes for {', '.join(missing)}"
        )
    return found
