"""`trainstack data push DIR --name`, `data list`: any files, only what changed is sent, a version is the hash
of its files and is published only once every file is there; an upload failing mid-push, a corrupt manifest,
links leaving DIR and unreadable files are each one line."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError

from trainstack import datapush
from trainstack.aws import Clients
from trainstack.datasets import check_image_folder, require_image_folder, require_pushed
from trainstack.errors import CliError
from trainstack.stack import StackOutputs
from trainstack_job.datasets import DatasetPlace, parse_manifest

from .conftest import BUCKET, Deployed

MANIFEST = "state/datasets/corpus.json"
PREFIX = "datasets/corpus/"
FILES = {
    "shards/train-000.jsonl": b'{"text": "spot"}\n' * 50,
    "shards/train-001.jsonl": b'{"text": "gpu"}\n' * 40,
    "tokenizer/vocab.txt": b"a\nb\nc\n",
    "README": b"any files at all",
}


def write(root: Path, files: dict[str, bytes]) -> Path:
    for relative, body in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_bytes(body)
    return root


def expected_version(files: dict[str, bytes]) -> str:
    """The documented formula, computed here independently of trainstack_job/datasets.py."""
    lines = "".join(
        f"{path}\t{len(body)}\t{hashlib.sha256(body).hexdigest()}\n" for path, body in sorted(files.items())
    )
    return hashlib.sha256(lines.encode()).hexdigest()


def keys(deployed: Deployed, prefix: str) -> list[str]:
    listed = deployed.s3().list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"] for o in listed.get("Contents", []))


def manifest(deployed: Deployed, key: str = MANIFEST) -> dict[str, Any]:
    return dict(json.loads(deployed.s3().get_object(Bucket=BUCKET, Key=key)["Body"].read()))


class Counted:
    """An S3 client that records every upload it starts and can fail the ones `fail` picks."""

    def __init__(self, deployed: Deployed, fail: Callable[[str], bool] = lambda key: False) -> None:
        self.client = deployed.s3()
        self.uploads: list[str] = []
        self._fail = fail
        for operation in ("PutObject", "CreateMultipartUpload"):
            self.client.meta.events.register(f"provide-client-params.s3.{operation}", self._upload)

    def _upload(self, params: dict[str, Any], **kwargs: Any) -> None:
        key = str(params["Key"])
        if self._fail(key):
            error = {"Error": {"Code": "InternalError", "Message": "We encountered an internal error"}}
            raise ClientError(error, "PutObject")  # type: ignore[arg-type]
        self.uploads.append(key)

    def files(self) -> list[str]:
        """The dataset's files sent (the manifest is written last, by put_object too)."""
        return [key for key in self.uploads if key.startswith(PREFIX)]

    def clients(self) -> Clients:
        return Clients(None, overrides={"s3": self.client})


def test_any_files_become_a_named_dataset_whose_version_is_the_hash_of_its_files(
    deployed: Deployed, tmp_path: Path
) -> None:
    folder = write(tmp_path / "corpus", FILES)

    result = deployed.run("data", "push", str(folder), "--name", "corpus", "--json")

    assert result.code == 0, result.err
    summary = result.json()
    assert (summary["uploaded"], summary["unchanged"], summary["classes"]) == (4, 0, None)
    assert summary["version"] == expected_version(FILES)
    assert keys(deployed, PREFIX) == sorted(PREFIX + path for path in FILES)
    assert keys(deployed, "data/") == []  # the default dataset is another one
    published = manifest(deployed)
    assert published["version"] == expected_version(FILES) and published["dataset"] == "corpus"
    for path, entry in published["files"].items():
        head = deployed.s3().head_object(Bucket=BUCKET, Key=PREFIX + path)
        assert entry["etag"] == head["ETag"] and entry["size"] == len(FILES[path])
        assert head["Metadata"]["sha256"] == entry["sha256"] == hashlib.sha256(FILES[path]).hexdigest()
        assert head["ServerSideEncryption"] == "aws:kms"


