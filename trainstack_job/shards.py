"""A dataset as shards: `trainstack data push DIR --format shards` writes each split of an ImageFolder
(`train/<class>/<image>`, `val/<class>/<image>`) as tar files of a few hundred MB plus one index, and the
built-in trainer streams them (training/streaming.py). Standard library only: a job of your own reads the
same shards with this module (see docs/job-contract.md, "Streamed datasets").

Layout of one split, under the dataset's prefix (versioned by the dataset's manifest like any other file):

    train/shards.json          the index: classes, shards (key, size, sha256, samples), the samples' table
    train/shard-000000.tar     webdataset layout: `<key>.<ext>` (the image) and `<key>.cls` (its label)

Each sample of the index is a `SampleEntry` (shard, offset, size, label, name): the image's bytes are `size`
bytes at `offset` in shard number `shard`, so one sample is read with one seek, without walking the tar.
The members are plain tar (any `tar`, `webdataset` or `litdata`-free reader opens them), written
byte-for-byte the same for the same files (sorted, zeroed times and owners), so a push of unchanged data
sends nothing.

The samples are numbered shard after shard and stored as columns (`SampleTable`): each shard's count, then
the offsets, sizes and labels as little-endian arrays in base64, and the names as one list. Reading the
index is then a few array copies and one list, not an object per sample: ImageNet's 1.28 M samples were
79 MB of JSON lists and 5.5 s of parsing in the first format, before the first step of every life.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import hashlib
import io
import json
import sys
import tarfile
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any, overload

from trainstack_job.layout import sha256_file

INDEX_NAME = "shards.json"
INDEX_FORMAT = "trainstack-shards/2"
# Still read: one `[shard, offset, size, label, name]` list per sample (pushes before 2026-12-07).
FIRST_INDEX_FORMAT = "trainstack-shards/1"
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
    # The S3 ETag of the object the push uploaded, set by the agent in the copy of the index it places (from
    # the dataset version's manifest); "" when unknown. A download conditional on it (If-Match) gets exactly
    # the pushed bytes or S3's refusal, so the trainer need not hash what it downloaded.
    etag: str = ""


@dataclass(frozen=True)
class SampleEntry:
    shard: int
    offset: int
    size: int
    label: int
    name: str  # the image's path in the pushed folder, relative to the split: cat/1.jpg


_FIX = "push the dataset again with `trainstack data push DIR --format shards`"


def _column(typecode: str, values: Iterable[int] = ()) -> array[int]:
    return array(typecode, values)


# The columns' element types: 8-byte offsets (a shard may pass 4 GB), 4-byte sizes and labels.
_OFFSET, _SIZE, _LABEL = "Q", "I", "I"
assert _column(_OFFSET).itemsize == 8 and _column(_SIZE).itemsize == 4, "unusual C types: columns unreadable"


def _encode(column: array[int]) -> str:
    if sys.byteorder == "big":  # the stored bytes are little-endian on every machine
        column = _column(column.typecode, column)
        column.byteswap()
    return base64.b64encode(column.tobytes()).decode("ascii")


def _decode(typecode: str, text: str, length: int, name: str) -> array[int]:
    column = _column(typecode)
    try:
        column.frombytes(base64.b64decode(text, validate=True))
    except binascii.Error as error:
        raise ValueError(f"{name} is not base64 ({error})") from None
    if sys.byteorder == "big":
        column.byteswap()
    if len(column) != length:
        raise ValueError(f"{name} holds {len(column)} values, the shards' counts {length}")
    return column


class SampleTable(Sequence[SampleEntry]):
    """Every sample of one split, numbered shard after shard, as columns: a `SampleEntry` is made only for
    the sample asked for. `counts` are the samples of each shard, in shard order."""

    def __init__(
        self,
        counts: Sequence[int],
        offsets: array[int],
        sizes: array[int],
        labels: array[int],
        names: Sequence[str],
    ) -> None:
        self.counts = list(counts)
        self.starts = [0]
        for count in self.counts:
            self.starts.append(self.starts[-1] + count)
        if not len(offsets) == len(sizes) == len(labels) == len(names) == self.starts[-1]:
            raise ValueError(
                f"{len(offsets)} offsets, {len(sizes)} sizes, {len(labels)} labels and {len(names)} names "
                f"for the shards' {self.starts[-1]} samples"
            )
        self.offsets, self.sizes, self.labels, self.names = offsets, sizes, labels, names

    @classmethod
    def from_entries(cls, entries: Iterable[SampleEntry], shard_count: int) -> SampleTable:
        """The table of `entries`, which must come shard by shard (as `write_split` and the first format
        list them) and name shards below `shard_count`."""
        counts = [0] * shard_count
        offsets, sizes, labels = _column(_OFFSET), _column(_SIZE), _column(_LABEL)
        names: list[str] = []
        last = 0
        for entry in entries:
            if not last <= entry.shard < shard_count:
                raise ValueError(
                    f"sample {entry.name} names shard {entry.shard}: not one of the {shard_count} listed, "
                    "or out of shard order"
                )
            last = entry.shard
            counts[entry.shard] += 1
            offsets.append(entry.offset)
            sizes.append(entry.size)
            labels.append(entry.label)
            names.append(entry.name)
        return cls(counts, offsets, sizes, labels, names)

    def to_json(self) -> dict[str, Any]:
        return {
            "offsets": _encode(self.offsets),
            "sizes": _encode(self.sizes),
            "labels": _encode(self.labels),
            "names": list(self.names),
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any], counts: list[int]) -> SampleTable:
        total = sum(counts)
        names = raw["names"]
        if not isinstance(names, list):
            raise TypeError(f"names is a {type(names).__name__}, not a list")
        return cls(
            counts,
            _decode(_OFFSET, raw["offsets"], total, "offsets"),
            _decode(_SIZE, raw["sizes"], total, "sizes"),
            _decode(_LABEL, raw["labels"], total, "labels"),
            names,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SampleTable):
            return NotImplemented
        mine = (self.counts, self.offsets, self.sizes, self.labels, list(self.names))
        return mine == (other.counts, other.offsets, other.sizes, other.labels, list(other.names))

    __hash__ = None  # type: ignore[assignment]  # mutable columns, like the list it stands for

    def shard_of(self, position: int) -> int:
        return bisect.bisect_right(self.starts, position) - 1

    def __len__(self) -> int:
        return self.starts[-1]

    @overload
    def __getitem__(self, position: int) -> SampleEntry: ...

    @overload
    def __getitem__(self, position: slice) -> list[SampleEntry]: ...

    def __getitem__(self, position: int | slice) -> SampleEntry | list[SampleEntry]:
        if isinstance(position, slice):
            return [self[i] for i in range(*position.indices(len(self)))]
        if position < 0:
            position += len(self)
        if not 0 <= position < len(self):
            raise IndexError(f"sample {position} of {len(self)}")
        return SampleEntry(
            self.shard_of(position),
            self.offsets[position],
            self.sizes[position],
            self.labels[position],
            str(self.names[position]),
        )


@dataclass(frozen=True)
class ShardIndex:
    """One split's index: which shard holds each sample, where, and its label. `samples` may be given as any
    sequence of entries in shard order; it is held as a `SampleTable` (`table`)."""

    classes: list[str]
    shards: list[ShardInfo]
    samples: Sequence[SampleEntry]
    # Set by the agent in the copy it leaves in the job's data folder (bootstrap/datasync.py): where the
    # shards are (s3://bucket/data/train; "" = beside the index) and the instance's cache folder for them.
    source: str = ""
    cache_dir: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.samples, SampleTable):
            object.__setattr__(self, "samples", SampleTable.from_entries(self.samples, len(self.shards)))
        if len(self.table.counts) != len(self.shards):
            raise ValueError(f"a table of {len(self.table.counts)} shards for {len(self.shards)} listed")

    @property
    def table(self) -> SampleTable:
        assert isinstance(self.samples, SampleTable)  # made one by __post_init__
        return self.samples

    def to_json(self) -> dict[str, Any]:
        placed = {"source": self.source, "cache_dir": self.cache_dir} if self.source else {}
        return {
            "format": INDEX_FORMAT,
            "classes": self.classes,
            "shards": [
                {"key": s.key, "size": s.size, "sha256": s.sha256, "samples": count}
                | ({"etag": s.etag} if s.etag else {})
                for s, count in zip(self.shards, self.table.counts, strict=True)
            ],
            **self.table.to_json(),
            **placed,
        }

    @classmethod
    def from_json(cls, body: bytes, where: str) -> ShardIndex:
        try:
            raw = json.loads(body)
            known = (INDEX_FORMAT, FIRST_INDEX_FORMAT)
            if raw.get("format") not in known:
                raise ShardError(f"{where}: format {raw.get('format')!r}, expected {INDEX_FORMAT!r}; {_FIX}")
            shards = [
                ShardInfo(str(s["key"]), int(s["size"]), str(s["sha256"]), str(s.get("etag") or ""))
                for s in raw["shards"]
            ]
            if raw["format"] == FIRST_INDEX_FORMAT:
                entries = (
                    SampleEntry(int(a), int(b), int(c), int(d), str(e)) for a, b, c, d, e in raw["samples"]
                )
                samples = SampleTable.from_entries(entries, len(shards))
            else:
                counts = [int(s["samples"]) for s in raw["shards"]]
                if any(count < 0 for count in counts):
                    raise ValueError("a shard's count of samples is below 0")
                samples = SampleTable.from_json(raw, counts)
            classes = [str(c) for c in raw["classes"]]
            if samples.labels and max(samples.labels) >= len(classes):
                raise ValueError(f"a label of {max(samples.labels)} is past the {len(classes)} classes")
            source, cache_dir = str(raw.get("source") or ""), str(raw.get("cache_dir") or "")
        except ShardError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as error:
            problem = f"{type(error).__name__}: {error}"
            raise ShardError(f"{where}: not a shard index ({problem}); {_FIX}") from None
        return cls(classes, shards, samples, source, cache_dir)

    def shard_sizes(self) -> list[int]:
        """Samples per shard, in shard order (the samples are numbered shard by shard)."""
        return list(self.table.counts)


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
