"""The code bundle is reproducible, and a change of the agent's code rolls a new key and a new launch-template
version (a job's code never does: tests/infra/test_default_job.py)."""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import shutil
import tarfile
from pathlib import Path
from typing import Any

import pytest

import infra.bundle
from infra.bundle import BUNDLED_PACKAGES, CodeBundle, build_bundle
from tests.infra.program import REPO_ROOT, StackRun, run_stack


def _copy_sources(destination: Path) -> Path:
    for package in BUNDLED_PACKAGES:
        shutil.copytree(
            REPO_ROOT / package, destination / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    return destination


def test_same_sources_give_the_same_bundle_bytes_and_sha(tmp_path: Path) -> None:
    first = build_bundle(_copy_sources(tmp_path / "a"))
    second = build_bundle(_copy_sources(tmp_path / "b"))
    assert first.data == second.data
    assert first.sha256 == second.sha256 == build_bundle().sha256


def test_a_changed_file_gives_a_new_sha_and_key(tmp_path: Path) -> None:
    root = _copy_sources(tmp_path)
    before = build_bundle(root)
    target = root / "bootstrap" / "__init__.py"
    target.write_text(target.read_text() + "\n# changed\n")
    after = build_bundle(root)
    assert after.sha256 != before.sha256
    assert after.key() != before.key()
    assert after.key() == f"code/{after.sha256}/bundle.tar.gz"


def test_the_same_archive_is_compressed_once_to_the_same_bytes(tmp_path: Path) -> None:
    root = _copy_sources(tmp_path)
    memo = infra.bundle._compressed
    memo.cache_clear()
    first = build_bundle(root)
    second = build_bundle(root)
    assert (memo.cache_info().misses, memo.cache_info().hits) == (1, 1)
    archive = gzip.decompress(first.data)
    fresh = memo.__wrapped__(archive)  # compressed anew, past the memo
    assert second.data == first.data == fresh.data
    assert second.sha256 == first.sha256 == fresh.sha256 == hashlib.sha256(fresh.data).hexdigest()
    target = root / "training" / "__init__.py"
    target.write_text(target.read_text() + "\n# changed\n")
    changed = build_bundle(root)
    assert memo.cache_info().misses == 2, "a changed file is a new archive, compressed anew"
    assert changed.sha256 != first.sha256 and gzip.decompress(changed.data) != archive
    assert changed.sha256 == hashlib.sha256(changed.data).hexdigest()


def test_caches_do_not_change_the_bundle(tmp_path: Path) -> None:
    root = _copy_sources(tmp_path)
    before = build_bundle(root)
    (root / "training" / "__pycache__").mkdir(exist_ok=True)
    (root / "training" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")
    (root / "training" / "notes.swp").write_text("editor droppings")
    assert build_bundle(root).sha256 == before.sha256


def _agent_bundle(stack: StackRun) -> dict[str, Any]:
    (bundle,) = [r for r in stack.of_type("aws:s3/bucketObjectv2:BucketObjectv2") if r.name == "fleet-bundle"]
    return bundle.inputs


def _bundle_and_user_data(stack: StackRun) -> tuple[str, str]:
    bundle = _agent_bundle(stack)
    return bundle["key"], stack.one("aws:ec2/launchTemplate:LaunchTemplate").inputs["userData"]


def test_bundle_is_uploaded_content_addressed_with_the_stack_key(example_stack: StackRun) -> None:
    bundle = _agent_bundle(example_stack)
    expected = build_bundle()
    assert bundle["key"] == expected.key()
    assert base64.b64decode(bundle["contentBase64"]) == expected.data
    assert bundle["serverSideEncryption"] == "aws:kms"
    assert bundle["kmsKeyId"] == example_stack.outputs["kms_key_arn"]


def test_a_code_change_rolls_new_user_data(
    example_stack: StackRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _copy_sources(tmp_path)
    (root / "training" / "__init__.py").write_text("# a new trainer release\n")
    changed = build_bundle(root)

    def build_changed(root_dir: Path = REPO_ROOT, job_dir: Path | None = None) -> CodeBundle:
        return changed

    monkeypatch.setattr(infra.bundle, "build_bundle", build_changed)
    key, user_data = _bundle_and_user_data(run_stack())
    old_key, old_user_data = _bundle_and_user_data(example_stack)
    assert key == changed.key() != old_key
    assert user_data != old_user_data
    assert changed.sha256 in base64.b64decode(user_data).decode()


def test_a_users_job_travels_under_job_and_its_run_folders_stay_behind(tmp_path: Path) -> None:
    job = tmp_path / "myjob"
    (job / "checkpoints" / "step-1").mkdir(parents=True)
    (job / "checkpoints" / "step-1" / "state.pt").write_bytes(b"x")
    (job / ".ipynb_checkpoints").mkdir()
    (job / ".ipynb_checkpoints" / "train-checkpoint.py").write_text("old")
    (job / "train.py").write_text("print('hi')\n")
    (job / "corpus.txt").write_text("text")
    bundle = build_bundle(job_dir=job)
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(bundle.data))) as tar:
        names = tar.getnames()
    assert {"job/train.py", "job/corpus.txt", "trainstack_job/contract.py"} <= set(names)
    assert not any(n.startswith(("job/checkpoints", "job/.ipynb")) for n in names)
    (job / "train.py").write_text("print('changed')\n")
    assert build_bundle(job_dir=job).sha256 != bundle.sha256, "a job change is a new content-addressed bundle"


def test_a_job_workdir_holding_a_dataset_is_refused_at_preview(tmp_path: Path) -> None:
    (tmp_path / "job.yaml").write_text("name: big\ncommand: [python, train.py]\n")
    (tmp_path / "train.py").write_text("")
    with (tmp_path / "data.bin").open("wb") as handle:
        handle.truncate(infra.bundle.MAX_JOB_BYTES + 1)
    with pytest.raises(infra.bundle.BundleError, match="trainstack data push"):
        infra.bundle.job_files(tmp_path)
