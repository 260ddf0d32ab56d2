"""The code bundle an instance runs: `training/` + `bootstrap/`, archived reproducibly, content-addressed."""

from __future__ import annotations

import gzip
import hashlib
import io
import tarfile
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
BUNDLED_PACKAGES = ("training", "bootstrap", "trainstack_job")
BUNDLE_FILE_NAME = "bundle.tar.gz"
# Only source and data files travel; caches and editor droppings would change the hash for nothing.
_BUNDLED_SUFFIXES = {".py", ".yaml", ".yml", ".sh", ".service", ".txt", ".json", ".cfg"}


@dataclass(frozen=True)
class CodeBundle:
    """A gzip'd tar of the instance code and its sha256 (the S3 key is derived from it)."""

    data: bytes
    sha256: str

    def key(self, code_prefix: str = "code/") -> str:
        """S3 key of the bundle: `code/<sha256>/bundle.tar.gz`, so any code change is a new object."""
        return f"{code_prefix}{self.sha256}/{BUNDLE_FILE_NAME}"


def _bundled_files(root: Path) -> list[Path]:
    files: list[Path] = []
    for package in BUNDLED_PACKAGES:
        for path in (root / package).rglob("*"):
            if path.is_file() and path.suffix in _BUNDLED_SUFFIXES and "__pycache__" not in path.parts:
                files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def build_bundle(root: Path = REPO_ROOT) -> CodeBundle:
    """Archive the instance code byte-for-byte reproducibly: same sources, same sha256.

    Sorted entries, zeroed timestamps and owners, and a fixed gzip header mean the hash changes
    only when a bundled file does — which is what rolls a new launch-template version.
    """
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in _bundled_files(root):
            info = tarfile.TarInfo(path.relative_to(root).as_posix())
            content = path.read_bytes()
            info.size = len(content)
            info.mode = 0o755 if path.suffix == ".sh" else 0o644
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            tar.addfile(info, io.BytesIO(content))
    compressed = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=compressed, mtime=0, compresslevel=9) as gz:
        gz.write(raw.getvalue())
    data = compressed.getvalue()
    return CodeBundle(data=data, sha256=hashlib.sha256(data).hexdigest())
