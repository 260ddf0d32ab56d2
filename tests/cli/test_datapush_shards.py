"""`trainstack data push DIR --format shards`: an ImageFolder pushed as tar shards plus one index per split,
versioned by the manifest like any push; unchanged images send nothing again, and `trainstack run --config`
accepts the sharded version as the built-in trainer's dataset."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trainstack import datapush
from trainstack.aws import Clients
from trainstack.datasets import require_image_folder
from trainstack.errors import CliError
from trainstack.stack import Stack, StackOutputs
from trainstack_job.shards import INDEX_NAME, ShardIndex

from .conftest import BUCKET, Deployed

SHARD_BYTES = 4_000


def images(root: Path) -> Path:
    for split, count in (("train", 6), ("val", 2)):
        for name in ("cat", "dog"):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for number in range(count):
                (folder / f"{number}.png").write_bytes(f"{split}/{name}/{number}".encode() * 100)
    (root / "train" / "cat" / ".DS_Store").write_bytes(b"never data")
    return root


def push(deployed: Deployed, root: Path, layout: str = "auto") -> dict[str, Any]:
    stack = Stack("test", project_dir=deployed.project, outputs_file=deployed.outputs_file)
    return datapush.push(
        Clients("us-east-1"),
        stack,
        root,
        name="images",
        format="shards",
        shard_bytes=SHARD_BYTES,
        quiet=True,
        layout=layout,
    )


def test_an_image_folder_is_pushed_as_shards_with_an_index_and_versioned(
    deployed: Deployed, tmp_path: Path
) -> None:
    root = images(tmp_path / "images")

    summary = push(deployed, root)

    assert summary["format"] == "shards" and summary["classes"] == ["cat", "dog"]
    s3 = deployed.s3()
    manifest = json.loads(s3.get_object(Bucket=BUCKET, Key="state/datasets/images.json")["Body"].read())
    files = sorted(manifest["files"])
    assert f"train/{INDEX_NAME}" in files and f"val/{INDEX_NAME}" in files
    assert all(f.endswith((".tar", INDEX_NAME)) for f in files)
    index = ShardIndex.from_json(
        s3.get_object(Bucket=BUCKET, Key=f"datasets/images/train/{INDEX_NAME}")["Body"].read(), "train"
    )
    assert len(index.shards) > 1 and len(index.samples) == 12  # .DS_Store left out
    assert sorted(f"train/{s.key}" for s in index.shards) == [
        f for f in files if f.startswith("train/shard-")
    ]
    outputs = StackOutputs(deployed.outputs, "test")
    assert require_image_folder(Clients("us-east-1"), outputs, "images").version == summary["version"]

    again = push(deployed, root)
    assert (again["uploaded"], again["changed"], again["version"]) == (0, False, summary["version"])

    (root / "train" / "dog" / "9.png").write_bytes(b"a new image" * 50)
    changed = push(deployed, root)
    assert changed["changed"] and changed["version"] != summary["version"]
    assert changed["uploaded"] < len(files)  # shards without the new image are not sent again


def test_shards_need_an_image_folder(deployed: Deployed, tmp_path: Path) -> None:
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("text")
    with pytest.raises(CliError, match=r"no train/ folder"):
        push(deployed, tmp_path / "corpus")
    with pytest.raises(CliError, match=r"^--format shards needs an ImageFolder .*drop --layout any$"):
        push(deployed, tmp_path / "corpus", layout="any")
    with pytest.raises(CliError, match=r"^--format zip: not one of files, shards"):
        datapush.push(
            Clients("us-east-1"),
            Stack("test", project_dir=deployed.project, outputs_file=deployed.outputs_file),
            tmp_path,
            format="zip",
        )


def test_the_command_line_pushes_shards_with_format_shards(deployed: Deployed, tmp_path: Path) -> None:
    """`trainstack data push DIR --format shards` reaches the shard writer (at its default shard size: one
    shard a split here), and the version's manifest lists each split's index next to its shards."""
    root = images(tmp_path / "images")

    result = deployed.run("data", "push", str(root), "--name", "images", "--format", "shards", "--json")

    assert result.code == 0, result.err
    assert result.json()["format"] == "shards"
    s3 = deployed.s3()
    manifest = json.loads(s3.get_object(Bucket=BUCKET, Key="state/datasets/images.json")["Body"].read())
    for split in ("train", "val"):
        assert f"{split}/{INDEX_NAME}" in manifest["files"]
        assert f"{split}/shard-000000.tar" in manifest["files"]


def test_the_agent_places_the_pushed_etags_and_the_trainer_reads_every_shard_pinned_unhashed(
    deployed: Deployed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole chain: the push's manifest records each shard's ETag, the agent's stream places them in the
    index it leaves, and the trainer's cache downloads each shard with If-Match on them: every image byte for
    byte, no shard hashed again."""
    from bootstrap.datasync import DataSync
    from bootstrap.eventlog import EventLog
    from tests.training.conftest import hash_counter
    from training.streaming import CacheSettings, ShardFolder
    from trainstack_job.datasets import DatasetPlace
    from trainstack_job.shards import read_sample

    root = images(tmp_path / "images")
    push(deployed, root)
    where = DatasetPlace.of("images")
    agent = DataSync(
        deployed.s3(),
        BUCKET,
        where.prefix,
        "us-east-1",
        EventLog(),
        manifest_key=where.manifest_key,
        dataset="images",
    )
    assert agent.stream(tmp_path / "data", tmp_path / "nvme") is not None
    hashed = hash_counter(monkeypatch)

    folder = ShardFolder(str(tmp_path / "data" / "train" / INDEX_NAME), CacheSettings())
    assert folder.index.shards and all(shard.etag for shard in folder.index.shards)
    for name, _ in folder.samples:
        entry = folder.entry(name)
        with folder.cache.path(entry.shard).open("rb") as shard:
            assert read_sample(shard, entry) == (root / "train" / entry.name).read_bytes()
    assert hashed == []
    # Fetched into the instance store's folder the agent named, one file per shard.
    assert len(list((tmp_path / "nvme").glob("*.tar"))) == len(folder.index.shards)