def test_a_second_push_of_an_unchanged_folder_uploads_nothing_and_says_so(
    deployed: Deployed, tmp_path: Path
) -> None:
    folder = write(tmp_path / "corpus", FILES)
    deployed.run("data", "push", str(folder), "--name", "corpus")
    before = deployed.s3().head_object(Bucket=BUCKET, Key=MANIFEST)["ETag"]
    counted = Counted(deployed)

    again = deployed.run("data", "push", str(folder), "--name", "corpus", clients=counted.clients())

    assert again.code == 0, again.err
    assert counted.uploads == []  # neither a file nor the manifest
    version = expected_version(FILES)[:12]
    assert f"dataset 'corpus' is unchanged at version {version}: nothing to upload (4 file(s)" in again.out
    assert deployed.s3().head_object(Bucket=BUCKET, Key=MANIFEST)["ETag"] == before  # not rewritten

    (folder / "tokenizer" / "vocab.txt").write_bytes(b"a\nb\nc\nd\n")
    changed = deployed.run(
        "data", "push", str(folder), "--name", "corpus", "--json", clients=counted.clients()
    ).json()
    assert counted.files() == [PREFIX + "tokenizer/vocab.txt"]
    assert (changed["uploaded"], changed["unchanged"]) == (1, 3)
    assert changed["previous_version"] == expected_version(FILES)
    assert changed["version"] == expected_version({**FILES, "tokenizer/vocab.txt": b"a\nb\nc\nd\n"})


def test_dry_run_says_what_would_be_sent_and_changes_nothing(deployed: Deployed, tmp_path: Path) -> None:
    folder = write(tmp_path / "corpus", FILES)

    result = deployed.run("data", "push", str(folder), "--name", "corpus", "--dry-run")

    assert result.code == 0, result.err
    assert "4 file(s) would be uploaded" in result.out
    assert f"would be version {expected_version(FILES)[:12]}" in result.out
    assert keys(deployed, "") == []


def test_delete_removes_what_dir_no_longer_has_and_without_it_says_how_many(
    deployed: Deployed, tmp_path: Path
) -> None:
    folder = write(tmp_path / "corpus", FILES)
    deployed.run("data", "push", str(folder), "--name", "corpus")
    (folder / "README").unlink()

    kept = deployed.run("data", "push", str(folder), "--name", "corpus")
    assert "1 remote file(s) not in DIR kept, outside the version (--delete removes them)" in kept.out
    assert PREFIX + "README" in keys(deployed, PREFIX)
    assert "README" not in manifest(deployed)["files"]

    deleted = deployed.run("data", "push", str(folder), "--name", "corpus", "--delete", "--json").json()
    assert (deleted["deleted"], deleted["uploaded"]) == (1, 0)
    assert keys(deployed, PREFIX) == sorted(PREFIX + p for p in FILES if p != "README")


def test_an_upload_failing_mid_push_keeps_the_previous_version_and_the_next_push_sends_the_rest(
    deployed: Deployed, tmp_path: Path
) -> None:
    folder = write(tmp_path / "corpus", FILES)
    deployed.run("data", "push", str(folder), "--name", "corpus")
    old = manifest(deployed)
    changed = {
        **FILES,
        "shards/train-000.jsonl": b"new shard 0\n" * 30,
        "shards/train-001.jsonl": b"new shard 1\n" * 30,
        "shards/train-002.jsonl": b"new shard 2\n" * 30,
    }
    write(folder, changed)
    flaky = Counted(deployed, fail=lambda key: key.endswith("train-001.jsonl"))

    failed = deployed.run("data", "push", str(folder), "--name", "corpus", clients=flaky.clients())

    assert failed.code == 1
    assert failed.err.count("\n") == 1
    assert "1 of 3 upload(s) failed: shards/train-001.jsonl (" in failed.err
    assert f"dataset 'corpus' stays at version {old['version'][:12]}" in failed.err
    assert "run the same push again to send the rest" in failed.err
    assert manifest(deployed) == old  # the version still names the files it listed

    counted = Counted(deployed)
    again = deployed.run("data", "push", str(folder), "--name", "corpus", "--json", clients=counted.clients())

    assert again.code == 0, again.err
    assert counted.files() == [PREFIX + "shards/train-001.jsonl"]  # what arrived before is not sent again
    assert again.json()["version"] == manifest(deployed)["version"] == expected_version(changed)
    body = deployed.s3().get_object(Bucket=BUCKET, Key=PREFIX + "shards/train-001.jsonl")["Body"].read()
    assert body == changed["shards/train-001.jsonl"]


