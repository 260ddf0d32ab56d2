"""Datasets in the stack bucket and their versions (docs/internals.md, "Datasets and their versions"); stdlib
only, shared by `trainstack data push`, the agent's sync and `trainstack run`, so the three agree on where a
dataset lives and what its version is.

A dataset is a set of files under one prefix: the default dataset (name "") under `data/`, as before datasets
had names, a named one under `datasets/<name>/`. Its manifest lists every file with its size, sha256 and the
ETag of the object that holds it; the dataset's version is a hash over its (path, size, sha256) lines, so two
pushes of the same files give the same version whatever their ETags (SSE-KMS ETags are not content hashes).
The manifest is written only after every file it lists is confirmed in S3.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

DEFAULT_DATASET = ""
DEFAULT_DATA_PREFIX = "data/"
DATASETS_PREFIX = "datasets/"
# Under the stack's state/ prefix: the default dataset's manifest keeps the key it had before versions, a
# named dataset's sits beside the others under state/datasets/.
DEFAULT_MANIFEST = "data-manifest.json"
NAMED_MANIFESTS = "datasets/"
MANIFEST_FORMAT = 2
# Object metadata (x-amz-meta-sha256) carried by every file `trainstack data push` uploads: an upload that a
# failed push left behind is recognised by its content, so the next push does not send it again.
SHA256_METADATA = "sha256"
SHORT_VERSION = 12
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
_VERSION = re.compile(r"^[0-9a-f]{12,64}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class DatasetError(ValueError):
    """A bad dataset name, version or manifest; the message names it and the fix on one line."""


def check_dataset_name(name: str, key: str = "dataset") -> str:
    """`name` when it can name a dataset ("" = the default one)."""
    if name == DEFAULT_DATASET:
        return name
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        raise DatasetError(
            f"{key}: {name!r} is not a dataset name (at most 63 lowercase letters, digits, '.', '_' and '-', "
            "e.g. 'imagenet-small'; empty = the default dataset under data/)"
        )
    return name


def check_version(version: str, key: str = "dataset_version") -> str:
    """`version` when it can name a dataset version: empty (any), or 12 to 64 hex digits of one."""
    if not isinstance(version, str) or (version and not _VERSION.match(version)):
        raise DatasetError(
            f"{key}: {version!r} is not a dataset version (12 to 64 lowercase hex digits, as "
            "`trainstack data list` shows them; empty = the version current when the job starts)"
        )
    return version


def same_version(a: str, b: str) -> bool:
    """Whether two versions name the same dataset version; either may be shortened to 12+ digits."""
    return bool(a and b) and (a.startswith(b) or b.startswith(a))


def short(version: str) -> str:
    return version[:SHORT_VERSION] if version else "unversioned"


def label(name: str) -> str:
    """How messages name a dataset."""
    return f"dataset '{name}'" if name else "the default dataset"


def push_command(name: str) -> str:
    return f"trainstack data push DIR --name {name}" if name else "trainstack data push DIR"


@dataclass(frozen=True)
class DatasetPlace:
    """Where one dataset's files and manifest are in the bucket."""

    name: str
    prefix: str
    manifest_key: str

    @classmethod
    def of(
        cls, name: str, *, data_prefix: str = DEFAULT_DATA_PREFIX, state_prefix: str = "state/"
    ) -> DatasetPlace:
        """`data_prefix` and `state_prefix`: the stack's (the default dataset's files, every manifest)."""
        check_dataset_name(name)
        if name == DEFAULT_DATASET:
            return cls(name, data_prefix, state_prefix + DEFAULT_MANIFEST)
        return cls(name, f"{DATASETS_PREFIX}{name}/", f"{state_prefix}{NAMED_MANIFESTS}{name}.json")


@dataclass(frozen=True)
class ManifestFile:
    size: int
    sha256: str
    etag: str | None = None  # the object's ETag when the file was confirmed; None = unknown (older manifest)


def compute_version(files: Mapping[str, ManifestFile]) -> str:
    """sha256 over the sorted `path\\tsize\\tsha256` lines: the same files, the same version."""
    digest = hashlib.sha256()
    for path in sorted(files):
        entry = files[path]
        digest.update(f"{path}\t{entry.size}\t{entry.sha256}\n".encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class Manifest:
    """One dataset version: its files (path relative to the dataset's prefix) and when it was pushed."""

    name: str
    files: dict[str, ManifestFile]
    pushed_at: str = ""
    # The ImageFolder classes when the push checked the layout (the built-in trainer reads it), else None.
    classes: list[str] | None = None
    version: str = field(init=False, default="")  # compute_version(files)

    def __post_init__(self) -> None:
        object.__setattr__(self, "version", compute_version(self.files))

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files.values())

    def to_json(self, prefix: str) -> dict[str, Any]:
        return {
            "format": MANIFEST_FORMAT,
            "dataset": self.name,
            "prefix": prefix,
            "version": self.version,
            "pushed_at": self.pushed_at,
            "file_count": len(self.files),
            "bytes": self.total_bytes,
            "classes": self.classes,
            "files": {
                path: {"size": entry.size, "sha256": entry.sha256, "etag": entry.etag}
                for path, entry in sorted(self.files.items())
            },
        }


def parse_manifest(body: bytes, place: DatasetPlace, where: str) -> Manifest:
    """A manifest object's body; `where` (its s3:// URI) names it in the one-line error. Reads the format
    written before versions too (keys with the prefix, no version)."""
    fix = (
        f"delete it and push the dataset again ({push_command(place.name)}): files already there are "
        "recognised by their content and not sent again"
    )
    try:
        raw = json.loads(body)
        entries = raw["files"]
        if not isinstance(entries, dict):
            raise TypeError("'files' is not a mapping")
        files: dict[str, ManifestFile] = {}
        for path, entry in entries.items():
            relative = path[len(place.prefix) :] if path.startswith(place.prefix) else path
            size, sha256, etag = entry["size"], entry["sha256"], entry.get("etag")
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise TypeError(f"{path}: size {size!r}")
            if not isinstance(sha256, str) or not _SHA256.match(sha256):
                raise TypeError(f"{path}: sha256 {sha256!r}")
            if not relative or relative.startswith("/") or ".." in relative.split("/"):
                raise TypeError(f"{path}: not a path inside the dataset")
            files[relative] = ManifestFile(size, sha256, etag if isinstance(etag, str) else None)
        classes = raw.get("classes")
        manifest = Manifest(
            place.name,
            files,
            pushed_at=str(raw.get("pushed_at") or ""),
            classes=[str(c) for c in classes] if isinstance(classes, list) else None,
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise DatasetError(f"{where} is not a dataset manifest ({exc}); {fix}") from None
    recorded = raw.get("version")
    if recorded is not None and recorded != manifest.version:
        raise DatasetError(
            f"{where} says version {short(str(recorded))} but its files hash to {short(manifest.version)} "
            f"(edited by hand?); {fix}"
        )
    return manifest
