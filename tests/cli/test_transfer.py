"""`trainstack data push` of the default dataset (the built-in trainer's ImageFolder) and `results pull`:
layout checked first, unchanged skipped, training protected. Any files, named datasets, versions and faults:
tests/cli/test_data_push.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tools import require_module
from trainstack.datasets import IMG_EXTENSIONS, validate_image_folder
from trainstack.errors import CliError

from .conftest import BUCKET, Deployed


def make_dataset(root: Path, classes: dict[str, list[str]] | None = None) -> Path:
    layout = classes or {"cat": ["1.jpg", "2.png"], "dog": ["1.jpg"]}
    for split in ("train", "val"):
        for name, files in layout.items():
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for file in files:
                (folder / file).write_bytes(f"{split}/{name}/{file}".encode() * 100)
    return root


def _keys(deployed: Deployed, prefix: str) -> list[str]:
    listed = deployed.s3().list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"] for o in listed.get("Contents", []))


def test_cli_accepts_exactly_the_extensions_imagefolder_loads():
    require_module("torchvision", "its ImageFolder defines the extensions the trainer loads (the dev extras)")
    from torchvision.datasets import folder

    assert set(IMG_EXTENSIONS) == set(folder.IMG_EXTENSIONS)


def test_push_uploads_the_dataset_encrypted_with_the_stack_key(deployed: Deployed, tmp_path: Path):
    dataset = make_dataset(tmp_path / "ds")
    (dataset / "train" / "cat" / ".DS_Store").write_bytes(b"junk")

    result = deployed.run("data", "push", str(dataset), "--json")

    assert result.code == 0, result.err
    summary = result.json()
    assert summary["uploaded"] == 6 and summary["unchanged"] == 0 and summary["classes"] == ["cat", "dog"]
    assert _keys(deployed, "data/") == [
        f"data/{split}/{name}"
        for split in ("train", "val")
        for name in ("cat/1.jpg", "cat/2.png", "dog/1.jpg")
    ]
    head = deployed.s3().head_object(Bucket=BUCKET, Key="data/train/cat/1.jpg")
    assert head["ServerSideEncryption"] == "aws:kms"
    assert head["SSEKMSKeyId"] == deployed.kms_key_arn
    body = deployed.s3().get_object(Bucket=BUCKET, Key="data/val/dog/1.jpg")["Body"].read()
    assert body == (dataset / "val" / "dog" / "1.jpg").read_bytes()


def test_push_again_uploads_only_what_changed(deployed: Deployed, tmp_path: Path):
    dataset = make_dataset(tmp_path / "ds")
    deployed.run("data", "push", str(dataset))
    (dataset / "train" / "dog" / "1.jpg").write_bytes(b"a new dog")

    again = deployed.run("data", "push", str(dataset), "--json").json()

    assert (again["uploaded"], again["unchanged"]) == (1, 5)
    body = deployed.s3().get_object(Bucket=BUCKET, Key="data/train/dog/1.jpg")["Body"].read()
    assert body == b"a new dog"


def test_push_reuploads_an_object_replaced_behind_its_back(deployed: Deployed, tmp_path: Path):
    dataset = make_dataset(tmp_path / "ds")
    deployed.run("data", "push", str(dataset))
    deployed.s3().put_object(Bucket=BUCKET, Key="data/val/cat/2.png", Body=b"someone else's file")

    again = deployed.run("data", "push", str(dataset), "--json").json()

    assert again["uploaded"] == 1
    body = deployed.s3().get_object(Bucket=BUCKET, Key="data/val/cat/2.png")["Body"].read()
    assert body == (dataset / "val" / "cat" / "2.png").read_bytes()


def test_push_delete_removes_files_the_dataset_no_longer_has(deployed: Deployed, tmp_path: Path):
    dataset = make_dataset(tmp_path / "ds")
    deployed.run("data", "push", str(dataset))
    (dataset / "train" / "cat" / "2.png").unlink()

    kept = deployed.run("data", "push", str(dataset))
    assert "1 remote file(s) not in DIR kept, outside the version (--delete removes them)" in kept.out
    assert "data/train/cat/2.png" in _keys(deployed, "data/")

    deleted = deployed.run("data", "push", str(dataset), "--delete", "--json").json()
    assert deleted["deleted"] == 1
    assert "data/train/cat/2.png" not in _keys(deployed, "data/")


def test_push_refuses_to_replace_the_dataset_while_training_runs(deployed: Deployed, tmp_path: Path):
    dataset = make_dataset(tmp_path / "ds")
    deployed.launch_instance()
    deployed.put_state("ledger.json", {"status": "running", "lives": []})

    refused = deployed.run("data", "push", str(dataset))

    assert refused.code == 1
    assert refused.err.count("\n") == 1
    assert "training is running on 1 instance(s) of trainstack-test-gpu (job legacy)" in refused.err
    assert "`trainstack stop` first, or pass --force" in refused.err
    assert _keys(deployed, "data/") == []

    forced = deployed.run("data", "push", str(dataset), "--force")
    assert forced.code == 0, forced.err
    assert len(_keys(deployed, "data/")) == 6


def test_push_feeds_an_instance_that_waits_for_its_first_dataset(deployed: Deployed, tmp_path: Path):
    dataset = make_dataset(tmp_path / "ds")
    deployed.launch_instance()
    deployed.put_state("ledger.json", {"status": "waiting_for_data", "lives": []})

    pushed = deployed.run("data", "push", str(dataset))

    assert pushed.code == 0, pushed.err
    assert len(_keys(deployed, "data/")) == 6


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda root: __import__("shutil").rmtree(root / "val"), "no val/ folder"),
        (lambda root: (root / "val" / "bird").mkdir(), "no image files"),
        (lambda root: make_dataset(root, {"bird": ["1.jpg"]}), "only in train/: -; only in val/: -"),
    ],
    ids=["missing-val", "empty-class", "same-classes-passes"],
)
def test_layout_problems_are_named_before_anything_is_uploaded(tmp_path: Path, damage, message: str):
    root = make_dataset(tmp_path / "ds")
    damage(root)
    if message.startswith("only in"):
        assert validate_image_folder(root) == ["bird", "cat", "dog"]
        return
    with pytest.raises(CliError, match=message):
        validate_image_folder(root)


def test_push_of_mismatched_classes_is_one_line_listing_them(deployed: Deployed, tmp_path: Path):
    root = make_dataset(tmp_path / "ds")
    (root / "train" / "bird").mkdir()
    (root / "train" / "bird" / "1.jpg").write_bytes(b"x")
    (root / "val" / "dog").rename(root / "val" / "wolf")

    result = deployed.run("data", "push", str(root))

    assert result.code == 1
    assert result.err == (
        f"trainstack: error: dataset {root}: train/ and val/ must have the same class folders "
        "(only in train/: bird, dog; only in val/: wolf) (checked because the built-in trainer reads the "
        "default dataset; a job of your own reads any files: pass --layout any)\n"
    )


def test_results_pull_downloads_then_skips_what_is_already_here(deployed: Deployed, tmp_path: Path):
    s3 = deployed.s3()
    s3.put_object(Bucket=BUCKET, Key="results/model.pt", Body=b"weights" * 1000)
    s3.put_object(Bucket=BUCKET, Key="results/metrics.json", Body=json.dumps({"val_acc": 0.9}).encode())
    s3.put_object(Bucket=BUCKET, Key="results/plots/curves.png", Body=b"png")
    target = tmp_path / "out"

    first = deployed.run("results", "pull", str(target))

    assert first.code == 0, first.err
    assert "3 file(s) downloaded" in first.out
    assert (target / "model.pt").read_bytes() == b"weights" * 1000
    assert json.loads((target / "metrics.json").read_text()) == {"val_acc": 0.9}
    assert (target / "plots" / "curves.png").is_file()

    second = deployed.run("results", "pull", str(target), "--json").json()
    assert (second["downloaded"], second["unchanged"]) == (0, 3)


def test_results_pull_before_completion_says_so(deployed: Deployed, tmp_path: Path):
    deployed.put_state("ledger.json", {"status": "running", "lives": []})
    result = deployed.run("results", "pull", str(tmp_path / "out"))
    assert result.code == 1
    expected = "no results yet in s3://trainstack-test-data/results/ (job legacy: training is running)"
    assert expected in result.err


def test_push_leaves_hidden_files_and_folders_out(deployed: Deployed, tmp_path: Path):
    dataset = make_dataset(tmp_path / "ds")
    for junk in (
        "train/.ipynb_checkpoints/1.jpg",
        "train/__MACOSX/cat/._1.jpg",
        "train/cat/._1.jpg",
        "val/dog/.thumbnails/1.png",
        "val/__MACOSX/dog/1.jpg",
    ):
        (dataset / junk).parent.mkdir(parents=True, exist_ok=True)
        (dataset / junk).write_bytes(b"not part of the dataset")

    result = deployed.run("data", "push", str(dataset), "--json")

    assert result.code == 0, result.err
    assert result.json()["classes"] == ["cat", "dog"]
    assert _keys(deployed, "data/") == [
        f"data/{split}/{name}"
        for split in ("train", "val")
        for name in ("cat/1.jpg", "cat/2.png", "dog/1.jpg")
    ]


def test_a_class_folder_with_only_hidden_images_is_empty(tmp_path: Path):
    dataset = make_dataset(tmp_path / "ds")
    for split in ("train", "val"):
        (dataset / split / "bird" / ".ipynb_checkpoints").mkdir(parents=True)
        (dataset / split / "bird" / ".ipynb_checkpoints" / "1.jpg").write_bytes(b"x")
    with pytest.raises(CliError, match=r"train/bird: no image files"):
        validate_image_folder(dataset)


def test_the_cli_shares_the_hidden_path_rule_without_importing_torch():
    code = "import sys, trainstack.datapush, trainstack.datasets; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False, timeout=60).returncode == 0
