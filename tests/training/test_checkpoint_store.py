"""Checkpoint store: atomic local layout, S3 upload order, keep-K, and restore that never loads a bad one."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import boto3
import pytest
import torch

from bootstrap.persist import CheckpointPersister
from bootstrap.standalone import s3_persister
from tests.training.conftest import TINY, Dataset
from training.checkpoint import CheckpointManager

BUCKET = "trainstack-test"


def by_hand(root: Path, uri: str, keep: int = 3) -> CheckpointManager:
    """The checkpoints of a trainer run by hand with checkpoint.uri: bootstrap/standalone.py gives it the
    agent's persister."""
    return CheckpointManager(root, uri, keep, persister_factory=s3_persister)


def state_for(step: int) -> dict[str, object]:
    return {"weights": torch.full((1000,), float(step)), "train": {"global_step": step}}


def save_steps(manager: CheckpointManager, *steps: int) -> None:
    for step in steps:
        manager.save(state_for(step), step=step, epoch=0, world_size=1, config_hash="h")
        assert manager.wait_uploaded(timeout=30)


@pytest.fixture()
def bucket(aws: object) -> str:
    boto3.client("s3").create_bucket(Bucket=BUCKET)
    return f"s3://{BUCKET}/checkpoints"


def read_latest() -> dict[str, object]:
    body = boto3.client("s3").get_object(Bucket=BUCKET, Key="checkpoints/latest.json")["Body"].read()
    value: dict[str, object] = json.loads(body)
    return value


def s3_keys() -> list[str]:
    response = boto3.client("s3").list_objects_v2(Bucket=BUCKET)
    return sorted(item["Key"] for item in response.get("Contents", []))


def test_local_save_writes_the_design_layout_and_keeps_last_k(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep=2)
    save_steps(manager, 10, 20, 30)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.json", "step-20", "step-30"]
    manifest = json.loads((tmp_path / "step-30" / "manifest.json").read_text())
    assert manifest["step"] == 30 and manifest["world_size"] == 1 and manifest["config_hash"] == "h"
    assert set(manifest["files"]["state.pt"]) == {"sha256", "size"}
    latest = json.loads((tmp_path / "latest.json").read_text())
    assert (
        latest["step"] == 30 and latest["dir"] == "step-30" and latest["epoch"] == 0 and latest["written_at"]
    )


@pytest.mark.parametrize("damage", ["flip-a-byte", "truncate", "delete-manifest"])
def test_corrupted_latest_is_skipped_for_the_previous_good_checkpoint(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    save_steps(CheckpointManager(tmp_path, keep=3), 10, 20)
    broken = tmp_path / "step-20"
    data = (broken / "state.pt").read_bytes()
    if damage == "flip-a-byte":
        (broken / "state.pt").write_bytes(data[:-100] + bytes([data[-100] ^ 0xFF]) + data[-99:])
    elif damage == "truncate":
        (broken / "state.pt").write_bytes(data[: len(data) // 2])
    else:
        (broken / "manifest.json").unlink()
    with caplog.at_level(logging.WARNING):
        restored = CheckpointManager(tmp_path).restore()
    assert restored is not None and restored.step == 10
    assert torch.equal(restored.load_state()["weights"], torch.full((1000,), 10.0))
    assert "skipping local checkpoint step 20" in caplog.text


def test_s3_upload_order_layout_and_keep_k(tmp_path: Path, bucket: str) -> None:
    manager = by_hand(tmp_path, bucket, keep=2)
    save_steps(manager, 1, 2, 3)
    assert manager.finish(timeout=10)
    assert s3_keys() == [
        "checkpoints/latest.json",
        "checkpoints/step-2/manifest.json",
        "checkpoints/step-2/state.pt",
        "checkpoints/step-3/manifest.json",
        "checkpoints/step-3/state.pt",
    ]
    latest = read_latest()
    assert latest["step"] == 3 and latest["dir"] == "step-3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.json", "step-2", "step-3"]


def test_a_new_instance_restores_from_s3(tmp_path: Path, bucket: str) -> None:
    save_steps(by_hand(tmp_path / "first-life", bucket), 5, 7)
    restored = by_hand(tmp_path / "replacement", bucket).restore()
    assert restored is not None and restored.step == 7
    assert restored.directory == tmp_path / "replacement" / "step-7"
    assert torch.equal(restored.load_state()["weights"], torch.full((1000,), 7.0))


def test_s3_checksum_mismatch_skips_that_checkpoint(
    tmp_path: Path, bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    save_steps(by_hand(tmp_path / "first-life", bucket, keep=3), 5, 7)
    s3 = boto3.client("s3")
    key = "checkpoints/step-7/state.pt"
    good = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    # Same size, one byte different: only the manifest's sha256 can tell.
    s3.put_object(Bucket=BUCKET, Key=key, Body=good[:-1] + bytes([good[-1] ^ 0x01]))
    with caplog.at_level(logging.WARNING):
        restored = by_hand(tmp_path / "replacement", bucket).restore()
    assert restored is not None and restored.step == 5
    assert "step=7" in caplog.text and "sha256 mismatch" in caplog.text
    assert not (tmp_path / "replacement" / "step-7").exists()


def test_a_trainer_run_by_hand_exits_truthfully_when_s3_never_confirms(tmp_path: Path, bucket: str) -> None:
    manager = by_hand(tmp_path / "first-life", bucket)
    save_steps(manager, 5)

    def s3_unreachable(**_: object) -> None:
        raise ConnectionError("S3 unreachable")

    # From here on every upload of this trainer's persister fails, as in an outage that outlasts the stop.
    assert isinstance(manager.persister, CheckpointPersister)
    manager.persister._s3.meta.events.register("before-call.s3.PutObject", s3_unreachable)
    manager.save(state_for(9), step=9, epoch=0, world_size=1, config_hash="h")
    assert manager.finish(timeout=2) is False
    assert read_latest()["step"] == 5
    restored = by_hand(tmp_path / "replacement", bucket).restore()
    assert restored is not None and restored.step == 5


def test_local_checkpoint_newer_than_s3_is_uploaded_on_restore(tmp_path: Path, bucket: str) -> None:
    save_steps(by_hand(tmp_path, bucket), 5)
    save_steps(CheckpointManager(tmp_path), 8)  # a life that was killed before its upload
    manager = by_hand(tmp_path, bucket)
    restored = manager.restore()
    assert restored is not None and restored.step == 8
    assert manager.wait_uploaded(timeout=30)
    assert read_latest()["step"] == 8


def test_checkpoint_uri_without_a_persister_is_refused(tmp_path: Path) -> None:
    """The trainer never imports the agent's persister: without one given, it cannot upload, and says so."""
    with pytest.raises(ValueError, match="no persister to upload with"):
        CheckpointManager(tmp_path, "s3://job/checkpoints")


def test_python_m_training_names_the_entry_point_that_uploads(
    tmp_path: Path, bucket: str, image_folders: Dataset, capsys: pytest.CaptureFixture[str]
) -> None:
    """`python -m training` with checkpoint.uri: one config error naming `python -m bootstrap.standalone`,
    which runs the same trainer with the agent's persister."""
    from training.__main__ import NO_PERSISTER, main

    overrides = [*image_folders.overrides(), f"checkpoint.dir={tmp_path}", f"checkpoint.uri={bucket}"]
    assert main(["--config", str(TINY), *overrides]) == 2
    assert capsys.readouterr().err.splitlines() == [f"config error: {NO_PERSISTER}"]
