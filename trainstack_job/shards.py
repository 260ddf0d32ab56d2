"""A dataset as shards: `trainstack data push DIR --format shards` writes each split of an ImageFolder
(`train/<class>/<image>`, `val/<class>/<image>`) as tar files of a few hundred MB plus one index, and the
built-in trainer streams them (training/streaming.py). Standard library only: a job of your own reads the
same shards with this module (see docs/job-contract.md, "Streamed datasets").

Layout of one split, under the dataset's prefix (versioned by the dataset's manifest like any other file):

    train/shards.json          the index: classes, shards (key, size, sha256), samples in shard order
    train/shard-000000.tar     webdataset layout: `<key>.<ext>` (the image) and `<key>.cls` (its label)

Each sample of the index is `[shard, offset, size, label, name]`: the image's bytes are `size` bytes at
`offset` in shard number `shard`, so one sample is read with one seek, without walking the tar. The members
are plain tar (any `tar`, `webdataset` or `litdata`-free reader opens them), written byte-for-byte the same
for the same files (sorted, zeroed times and owners), so a push of unchanged data sends nothing.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any

from trainstack_job.layout import sha256_file

INDEX_NAME = "shards.json"
INDEX_FORMAT = "trainstack-shards/1"
# 512 MB: inside the 100 MB-1 GB range where one GET is long enough to reach S3's per-connection rate and
# few enough files that listing and caching stay cheap; tests pass a few KB.
DEFAULT_SHARD_BYTES = 512 * 1000 * 1000


class ShardError(ValueError):
    """An index or shard that cannot be used: one line naming the file and the fix."""


@dataclass(frozen=True)
class ShardInfo:
    key: str  # relative to the index's folder: shard-000000.tar
    size: int
    sha256: str


@dataclass(frozen=True)
class SampleEntry:
    shard: int
    offset: int
    size: int
    label: int
    name: str  # the image's path in the pushed folder, relative to the split: cat/1.jpg


@dataclass(frozen=True)
class ShardIndex:
    """One split's index: which shard holds each sample, where, and its label."""

    classes: list[str]
    shards: list[ShardInfo]
    samples: list[SampleEntry]
    # Set by the agent in the copy it leaves in the job's data folder (bootstrap/datasync.py): where the
    # shards are (s3://bucket/data/train; "" = beside the index) and the instance's cache folder for them.
    source: str = ""
    cache_dir: str = ""

    def to_json(self) -> dict[str, Any]:
        placed = {"source": self.source, "cache_dir": self.cache_dir} if self.source else {}
        return {
            "format": INDEX_FORMAT,
            "classes": self.classes,
            "shards": [{"key": s.key, "size": s.size, "sha256": s.sha256} for s in self.shards],
            "samples": [[e.shard, e.offset, e.size, e.label, e.name] for e in self.samples],
            **placed,
        }

    @classmethod
    def from_json(cls, body: bytes, where: str) -> ShardIndex:
        fix = "push the dataset again with `trainstack data push DIR --format shards`"
        try:
            raw = json.loads(body)
            if raw.get("format") != INDEX_FORMAT:
                raise ShardError(f"{where}: format {raw.get('format')!r}, expected {INDEX_FORMAT!r}; {fix}")
            shards = [ShardInfo(str(s["key"]), int(s["size"]), str(s["sha256"])) for s in raw["shards"]]
            samples = [
                SampleEntry(int(a), int(b), int(c), int(d), str(e)) for a, b, c, d, e in raw["samples"]
            ]
            classes = [str(c) for c in raw["classes"]]
            source, cache_dir = str(raw.get("source") or ""), str(raw.get("cache_dir") or "")
        except ShardError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ShardError(f"{where}: not a shard index ({type(error).__name__}: {error}); {fix}") from None
        if any(not 0 <= e.shard < len(shards) for e in samples):
            raise ShardError(f"{where}: a sample names a shard the index does not list; {fix}")
        return cls(classes, shards, samples, source, cache_dir)

    def shard_sizes(self) -> list[int]:
        """Samples per shard, in shard order (the index lists samples shard by shard)."""
        counts = [0] * len(self.shards)
        for entry in self.samples:
            counts[entry.shard] += 1
        return counts


def read_sample(stream: IO[bytes], entry: SampleEntry) -> bytes:
    """The bytes of one sample from its open shard."""
    stream.seek(entry.offset)
    data = stream.read(entry.size)
    if len(data) != entry.size:
        raise ShardError(f"sample {entry.name}: shard ends before its {entry.size} bytes at {entry.offset}")
    return data


def iter_shard(path: str | Path) -> Iterator[tuple[str, bytes, int | None]]:
    """(name, image bytes, label) of each sample in one local shard file, in order: what a job of your own
    needs to read a pushed shard (the label is None when the shard has no `.cls` member)."""
    with tarfile.open(path, "r:") as tar:
        pending: dict[str, tuple[str, bytes]] = {}
        labels: dict[str, int] = {}
        order: list[str] = []
        for member in tar:
            if not member.isfile():
                continue
            stem, _, ext = member.name.partition(".")
            extracted = tar.extractfile(member)
            assert extracted is not None  # a regular file
            data = extracted.read()
            if ext == "cls":
                labels[stem] = int(data)
            else:
                order.append(stem)
                pending[stem] = (member.name, data)
        for stem in order:
            name, data = pending[stem]
            yield name, data, labels.get(stem)


def _member(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o644
    info.mtime = 0  # byte-identical shards for identical files: an unchanged push sends nothing
    return info


def _shuffled(files: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
    # A fixed order that mixes classes (a shard of one class would make a shard-local shuffle one class per
    # batch), stable when files are added: each file's place is the hash of its own name.
    return sorted(files, key=lambda item: hashlib.sha256(item[0].encode()).hexdigest())


def write_split(
    split_dir: Path, classes: list[str], files: Sequence[tuple[str, int]], out: Path, shard_bytes: int
) -> ShardIndex:
    """Write `files` ((path relative to `split_dir`, label)) as shards of about `shard_bytes` plus the index
    into `out`; returns the index."""
    out.mkdir(parents=True, exist_ok=True)
    groups: list[list[tuple[str, int]]] = [[]]
    filled = 0
    for relative, label in _shuffled(files):
        if groups[-1] and filled >= shard_bytes:
            groups.append([])
            filled = 0
        groups[-1].append((relative, label))
        filled += (split_dir / relative).stat().st_size
    shards: list[ShardInfo] = []
    samples: list[SampleEntry] = []
    for number, group in enumerate(groups):
        key = f"shard-{number:06d}.tar"
        path = out / key
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
            for position, (relative, label) in enumerate(group):
                # webdataset's convention: members of one sample share the key before the first dot.
                stem = f"{position:09d}"
                suffix = PurePosixPath(relative).suffix.lower() or ".img"
                data = (split_dir / relative).read_bytes()
                tar.addfile(_member(stem + suffix, len(data)), io.BytesIO(data))
                text = str(label).encode()
                tar.addfile(_member(stem + ".cls", len(text)), io.BytesIO(text))
        with tarfile.open(path, "r:") as tar:
            offsets = {m.name.partition(".")[0]: m.offset_data for m in tar if not m.name.endswith(".cls")}
        for position, (relative, label) in enumerate(group):
            size = (split_dir / relative).stat().st_size
            samples.append(SampleEntry(number, offsets[f"{position:09d}"], size, label, relative))
        shards.append(ShardInfo(key, path.stat().st_size, sha256_file(path)))
    index = ShardIndex(list(classes), shards, samples)
    (out / INDEX_NAME).write_text(json.dumps(index.to_json(), separators=(",", ":")))
    return index
