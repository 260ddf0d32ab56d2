"""The code bundle an instance runs: `training/`, `bootstrap/`, `trainstack_job/` and a user's job workdir
(under `job/`), archived reproducibly, content-addressed; the dev box's also holds the CLI (`trainstack/`,
`infra/`)."""

from __future__ import annotations

import functools
import gzip
import hashlib
import io
import os
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from trainstack_job.contract import BucketPrefix
from trainstack_job.jobfile import BUNDLE_JOB_DIR

REPO_ROOT = Path(__file__).resolve().parent.parent
BUNDLED_PACKAGES = ("training", "bootstrap", "trainstack_job")
# The dev box runs `trainstack run` from its working folder: the CLI and the submission code it imports
# (infra.submission, infra.jobdef, infra.bundle) travel with the agent's packages, on the dev box only, so the
# job instances' bundle stays the agent's. The job bundles it builds there hold BUNDLED_PACKAGES only, from
# these same files: the same sources give the same sha256 as on a laptop.
DEV_BOX_PACKAGES = (*BUNDLED_PACKAGES, "trainstack", "infra")
BUNDLE_FILE_NAME = "bundle.tar.gz"
# Only source and data files travel; caches and editor droppings would change the hash for nothing.
_BUNDLED_SUFFIXES = {".py", ".yaml", ".yml", ".sh", ".service", ".txt", ".json", ".cfg"}


@dataclass(frozen=True)
class CodeBundle:
    """A gzip'd tar of the instance code and its sha256 (the S3 key is derived from it)."""

    data: bytes
    sha256: str

    def key(self, code_prefix: str = BucketPrefix.CODE.value) -> str:
        """S3 key of the bundle: `code/<sha256>/bundle.tar.gz`, so any code change is a new object."""
        return f"{code_prefix}{self.sha256}/{BUNDLE_FILE_NAME}"


# A job's workdir travels whole (its data files included) but never its local run folders or caches.
_JOB_SKIPPED_DIRS = {"__pycache__", "checkpoints", "output", ".git", ".venv", "venv", "node_modules"}
# User-data stays small, but the bundle goes to S3: this only catches a dataset committed by mistake.
MAX_JOB_BYTES = 200 * 2**20


class BundleError(ValueError):
    """The job's workdir cannot be bundled; the message names the folder and the fix."""


class LinkOutsideError(BundleError):
    """Links in the job's folder that point out of it: `problems` holds one line for each, naming the link,
    where it points and the fix; the message is those lines joined by '; '."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def package_files(root: Path, package: str) -> list[tuple[str, Path]]:
    """The files of one bundled package as they go into the bundle: (name in the archive, local path)."""
    return [
        (path.relative_to(root).as_posix(), path)
        for path in (root / package).rglob("*")
        if path.is_file() and path.suffix in _BUNDLED_SUFFIXES and "__pycache__" not in path.parts
    ]


def _bundled_files(root: Path, packages: Sequence[str]) -> list[tuple[str, Path]]:
    return [entry for package in packages for entry in package_files(root, package)]


def _skipped(name: str) -> bool:
    return name.startswith(".") or name in _JOB_SKIPPED_DIRS


def links_outside(job_dir: Path) -> list[str]:
    """One line for each link in the job's folder that points out of it, where the bundle would read it.

    The bundle reads each file through its links: a link to ~/.aws/credentials would upload the credentials
    with the job's code, to the bucket every instance of the stack reads. A link inside the folder is a copy
    of the job's own file and passes; a link to a folder out of it is named too, dangling or not; folders the
    bundle skips (.venv, dot folders, run folders) are not looked at."""
    root = job_dir.resolve()
    found: list[str] = []
    for folder, dirs, files in os.walk(job_dir):  # never into a linked folder: os.walk lists it, as a name
        where = Path(folder)
        dirs[:] = sorted(d for d in dirs if not _skipped(d))
        for name in sorted([*dirs, *files]):
            path = where / name
            if _skipped(name) or not path.is_symlink():
                continue
            target = path.resolve()
            if not target.is_relative_to(root):
                found.append(
                    f"{path}: a link to {target}, outside the job's folder {job_dir}; the bundle never "
                    "follows a link out of it: replace the link with a copy of what it points to, or "
                    "remove it"
                )
    return found


def job_files(job_dir: Path) -> list[tuple[str, Path]]:
    """The job's files as they go into the bundle: (name in the archive, local path). LinkOutsideError names
    each link out of the folder (`pulumi up` and `trainstack run` both bundle through here, so neither
    uploads what such a link points to); BundleError says when the folder is too large."""
    outside = links_outside(job_dir)
    if outside:
        raise LinkOutsideError(outside)
    files: list[tuple[str, Path]] = []
    total = 0
    for path in job_dir.rglob("*"):
        parts = path.relative_to(job_dir).parts
        if not path.is_file() or any(_skipped(p) for p in parts):
            continue
        total += path.stat().st_size
        files.append((f"{BUNDLE_JOB_DIR}/{'/'.join(parts)}", path))
    if total > MAX_JOB_BYTES:
        raise BundleError(
            f"trainstack:job: the workdir {job_dir} holds {total / 2**20:.0f} MiB; keep data out of it "
            "(trainstack data push) so the code bundle stays small"
        )
    return files


def build_bundle(
    root: Path = REPO_ROOT, job_dir: Path | None = None, packages: Sequence[str] = BUNDLED_PACKAGES
) -> CodeBundle:
    """Archive the instance code byte-for-byte reproducibly: same sources, same sha256. `packages`: the
    agent's (default) or DEV_BOX_PACKAGES for the dev box.

    Sorted entries, zeroed timestamps and owners, and a fixed gzip header mean the hash changes
    only when a bundled file does — which is what rolls a new launch-template version.
    """
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        entries = _bundled_files(root, packages) + (job_files(job_dir) if job_dir is not None else [])
        for name, path in sorted(entries):
            info = tarfile.TarInfo(name)
            content = path.read_bytes()
            info.size = len(content)
            info.mode = 0o755 if path.suffix == ".sh" else 0o644
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            tar.addfile(info, io.BytesIO(content))
    return _compressed(raw.getvalue())


# The same archive compresses to the same bytes: a process that bundles the same sources again (each
# `pulumi preview`/`up` of a program, the infra tests' hundreds of mocked runs) compresses them once. Level 9
# is ~0.1 s of CPU per bundle; the archive itself is read from disk every time, so a changed file is a new
# archive, never a stale bundle. A few entries: the agent's, the dev box's and a job's bundle.
@functools.lru_cache(maxsize=4)
def _compressed(raw: bytes) -> CodeBundle:
    compressed = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=compressed, mtime=0, compresslevel=9) as gz:
        gz.write(raw)
    data = compressed.getvalue()
    return CodeBundle(data=data, sha256=hashlib.sha256(data).hexdigest())
