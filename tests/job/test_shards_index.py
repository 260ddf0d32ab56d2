"""trainstack_job/shards.py's index: the columns it is stored as, the first format it still reads, and the
one-line error for an index that cannot be used."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from trainstack_job.shards import (
    FIRST_INDEX_FORMAT,
    INDEX_FORMAT,
    SampleEntry,
    SampleTable,
    ShardError,
    ShardIndex,
    ShardInfo,
)

FIX = "push the dataset again with `trainstack data push DIR --format shards`"
SHARDS = [ShardInfo(f"shard-{n:06d}.tar", 100 + n, f"{n}" * 64) for n in range(3)]
# Shard 1 holds no sample: numbering goes on across it.
ENTRIES = [
    SampleEntry(0, 512, 10, 1, "cat/1.jpg"),
    SampleEntry(0, 1536, 20, 0, "dog/2.jpg"),
    SampleEntry(2, 512, 2**31 + 5, 1, "cat/ü 3.jpg"),
]


def index() -> ShardIndex:
    return ShardIndex(["dog", "cat"], SHARDS, ENTRIES, "s3://b/data/train", "/nvme/cache")


def test_the_index_is_written_as_columns_with_each_shards_count() -> None:
    written = index().to_json()
    assert written["format"] == INDEX_FORMAT == "trainstack-shards/2"
    assert [s["samples"] for s in written["shards"]] == [2, 0, 1]
    assert written["names"] == ["cat/1.jpg", "dog/2.jpg", "cat/ü 3.jpg"]
    # Little-endian whatever the machine: 8-byte offsets, 4-byte sizes and labels.
    assert base64.b64decode(written["offsets"]) == b"".join(o.to_bytes(8, "little") for o in (512, 1536, 512))
    assert base64.b64decode(written["sizes"]) == b"".join(
        s.to_bytes(4, "little") for s in (10, 20, 2**31 + 5)
    )
    assert base64.b64decode(written["labels"]) == b"".join(x.to_bytes(4, "little") for x in (1, 0, 1))
    assert (written["source"], written["cache_dir"]) == ("s3://b/data/train", "/nvme/cache")
    assert "samples" not in written


def test_an_index_reads_back_as_the_same_entries_numbered_shard_after_shard() -> None:
    again = ShardIndex.from_json(json.dumps(index().to_json()).encode(), "train")
    assert again == index()
    assert list(again.samples) == ENTRIES
    assert again.shard_sizes() == [2, 0, 1]
    assert [again.table.shard_of(i) for i in range(3)] == [0, 0, 2]
    assert again.samples[-1] == ENTRIES[2] and again.samples[1:] == ENTRIES[1:]
    with pytest.raises(IndexError, match=r"^sample 3 of 3$"):
        again.samples[3]
    assert (again.source, again.cache_dir) == ("s3://b/data/train", "/nvme/cache")


def test_an_index_of_the_first_format_still_reads_as_the_same_index() -> None:
    first = {
        "format": FIRST_INDEX_FORMAT,
        "classes": ["dog", "cat"],
        "shards": [{"key": s.key, "size": s.size, "sha256": s.sha256} for s in SHARDS],
        "samples": [[e.shard, e.offset, e.size, e.label, e.name] for e in ENTRIES],
        "source": "s3://b/data/train",
        "cache_dir": "/nvme/cache",
    }
    assert ShardIndex.from_json(json.dumps(first).encode(), "train") == index()


OFFSETS = index().to_json()["offsets"]


def damaged(change: dict[str, Any]) -> bytes:
    return json.dumps({**index().to_json(), **change}).encode()


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"format": "trainstack-shards/9"}, "format 'trainstack-shards/9', expected 'trainstack-shards/2'"),
        ({"names": ["cat/1.jpg"]}, "not a shard index (ValueError: 3 offsets, 3 sizes, 3 labels and 1 names"),
        ({"names": "cat/1.jpg"}, "not a shard index (TypeError: names is a str, not a list)"),
        ({"offsets": "not base64!"}, "not a shard index (ValueError: offsets is not base64 ("),
        ({"sizes": base64.b64encode(b"\0" * 8).decode()}, "sizes holds 2 values, the shards' counts 3"),
        (
            {"labels": base64.b64encode(b"\0" * 8 + b"\2\0\0\0").decode()},
            "a label of 2 is past the 2 classes",
        ),
        (
            {"shards": [{**s, "samples": -1} for s in index().to_json()["shards"]]},
            "(ValueError: a shard's count of samples is below 0)",
        ),
        ({"offsets": OFFSETS[:8] + "*" + OFFSETS[8:]}, "(ValueError: offsets is not base64"),
        (
            {"labels": base64.b64encode(b"\0" * 8).decode()},
            "(ValueError: labels holds 2 values, the shards' counts 3)",
        ),
        ({"offsets": None}, "not a shard index (TypeError: "),
    ],
)
def test_a_damaged_index_is_refused_in_one_line_naming_it_and_the_fix(
    change: dict[str, Any], problem: str
) -> None:
    with pytest.raises(ShardError) as raised:
        ShardIndex.from_json(damaged(change), "s3://b/data/train/shards.json")
    message = str(raised.value)
    assert message.startswith("s3://b/data/train/shards.json: ") and problem in message
    assert message.endswith(FIX) and "\n" not in message


@pytest.mark.parametrize(
    ("samples", "problem"),
    [
        ([[0, 1, 1, 0, "a"], [5, 1, 1, 0, "b"]], "sample b names shard 5: not one of the 3 listed"),
        (
            [[2, 1, 1, 0, "a"], [0, 1, 1, 0, "b"]],
            "sample b names shard 0: not one of the 3 listed, or out of",
        ),
        ([[0, -1, 1, 0, "a"]], "OverflowError"),
    ],
)
def test_a_first_format_index_with_a_sample_out_of_place_is_refused(samples: list[Any], problem: str) -> None:
    first = {**index().to_json(), "format": FIRST_INDEX_FORMAT, "samples": samples}
    with pytest.raises(ShardError) as raised:
        ShardIndex.from_json(json.dumps(first).encode(), "train")
    assert problem in str(raised.value) and str(raised.value).endswith(FIX)


def test_an_index_the_agent_has_not_placed_says_nothing_of_where_its_shards_are() -> None:
    pushed = ShardIndex(["dog", "cat"], SHARDS, ENTRIES)
    written = pushed.to_json()
    assert "source" not in written and "cache_dir" not in written
    again = ShardIndex.from_json(json.dumps(written).encode(), "train")
    assert (again.source, again.cache_dir) == ("", "")


def test_a_big_endian_machine_stores_the_same_little_endian_bytes_and_reads_them_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from array import array

    import trainstack_job.shards as shards

    column = array("I", [1, 2**24])
    native = column.tobytes()  # this machine's: little-endian
    monkeypatch.setattr(shards.sys, "byteorder", "big")  # as if its native order were the other
    text = shards._encode(column)
    assert list(column) == [1, 2**24] and column.tobytes() == native  # the caller's column is left alone
    # A big-endian machine swaps its native bytes into little-endian ones: here, pretending, into swapped.
    assert base64.b64decode(text) == bytes([0, 0, 0, 1, 1, 0, 0, 0])
    assert list(shards._decode("I", text, 2, "sizes")) == [1, 2**24]


def test_a_table_must_hold_one_value_of_each_column_per_sample_and_one_count_per_shard() -> None:
    table = SampleTable.from_entries(ENTRIES, 3)
    assert table.counts == [2, 0, 1] and table.starts == [0, 2, 2, 3] and len(table) == 3
    with pytest.raises(ValueError, match="for 2 listed"):
        ShardIndex(["dog", "cat"], SHARDS[:2], table)
    with pytest.raises(ValueError) as raised:
        SampleTable([2, 1], table.offsets, table.sizes, table.labels, ["one name"])
    assert str(raised.value) == "3 offsets, 3 sizes, 3 labels and 1 names for the shards' 3 samples"
    with pytest.raises(ValueError, match="names shard 3: not one of the 3 listed"):
        SampleTable.from_entries([SampleEntry(3, 0, 1, 0, "past")], 3)
    assert table != SampleTable.from_entries(ENTRIES[:2], 3) and table == SampleTable.from_entries(ENTRIES, 3)
    assert table.__eq__(ENTRIES) is NotImplemented


def test_a_shards_etag_placed_by_the_agent_is_written_and_read_back_and_none_is_written_unplaced() -> None:
    pinned = [
        SHARDS[0],
        ShardInfo(SHARDS[1].key, SHARDS[1].size, SHARDS[1].sha256, '"9b2cf535f27731c9"'),
        SHARDS[2],
    ]
    placed = ShardIndex(["dog", "cat"], pinned, ENTRIES, "s3://b/data/train", "/nvme/cache")
    written = placed.to_json()
    assert [s.get("etag") for s in written["shards"]] == [None, '"9b2cf535f27731c9"', None]
    again = ShardIndex.from_json(json.dumps(written).encode(), "train")
    assert [s.etag for s in again.shards] == ["", '"9b2cf535f27731c9"', ""] and again == placed
    assert all("etag" not in s for s in index().to_json()["shards"])  # as pushed: no ETag known yet
