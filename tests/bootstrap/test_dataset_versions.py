"""Dataset versions on the instance: exactly one version's files are synced, a push in progress is waited for,
the version is recorded in the job's ledger, a second job on the same version syncs nothing, and a job's
checkpoints are never resumed on another version unless the job allows it."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from s3transfer.utils import OSUtils

from bootstrap.datasync import MANIFEST_NAME, DataSync, DiskSpaceError
from bootstrap.eventlog import EventLog
from bootstrap.lifecycle import InstanceLife
from demo.stack import LocalStack
from tests.waiting import join_all
from trainstack_job.datasets import DatasetPlace, Manifest, ManifestFile

MakeLife = Callable[..., InstanceLife]
CORPUS = {f"shards/{i:03d}.bin": bytes([i]) * (100 + i) for i in range(6)}


def publish(stack: LocalStack, name: str, files: dict[str, bytes]) -> str:
    """What `trainstack data push` leaves: the files, then the manifest naming them. Returns the version."""
    where = DatasetPlace.of(name)
    s3 = stack.client("s3")
    entries = {}
    for path, body in files.items():
        etag = s3.put_object(Bucket=stack.bucket, Key=where.prefix + path, Body=body)["ETag"]
        entries[path] = ManifestFile(len(body), hashlib.sha256(body).hexdigest(), etag)
    manifest = Manifest(name, entries, pushed_at="2026-01-01T00:00:00+00:00")
    body = json.dumps(manifest.to_json(where.prefix)).encode()
    s3.put_object(Bucket=stack.bucket, Key=where.manifest_key, Body=body)
    return manifest.version


def _entries(files: dict[str, bytes]) -> dict[str, ManifestFile]:
    return {path: ManifestFile(len(body), hashlib.sha256(body).hexdigest()) for path, body in files.items()}


def sync_of(stack: LocalStack, name: str, **settle: float) -> DataSync:
    where = DatasetPlace.of(name)
    return DataSync(
        stack.client("s3"),
        stack.bucket,
        where.prefix,
        stack.region,
        EventLog(),
        manifest_key=where.manifest_key,
        dataset=name,
        **settle,
    )


def files(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and p.name != MANIFEST_NAME
    }


def test_a_named_dataset_syncs_exactly_its_versions_files_and_the_same_version_again_fetches_nothing(
    stack: LocalStack, tmp_path: Path
) -> None:
    version = publish(stack, "corpus", CORPUS)
    s3 = stack.client("s3")
    # Kept in the bucket by a push without --delete, and another dataset whose name starts the same.
    s3.put_object(Bucket=stack.bucket, Key="datasets/corpus/old-shard.bin", Body=b"not in the version")
    publish(stack, "corpus-b", {"other.bin": b"b"})
    sync = sync_of(stack, "corpus")

    assert sync.present()
    first = sync.sync(tmp_path / "data", tool="boto3")

    assert (first.version, first.dataset, first.files, first.skipped) == (version, "corpus", 6, False)
    assert files(tmp_path / "data") == CORPUS
    again = sync.sync(tmp_path / "data", tool="boto3")
    assert (again.skipped, again.files, again.version) == (True, 6, version)
    assert not sync_of(stack, "never-pushed").present()


def test_a_push_in_progress_is_waited_for_and_the_new_version_synced_whole(
    stack: LocalStack, tmp_path: Path
) -> None:
    publish(stack, "corpus", CORPUS)
    # The next push has replaced one file but not yet written its manifest.
    changed = {**CORPUS, "shards/002.bin": b"pushed next"}
    s3 = stack.client("s3")
    s3.put_object(Bucket=stack.bucket, Key="datasets/corpus/shards/002.bin", Body=changed["shards/002.bin"])
    finisher = threading.Timer(0.4, publish, (stack, "corpus", changed))
    finisher.start()

    report = sync_of(stack, "corpus", settle_poll_seconds=0.1).sync(tmp_path / "data", tool="boto3")

    join_all([finisher], 30, "the push the sync waited for")
    assert files(tmp_path / "data") == changed
    assert report.version == Manifest("corpus", _entries(changed)).version


def test_a_push_that_stopped_half_way_is_one_line_naming_the_file_and_the_fix(
    stack: LocalStack, tmp_path: Path
) -> None:
    publish(stack, "corpus", CORPUS)
    stack.client("s3").put_object(Bucket=stack.bucket, Key="datasets/corpus/shards/004.bin", Body=b"half")
    sync = sync_of(stack, "corpus", settle_seconds=0.3, settle_poll_seconds=0.1)

    with pytest.raises(RuntimeError) as error:
        sync.sync(tmp_path / "data", tool="boto3")

    message = str(error.value)
    assert "\n" not in message
    assert f"s3://{stack.bucket}/datasets/corpus/shards/004.bin (and 0 more) is not the file" in message
    assert "run `trainstack data push DIR --name corpus` again" in message
    assert files(tmp_path / "data") == {}


def test_a_corrupt_manifest_is_one_line_naming_the_key_and_the_fix(stack: LocalStack, tmp_path: Path) -> None:
    publish(stack, "corpus", CORPUS)
    key = "state/datasets/corpus.json"
    stack.client("s3").put_object(Bucket=stack.bucket, Key=key, Body=b"{not json")

    with pytest.raises(RuntimeError) as error:
        sync_of(stack, "corpus").sync(tmp_path / "data", tool="boto3")

    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"s3://{stack.bucket}/{key} is not a dataset manifest (")
    assert message.endswith(
        "delete it and push the dataset again (trainstack data push DIR --name corpus): files already "
        "there are recognised by their content and not sent again"
    )


def test_a_manifest_written_before_versions_still_syncs_as_a_version(
    stack: LocalStack, tmp_path: Path
) -> None:
    s3 = stack.client("s3")
    old: dict[str, Any] = {"files": {}, "classes": ["c"], "pushed_at": "2025-06-01T00:00:00+00:00"}
    for path, body in CORPUS.items():
        etag = s3.put_object(Bucket=stack.bucket, Key=f"data/{path}", Body=body)["ETag"]
        old["files"][f"data/{path}"] = {
            "size": len(body),
            "sha256": hashlib.sha256(body).hexdigest(),
            "etag": etag,
        }
    _write(stack, "state/data-manifest.json", old)

    report = DataSync.for_dataset(s3, stack.agent_config(), "", EventLog()).sync(
        tmp_path / "data", tool="boto3"
    )

    assert report.version == Manifest("", _entries(CORPUS)).version
    assert files(tmp_path / "data") == CORPUS


class _FullDisk(io.FileIO):
    """A download's temp file on a disk that has just filled up."""

    def write(self, data: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_disk_that_fills_during_the_sync_gives_the_disk_space_line_and_leaves_nothing(
    stack: LocalStack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    publish(stack, "corpus", CORPUS)
    monkeypatch.setattr(OSUtils, "open", lambda self, filename, mode: _FullDisk(filename, "w"))
    destination = tmp_path / "data"

    with pytest.raises(DiskSpaceError) as error:
        sync_of(stack, "corpus").sync(destination, tool="boto3")

    assert str(error.value).startswith(f"not enough disk space in {destination}: ran out during the sync: ")
    assert str(error.value).endswith("; raise trainstack:rootVolumeSizeGb")
    assert [p for p in destination.rglob("*") if p.is_file()] == []


def _ledger(stack: LocalStack, job: str = "legacy") -> dict[str, Any]:
    key = "state/ledger.json" if job == "legacy" else f"jobs/{job}/state/ledger.json"
    ledger = stack.read_json(key)
    assert ledger is not None
    return ledger


def test_a_job_records_the_version_it_trained_on_and_the_next_life_on_that_instance_syncs_nothing(
    make_life: MakeLife, stack: LocalStack, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    version = publish(stack, "corpus", CORPUS)
    scratch = str(tmp_path / "instance")
    # The legacy job: a job with an id runs the definition its first life recorded (the crash below).
    job = {"dataset": "corpus", "scratch_dir": scratch}

    assert make_life(fake={"steps": 5, "crash_at_step": 2}, **job).run().outcome == "failed"

    entry = _ledger(stack)["dataset"]
    assert (entry["name"], entry["version"]) == ("corpus", version) and entry["synced_at"]
    assert files(tmp_path / "instance" / "data") == CORPUS
    capsys.readouterr()
    assert make_life(fake={"steps": 3}, **job).run().outcome == "completed"
    assert '"dataset already in sync; skipped"' in capsys.readouterr().out


def test_another_job_on_the_same_version_keeps_the_local_copy(stack: LocalStack, tmp_path: Path) -> None:
    publish(stack, "corpus", CORPUS)
    config = stack.agent_config()
    destination = tmp_path / "data"
    for job, skipped in (("first-00000001", False), ("second-00000002", True)):
        sync = DataSync.for_dataset(stack.client("s3"), config, "corpus", EventLog())
        report = sync.sync(destination, tool="boto3")
        assert report.skipped is skipped, job
    assert files(destination) == CORPUS


def _write(stack: LocalStack, key: str, value: dict[str, Any]) -> None:
    stack.client("s3").put_object(Bucket=stack.bucket, Key=key, Body=json.dumps(value).encode())


def test_checkpoints_are_not_resumed_on_another_version_of_the_dataset(
    make_life: MakeLife, stack: LocalStack
) -> None:
    old = "ab" * 32
    _write(
        stack,
        "state/ledger.json",
        {"status": "running", "lives": [], "dataset": {"name": "", "version": old}},
    )
    _write(stack, "checkpoints/latest.json", {"step": 5, "dir": "step-5"})
    new = publish(stack, "", CORPUS)

    life = make_life(fake={"steps": 3})
    result = life.run()

    assert (result.outcome, result.exit_code) == ("gave_up", 0), "permanent: no other instance can fix it"
    assert stack.group()["DesiredCapacity"] == 0
    (alert,) = stack.alerts()
    line = (
        f"job legacy: its checkpoints were trained on the default dataset version {old[:12]}, but "
        f"s3://{stack.bucket} now holds version {new[:12]}"
    )
    assert line in alert["Message"]
    assert f"push version {old[:12]} back (`trainstack data push DIR` with its files)" in alert["Message"]
    assert "resubmit the job with `allow_data_change: true` in its agent config" in alert["Message"]
    ledger = _ledger(stack)
    assert ledger["status"] == "failed" and ledger["dataset"]["version"] == old
    assert not (Path(str(life.config.scratch_dir)) / "data" / "shards").exists(), "refused before the sync"


def test_a_job_allowed_to_change_data_resumes_its_checkpoint_on_the_new_version(
    make_life: MakeLife, stack: LocalStack, capsys: pytest.CaptureFixture[str]
) -> None:
    first_version = publish(stack, "", CORPUS)
    first = make_life(fake={"steps": 30, "checkpoint_every": 5, "crash_at_step": 7})
    assert first.run().outcome == "failed"
    latest = stack.read_json("checkpoints/latest.json")
    assert latest is not None and latest["step"] == 5
    second_version = publish(stack, "", {**CORPUS, "shards/006.bin": b"more data"})

    capsys.readouterr()
    second = make_life(fake={"steps": 8, "checkpoint_every": 5}, allow_data_change=True)
    assert second.run().outcome == "completed"

    out = capsys.readouterr().out
    assert "changed under the job's checkpoints; resuming them anyway (allow_data_change)" in out
    assert json.dumps({"event": "resumed", "step": 5}) in out
    entry = _ledger(stack)["dataset"]
    assert (entry["version"], entry["previous_version"]) == (second_version, first_version)


def test_a_job_without_a_checkpoint_simply_starts_on_the_version_it_finds(
    make_life: MakeLife, stack: LocalStack
) -> None:
    old = "cd" * 32
    _write(
        stack,
        "state/ledger.json",
        {"status": "running", "lives": [], "dataset": {"name": "", "version": old}},
    )
    new = publish(stack, "", CORPUS)

    assert make_life(fake={"steps": 3}).run().outcome == "completed"

    assert _ledger(stack)["dataset"]["version"] == new


def test_an_unknown_dataset_version_in_the_agent_config_is_one_line() -> None:
    from bootstrap.agent_config import AgentConfig, AgentConfigError

    base = {"region": "us-east-1", "bucket": "b-data", "group_name": "g", "topic_arn": "t", "log_group": "l"}
    with pytest.raises(AgentConfigError) as error:
        AgentConfig.from_mapping(
            {**base, "dataset": "Bad Name", "dataset_version": "v1", "allow_data_change": "yes"}
        )
    message = str(error.value)
    assert "'dataset': 'Bad Name' is not a dataset name" in message
    assert "'dataset_version': 'v1' is not a dataset version" in message
    assert "'allow_data_change' must be true or false" in message
    config = AgentConfig.from_mapping({**base, "dataset": "corpus", "dataset_version": "ab" * 6})
    assert (config.dataset, config.dataset_version, config.allow_data_change) == ("corpus", "ab" * 6, False)


def index_of(size: int) -> bytes:
    """A split's index listing its one shard, shard-000000.tar, and one more that was never pushed."""
    shards = [{"key": "shard-000000.tar", "size": size, "sha256": "0" * 64}, {"key": "gone.tar", "size": 1}]
    return json.dumps(
        {"format": "trainstack-shards/1", "classes": ["a"], "shards": shards, "samples": []}
    ).encode()


SHARDED = {
    "train/shards.json": index_of(300),
    "train/shard-000000.tar": b"t" * 300,
    "val/shards.json": index_of(200),
    "val/shard-000000.tar": b"v" * 200,
}


def test_a_version_pushed_as_shards_is_streamed_its_indexes_placed_and_no_shard_fetched(
    stack: LocalStack, tmp_path: Path
) -> None:
    """Issue 35: the built-in trainer (or a job.yaml with data.mode: stream) starts on the shard indexes; the
    indexes name the shards' S3 prefix and the instance's cache folder; the version is still checked."""
    version = publish(stack, "images", SHARDED)
    dataset = sync_of(stack, "images")
    dataset.stream_cache = tmp_path / "cache"
    checked: list[str] = []

    report = dataset.sync(tmp_path / "data", check_version=checked.append)

    assert (report.tool, report.files, report.version, checked) == ("stream", 2, version, [version])
    assert sorted(files(tmp_path / "data")) == ["train/shards.json", "val/shards.json"]
    placed = json.loads((tmp_path / "data" / "train" / "shards.json").read_text())
    prefix = DatasetPlace.of("images").prefix
    assert placed["source"] == f"s3://{stack.bucket}/{prefix}train"
    assert placed["cache_dir"] == str(tmp_path / "cache") and (tmp_path / "cache").is_dir()
    assert placed["classes"] == ["a"]
    # Each shard carries its own split's object's ETag (the manifest's, checked against S3), so the trainer's
    # downloads are pinned to the pushed bytes; a shard the version does not hold gets none.
    s3 = stack.client("s3")
    for split in ("train", "val"):
        placed = json.loads((tmp_path / "data" / split / "shards.json").read_text())
        etag = s3.head_object(Bucket=stack.bucket, Key=f"{prefix}{split}/shard-000000.tar")["ETag"]
        assert [shard.get("etag") for shard in placed["shards"]] == [etag, None]
    assert placed["shards"][0]["size"] == 200  # val's own index, not train's


def test_only_an_etag_the_push_recorded_pins_a_shard_and_none_once_the_version_moved_on(
    stack: LocalStack, tmp_path: Path
) -> None:
    """A manifest entry without an ETag (pushed before manifests kept them) is not the push's word for the
    bytes its index hashed: that shard is placed unpinned (the trainer hashes it), even though S3's listing
    has an ETag for it. A version that moved on after the check pins nothing."""
    from bootstrap.datasync import RemoteDataset

    where = DatasetPlace.of("images")
    s3 = stack.client("s3")
    entries = {}
    for path, body in SHARDED.items():
        etag = s3.put_object(Bucket=stack.bucket, Key=where.prefix + path, Body=body)["ETag"]
        known = None if path == "val/shard-000000.tar" else etag
        entries[path] = ManifestFile(len(body), hashlib.sha256(body).hexdigest(), known)
    manifest = Manifest("images", entries, pushed_at="2026-01-01T00:00:00+00:00")
    published = json.dumps(manifest.to_json(where.prefix))
    s3.put_object(Bucket=stack.bucket, Key=where.manifest_key, Body=published)
    dataset = sync_of(stack, "images")
    dataset.stream_cache = tmp_path / "cache"

    dataset.sync(tmp_path / "data")

    def placed(split: str) -> list[Any]:
        index = json.loads((tmp_path / "data" / split / "shards.json").read_text())
        return [shard.get("etag") for shard in index["shards"]]

    train_etag = s3.head_object(Bucket=stack.bucket, Key=f"{where.prefix}train/shard-000000.tar")["ETag"]
    assert placed("train") == [train_etag, None] and placed("val") == [None, None]
    moved_on = RemoteDataset("0" * 12, dataset.remote().files)
    assert dataset._pushed_etags(moved_on) == {}
    assert dataset._pushed_etags(dataset.remote())["train/shard-000000.tar"] == train_etag


def test_a_version_pushed_as_files_is_synced_whole_even_when_streaming_is_allowed(
    stack: LocalStack, tmp_path: Path
) -> None:
    publish(stack, "corpus", CORPUS)
    dataset = sync_of(stack, "corpus")
    dataset.stream_cache = tmp_path / "cache"
    report = dataset.sync(tmp_path / "data", tool="boto3")
    assert report.tool == "boto3" and files(tmp_path / "data") == CORPUS
    assert not (tmp_path / "cache").exists()


def test_job_yaml_chooses_stream_or_sync_and_sync_stays_the_default() -> None:
    from trainstack_job.jobfile import JobSpec, JobSpecError

    def spec(data: object) -> JobSpec:
        return JobSpec.from_mapping({"name": "j", "command": ["python", "t.py"], "data": data}, "job.yaml")

    assert (spec(None).data_mode, spec(None).data_sync) == ("sync", True)
    assert spec(None).to_mapping()["data"] == {"sync": True}  # the definition (and job id) it always had
    streamed = spec({"mode": "stream"})
    assert streamed.data_mode == "stream"
    assert streamed.to_mapping()["data"] == {"sync": True, "mode": "stream"}
    assert JobSpec.from_mapping(streamed.to_mapping(), "agent config").data_mode == "stream"
    known = r"^job.yaml: data: only \{sync: true\|false, mode: sync\|stream\}"
    with pytest.raises(JobSpecError, match=known):
        spec({"mode": "mount"})
    with pytest.raises(JobSpecError, match=r"^job.yaml: data: mode: stream with sync: false; drop one"):
        spec({"mode": "stream", "sync": False})