def test_a_corrupt_manifest_is_one_line_naming_the_key_and_the_fix(
    deployed: Deployed, tmp_path: Path
) -> None:
    folder = write(tmp_path / "corpus", FILES)
    deployed.run("data", "push", str(folder), "--name", "corpus")
    deployed.s3().put_object(Bucket=BUCKET, Key=MANIFEST, Body=b'{"files": {"README": {"size": "big"')

    for argv in (("data", "push", str(folder), "--name", "corpus"), ("data", "list")):
        result = deployed.run(*argv)
        assert result.code == 1
        assert result.err.count("\n") == 1
        assert f"s3://{BUCKET}/{MANIFEST} is not a dataset manifest" in result.err
        assert "delete it and push the dataset again (trainstack data push DIR --name corpus)" in result.err

    deployed.s3().delete_object(Bucket=BUCKET, Key=MANIFEST)
    counted = Counted(deployed)
    repaired = deployed.run("data", "push", str(folder), "--name", "corpus", clients=counted.clients())
    assert repaired.code == 0, repaired.err
    assert counted.uploads == [MANIFEST]  # every file recognised by its content


def test_data_list_shows_each_dataset_with_version_files_size_and_when(
    deployed: Deployed, tmp_path: Path
) -> None:
    write(tmp_path / "corpus", FILES)
    deployed.run("data", "push", str(tmp_path / "corpus"), "--name", "corpus")
    deployed.s3().put_object(Bucket=BUCKET, Key="data/train/a.txt", Body=b"synced by hand")

    listed = deployed.run("data", "list", "--json").json()

    default, corpus = listed
    assert default["name"] == "" and default["version"] is None  # aws s3 sync: no manifest
    assert corpus["name"] == "corpus" and corpus["version"] == expected_version(FILES)
    assert (corpus["files"], corpus["bytes"]) == (4, sum(len(b) for b in FILES.values()))
    assert corpus["prefix"] == f"s3://{BUCKET}/{PREFIX}" and corpus["pushed_at"]
    table = deployed.run("data", "list").out
    assert "corpus" in table and expected_version(FILES)[:12] in table and "unversioned" in table


