"""trainstack_job/shards.py's writer and readers: shards cut at their size, byte-identical for identical
files, members in webdataset's layout; one sample read by its place, a shard read whole."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from trainstack_job.shards import INDEX_NAME, SampleEntry, ShardError, iter_shard, read_sample, write_split


def files(folder: Path, names: list[str], size: int = 10) -> list[tuple[str, int]]:
    """`names` (relative paths) of `size` bytes each under `folder`, labelled by their class folder."""
    listed = []
    for name in names:
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(name.encode().ljust(size, b".")[:size])
        listed.append((name, 0 if name.startswith("a/") else 1))
    return listed


NAMES = [f"{c}/{n}.png" for c in "ab" for n in range(6)]


@pytest.mark.parametrize(("shard_bytes", "counts"), [(30, [3, 3, 3, 3]), (21, [3, 3, 3, 3]), (10, [1] * 12)])
def test_a_shard_is_closed_once_its_images_reach_the_shard_size(
    tmp_path: Path, shard_bytes: int, counts: list[int]
) -> None:
    index = write_split(
        tmp_path / "in", ["a", "b"], files(tmp_path / "in", NAMES), tmp_path / "out", shard_bytes
    )
    assert index.shard_sizes() == counts
    assert [s.key for s in index.shards] == [f"shard-{n:06d}.tar" for n in range(len(counts))]
    for info in index.shards:
        body = (tmp_path / "out" / info.key).read_bytes()
        assert (info.size, info.sha256) == (len(body), hashlib.sha256(body).hexdigest())


def test_samples_are_mixed_across_classes_in_a_fixed_order_of_their_names_hashes(tmp_path: Path) -> None:
    index = write_split(tmp_path / "in", ["a", "b"], files(tmp_path / "in", NAMES), tmp_path / "out", 10**6)
    order = [entry.name for entry in index.samples]
    assert order == sorted(NAMES, key=lambda name: hashlib.sha256(name.encode()).hexdigest())
    assert order != sorted(NAMES)
    # The index on disk is compact JSON: no space after a separator.
    text = (tmp_path / "out" / INDEX_NAME).read_text()
    assert json.loads(text)["names"] == order and ", " not in text and '": ' not in text


def test_the_same_files_written_again_into_the_same_folder_are_the_same_bytes(tmp_path: Path) -> None:
    listed = files(tmp_path / "in", NAMES)
    first = write_split(tmp_path / "in", ["a", "b"], listed, tmp_path / "out", 30)
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    (tmp_path / "in" / NAMES[0]).touch()  # a newer mtime changes nothing stored
    again = write_split(tmp_path / "in", ["a", "b"], listed, tmp_path / "out", 30)
    assert again == first and {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    with tarfile.open(tmp_path / "out" / first.shards[0].key) as tar:
        members = tar.getmembers()
    assert {(m.mtime, m.mode, m.uid, m.gid, m.uname) for m in members} == {(0, 0o644, 0, 0, "")}


def test_members_are_named_by_position_with_the_images_extension_in_lower_case(tmp_path: Path) -> None:
    listed = files(tmp_path / "in", ["a/x.PNG", "b/noext"])
    index = write_split(tmp_path / "in", ["a", "b"], listed, tmp_path / "out", 10**6)
    with tarfile.open(tmp_path / "out" / index.shards[0].key) as tar:
        names = sorted(m.name for m in tar.getmembers())
    positions = {entry.name: n for n, entry in enumerate(index.samples)}
    x, plain = f"{positions['a/x.PNG']:09d}", f"{positions['b/noext']:09d}"
    assert names == sorted([f"{x}.png", f"{x}.cls", f"{plain}.img", f"{plain}.cls"])


def test_one_sample_is_read_by_its_place_and_a_short_shard_is_named(tmp_path: Path) -> None:
    index = write_split(tmp_path / "in", ["a", "b"], files(tmp_path / "in", NAMES), tmp_path / "out", 10**6)
    entry = index.samples[4]
    with (tmp_path / "out" / index.shards[0].key).open("rb") as shard:
        assert read_sample(shard, entry) == (tmp_path / "in" / entry.name).read_bytes()
    short = SampleEntry(0, 100, 50, 0, "a/9.png")
    with pytest.raises(ShardError) as raised:
        read_sample(io.BytesIO(b"x" * 120), short)
    assert str(raised.value) == "sample a/9.png: shard ends before its 50 bytes at 100"


def test_a_shard_read_whole_gives_each_sample_its_label_keyed_before_the_first_dot(tmp_path: Path) -> None:
    path = tmp_path / "own.tar"
    with tarfile.open(path, "w") as tar:
        folder = tarfile.TarInfo("extras")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)  # not a file: skipped, the samples after it still read
        for name, data in [("0001.input.png", b"one"), ("0001.cls", b"3"), ("0002.jpg", b"two")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    # webdataset's key is the name up to its first dot: 0001.input.png belongs with 0001.cls.
    assert list(iter_shard(path)) == [("0001.input.png", b"one", 3), ("0002.jpg", b"two", None)]