def test_links_leaving_dir_and_unreadable_files_are_named_before_anything_is_sent(
    deployed: Deployed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = write(tmp_path / "corpus", FILES)
    (tmp_path / "secret.txt").write_text("not the dataset's")
    (folder / "leak.txt").symlink_to(tmp_path / "secret.txt")
    (folder / "readme-link").symlink_to(folder / "README")  # inside DIR: pushed as a file of its own
    (folder / "shards" / "loop").symlink_to(folder)  # a linked folder inside DIR: its files are pushed once
    (folder / "outside").symlink_to(tmp_path, target_is_directory=True)

    leaving = deployed.run("data", "push", str(folder), "--name", "corpus")
    assert leaving.code == 1 and leaving.err.count("\n") == 1
    assert f"2 symbolic link(s) lead outside it: outside -> {tmp_path}, " in leaving.err
    assert f"leak.txt -> {tmp_path / 'secret.txt'}; copy those files into the folder or remove" in leaving.err
    assert keys(deployed, "") == []

    (folder / "leak.txt").unlink()
    (folder / "outside").unlink()
    (folder / "tokenizer" / "merges.txt").symlink_to(folder / "gone")
    real_sha256 = datapush.sha256_file

    def unreadable(path: Path) -> str:
        if path.name == "train-000.jsonl":
            raise PermissionError(13, "Permission denied", str(path))
        return real_sha256(path)

    monkeypatch.setattr(datapush, "sha256_file", unreadable)
    refused = deployed.run("data", "push", str(folder), "--name", "corpus")
    assert refused.code == 1 and refused.err.count("\n") == 1
    assert "cannot read 2 file(s): tokenizer/merges.txt (broken link)" in refused.err
    assert "shards/train-000.jsonl (Permission denied)" in refused.err
    assert keys(deployed, "") == []

    (folder / "tokenizer" / "merges.txt").unlink()
    monkeypatch.setattr(datapush, "sha256_file", real_sha256)
    pushed = deployed.run("data", "push", str(folder), "--name", "corpus", "--json")
    assert pushed.code == 0, pushed.err
    body = deployed.s3().get_object(Bucket=BUCKET, Key=PREFIX + "readme-link")["Body"].read()
    assert body == FILES["README"]
    assert keys(deployed, PREFIX) == sorted(PREFIX + p for p in [*FILES, "readme-link"])


def test_the_default_dataset_of_a_users_job_takes_any_files(deployed: Deployed, tmp_path: Path) -> None:
    job = "charlm-1a2b3c4d"
    s3 = deployed.s3()
    s3.put_object(Bucket=BUCKET, Key="state/current-job.json", Body=json.dumps({"job_id": job}).encode())
    record = {"job_id": job, "agent": {"user_job": {"command": ["python", "train.py"]}, "dataset": ""}}
    s3.put_object(Bucket=BUCKET, Key=f"jobs/{job}/job.json", Body=json.dumps(record).encode())

    result = deployed.run("data", "push", str(write(tmp_path / "corpus", FILES)), "--json")

    assert result.code == 0, result.err
    assert result.json()["classes"] is None
    assert keys(deployed, "data/") == sorted("data/" + path for path in FILES)
    assert manifest(deployed, "state/data-manifest.json")["version"] == expected_version(FILES)


def test_a_named_dataset_may_be_pushed_while_a_job_trains_on_the_default_one(
    deployed: Deployed, tmp_path: Path
) -> None:
    deployed.launch_instance()
    deployed.put_state("ledger.json", {"status": "running", "lives": []})

    result = deployed.run("data", "push", str(write(tmp_path / "corpus", FILES)), "--name", "corpus")

    assert result.code == 0, result.err


def test_run_config_checks_a_pushed_version_as_an_image_folder(deployed: Deployed, tmp_path: Path) -> None:
    outputs = StackOutputs(deployed.outputs, "test")
    clients = Clients("us-east-1")
    with pytest.raises(CliError, match=r"dataset 'images' has no pushed version .*--name images`"):
        require_image_folder(clients, outputs, "images")
    with pytest.raises(CliError, match=r"^the default dataset has no pushed version"):
        require_pushed(clients, outputs)
    images = {f"{split}/{c}/1.png": b"png" for split in ("train", "val") for c in ("cat", "dog")}
    deployed.run("data", "push", str(write(tmp_path / "images", images)), "--name", "images")
    deployed.run("data", "push", str(write(tmp_path / "corpus", FILES)), "--name", "corpus")

    assert require_image_folder(clients, outputs, "images").version == expected_version(images)
    with pytest.raises(CliError, match=rf"dataset s3://{BUCKET}/{PREFIX[:-1]}: no train/ folder"):
        require_image_folder(clients, outputs, "corpus")
    place = DatasetPlace.of("images")
    only_train = parse_manifest(json.dumps({"files": {}}).encode(), place, "x")
    with pytest.raises(CliError, match="no train/ folder"):
        check_image_folder(only_train, "x")


def test_bad_dataset_names_are_refused_in_one_line(deployed: Deployed, tmp_path: Path) -> None:
    result = deployed.run("data", "push", str(tmp_path), "--name", "../state")
    assert result.code == 1
    assert "dataset: '../state' is not a dataset name" in result.err
    assert keys(deployed, "") == []
