"""The job is contained (issue 34): the agent, root on an instance, never writes or reads outside the folders
it means to because of a name the job chose or a link the job planted.

- a checkpoint's manifest (the job writes its own S3 prefix) naming `../../x` or `/abs/x` is never restored,
  the refusal names the S3 object and the fix, and an older checkpoint is used when there is one;
- a file the job swaps for a link after the upload's check is never read through the link;
- links the job plants in its folders (`checkpoints/.latest.json.tmp-<pid>`, `control/STOP`, `START_GATE`,
  `CHECKPOINT`, `venv/.trainstack-ready`) never make root create or truncate the file they point to;
- a venv the job has owned is never run or repaired by root: without the agent's own ready marker it is
  removed and built again from nothing, and pip runs in the job's scope.

Each stand-in for a file only root may write (/etc/ld.so.preload) lives in tmp_path.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import boto3
import pytest

import bootstrap.persist as persist_module
from bootstrap.job import VENV_READY, prepare_python
from bootstrap.persist import CheckpointPersister, CheckpointRefusedError
from bootstrap.trainer import TrainerPaths, TrainerProcess
from tests import checkpoints
from tests.conftest import MotoServer

BUCKET = "trainstack-contained"
PREFIX = "jobs/demo-1a2b3c4d/checkpoints"
PRECIOUS = b"root's own file\n"


class Events:
    def __init__(self) -> None:
        self.records: list[tuple[str, str, dict[str, Any]]] = []

    def event(self, stage: str, message: str, **fields: Any) -> None:
        self.records.append((stage, message, fields))

    def messages(self) -> list[str]:
        return [message for _, message, _ in self.records]


@pytest.fixture()
def s3(aws: MotoServer) -> Any:
    client = boto3.client("s3", region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    return client


def persister(s3: Any, root: Path, events: Events | None = None) -> CheckpointPersister:
    root.mkdir(parents=True, exist_ok=True)
    return CheckpointPersister(s3, BUCKET, PREFIX, root, events or Events(), poll_seconds=0.05)


def put_step(s3: Any, step: int, files: Mapping[str, bytes]) -> None:
    """A step in S3, and latest.json naming it, as a writer of the job's prefix (the job itself) may put
    them: any names in its manifest."""
    listed = {n: {"sha256": hashlib.sha256(b).hexdigest(), "size": len(b)} for n, b in files.items()}
    for name, body in files.items():
        s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}/step-{step}/{name}", Body=body)
    manifest = {"step": step, "epoch": 0, "files": listed}
    s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}/step-{step}/manifest.json", Body=json.dumps(manifest))
    latest = json.dumps({"step": step, "epoch": 0, "dir": f"step-{step}"})
    s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}/latest.json", Body=latest)


def outside_names(tmp_path: Path) -> list[tuple[str, Path]]:
    """(name in the manifest, the file restoring it as named would write) for `../` and an absolute path."""
    local = tmp_path / "scratch" / "checkpoints"
    staging_depth = 2  # checkpoints/.step-N.download/<name>
    climb = "../" * (staging_depth + 1) + "escaped-relative"
    return [
        (climb, (local / ".step-5.download" / climb).resolve()),
        (str(tmp_path / "escaped-absolute"), tmp_path / "escaped-absolute"),
    ]


@pytest.mark.parametrize("which", [0, 1], ids=["dot-dot", "absolute"])
def test_a_manifest_naming_a_file_outside_its_step_is_never_restored_and_the_line_names_the_object(
    s3: Any, tmp_path: Path, which: int
) -> None:
    name, escaped = outside_names(tmp_path)[which]
    put_step(s3, 5, {"state.bin": b"fine", name: b"# planted by the job\n"})
    events = Events()
    local = tmp_path / "scratch" / "checkpoints"
    with pytest.raises(CheckpointRefusedError) as refused:
        persister(s3, local, events).restore()
    assert not escaped.exists(), "root wrote outside the checkpoint folder"
    folder = f"s3://{BUCKET}/{PREFIX}/step-5/"
    assert str(refused.value) == (
        f"{folder}manifest.json: names {name!r} "
        f"({'a path through ' + repr('..') if which == 0 else 'an absolute path'}), outside the "
        "step's folder, so it is never restored, and no older checkpoint is left: not starting the job over "
        f"without its step 5; delete the step (aws s3 rm --recursive {folder}) to resume from an older "
        "checkpoint or start over, and fix what wrote that manifest (its names are relative to the step's "
        "folder)"
    )
    assert "\n" not in str(refused.value)
    assert "restored checkpoint from S3" not in events.messages()
    assert sorted(p.name for p in local.iterdir()) == [], "nothing of the step, no staging left"
    (said,) = [r for r in events.records if r[1].endswith("whose manifest names a file outside its folder")]
    assert (
        said[0] == "checkpoint"
        and said[2]["level"] == "warning"
        and said[2]["uri"] == f"{folder}manifest.json"
    )


def test_with_an_older_checkpoint_the_outside_one_is_skipped_saying_why_and_the_older_restored(
    s3: Any, tmp_path: Path
) -> None:
    name, escaped = outside_names(tmp_path)[0]
    put_step(s3, 3, {"state.bin": b"older"})
    put_step(s3, 5, {"state.bin": b"newer", name: b"planted"})
    events = Events()
    local = tmp_path / "scratch" / "checkpoints"
    assert persister(s3, local, events).restore() == 3
    assert not escaped.exists()
    assert (local / "step-3" / "state.bin").read_bytes() == b"older" and not (local / "step-5").exists()
    skipped = [f for _, m, f in events.records if m.startswith("skipping an S3 checkpoint whose manifest")]
    assert len(skipped) == 1 and skipped[0]["step"] == 5 and skipped[0]["level"] == "warning"
    assert skipped[0]["uri"] == f"s3://{BUCKET}/{PREFIX}/step-5/manifest.json"
    restored = [f for _, m, f in events.records if m == "restored checkpoint from S3"]
    assert [f["step"] for f in restored] == [3]


def test_a_staging_folder_the_job_swaps_for_a_link_mid_restore_is_never_written_through(
    s3: Any, tmp_path: Path
) -> None:
    """A standby's warm trainer runs while the agent restores into the folder it owns: it renames the agent's
    staging folder away and puts a link to /etc at its name between two downloads."""
    put_step(s3, 5, {"a.bin": b"first", "b.bin": b"second"})
    outside = tmp_path / "etc"
    outside.mkdir()
    local = tmp_path / "scratch" / "checkpoints"

    class SwapsStaging:
        def __init__(self, client: Any) -> None:
            self._client = client
            self.swapped = False

        def __getattr__(self, name: str) -> Any:
            return getattr(self._client, name)

        def download_file(self, bucket: str, key: str, filename: str, **kwargs: Any) -> None:
            if key.endswith("b.bin") and not self.swapped:
                (staging,) = local.glob(".step-5.download*")
                staging.rename(local / "moved-away")
                staging.symlink_to(outside)
                self.swapped = True
            self._client.download_file(bucket, key, filename, **kwargs)

    events = Events()
    client = SwapsStaging(s3)
    restored = persister(client, local, events).restore()
    assert client.swapped
    assert list(outside.iterdir()) == [], "root wrote through the job's link"
    # The folder put in place is not the one verified: nothing is restored, said once as a warning naming
    # the step's folder.
    assert restored is None and not (local / "step-5").exists()
    assert "restored checkpoint from S3" not in events.messages()
    assert (
        "checkpoint",
        "skipping an S3 checkpoint whose folder was replaced while it was restored",
        {"level": "warning", "step": 5, "uri": f"s3://{BUCKET}/{PREFIX}/step-5/"},
    ) in events.records, events.records


def commit_nested_step(root: Path, step: int) -> None:
    """A committed step whose one file sits in a sub-folder: `sub/state.bin`."""
    staging = root / f".step-{step}.tmp"
    (staging / "sub").mkdir(parents=True)
    data = os.urandom(100)
    (staging / "sub" / "state.bin").write_bytes(data)
    files = {"sub/state.bin": {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}}
    (staging / "manifest.json").write_text(json.dumps({"step": step, "epoch": 0, "files": files}))
    staging.rename(root / f"step-{step}")


@pytest.mark.parametrize("swapped", ["the file", "its folder"])
def test_a_file_swapped_for_a_link_after_the_uploads_check_is_never_read_through_it(
    s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, swapped: str
) -> None:
    """The job may replace a checkpoint file, or a folder on its way, by a link to root's secrets between the
    persister's check of its names and the transfer: the bytes uploaded are never the secret's."""
    secrets = tmp_path / "root-only"
    (secrets / "sub").mkdir(parents=True)
    for secret in (secrets / "state.bin", secrets / "sub" / "state.bin"):
        secret.write_bytes(b"root's secret")
    local = tmp_path / "ckpt"
    commit_nested_step(local, 4)
    checked = persist_module._refuse_outside

    def check_then_swap(directory: Path, file_name: str, step: int) -> None:
        checked(directory, file_name, step)
        if swapped == "the file":
            (directory / file_name).unlink()
            (directory / file_name).symlink_to(secrets / "sub" / "state.bin")
        else:
            (directory / "sub").rename(directory / "moved")
            (directory / "sub").symlink_to(secrets / "sub", target_is_directory=True)

    monkeypatch.setattr(persist_module, "_refuse_outside", check_then_swap)
    owner = persister(s3, local)
    with pytest.raises(persist_module.UploadAbandonedError) as refused:
        owner.persist_newest(None)
    owner.close()
    assert str(refused.value) == (
        f"step 4: 'sub/state.bin' is not a regular file inside {local / 'step-4'}; not uploaded "
        "(the job's checkpoint must hold plain files)"
    )
    listed = s3.list_objects_v2(Bucket=BUCKET, Prefix=PREFIX).get("Contents", [])
    bodies = [s3.get_object(Bucket=BUCKET, Key=item["Key"])["Body"].read() for item in listed]
    assert b"root's secret" not in bodies


def test_a_step_with_sub_folders_still_goes_up_and_comes_back_whole(s3: Any, tmp_path: Path) -> None:
    """What the descriptors change is only what a link can do: plain nested files upload and restore."""
    local = tmp_path / "first"
    commit_nested_step(local, 4)
    owner = persister(s3, local)
    assert owner.persist_newest(None) == 4
    owner.close()
    fresh = tmp_path / "second"
    assert persister(s3, fresh).restore() == 4
    assert (fresh / "step-4" / "sub" / "state.bin").read_bytes() == (
        local / "step-4" / "sub" / "state.bin"
    ).read_bytes()
    assert sorted(p.name for p in fresh.iterdir()) == ["latest.json", "step-4"]


def test_a_step_whose_folder_is_a_link_out_is_never_uploaded(s3: Any, tmp_path: Path) -> None:
    """The path's existing parent is a link leading outside: refused before anything is read."""
    outside = tmp_path / "etc"
    outside.mkdir()
    (outside / "state.bin").write_bytes(b"root's secret")
    local = tmp_path / "ckpt"
    commit_nested_step(local, 4)
    shutil.rmtree(local / "step-4" / "sub")
    (local / "step-4" / "sub").symlink_to(outside, target_is_directory=True)
    with pytest.raises(persist_module.UploadAbandonedError, match="not a regular file inside"):
        persister(s3, local).persist_newest(None)
    assert s3.list_objects_v2(Bucket=BUCKET, Prefix=PREFIX).get("Contents", []) == []


# --- links planted where root writes ---------------------------------------------------------------------


def stand_ins(tmp_path: Path) -> tuple[Path, Path]:
    """Two stand-ins for /etc/ld.so.preload: one that exists (must not be truncated), one that does not
    (must not be created)."""
    existing = tmp_path / "etc" / "ld.so.preload"
    existing.parent.mkdir(exist_ok=True)
    existing.write_bytes(PRECIOUS)
    return existing, tmp_path / "etc" / "absent"


def assert_untouched(existing: Path, absent: Path) -> None:
    assert existing.read_bytes() == PRECIOUS, "root truncated or rewrote the file the link names"
    assert not absent.exists(), "root created the file the link names"


@pytest.mark.parametrize("target", ["existing", "absent"])
def test_a_link_at_latest_jsons_temporary_name_never_makes_root_write_its_target(
    s3: Any, tmp_path: Path, target: str
) -> None:
    existing, absent = stand_ins(tmp_path)
    local = tmp_path / "ckpt"
    checkpoints.commit_step(local, 2)
    # The temporary name the old write used: `.latest.json.tmp-<agent pid>`, known to the job.
    (local / f".latest.json.tmp-{os.getpid()}").symlink_to(existing if target == "existing" else absent)
    assert persister(s3, local).persist_newest(None) == 2
    assert_untouched(existing, absent)
    assert json.loads((local / "latest.json").read_text())["step"] == 2
    assert not (local / "latest.json").is_symlink()


def test_a_link_at_latest_json_itself_is_replaced_not_followed_and_said_once(s3: Any, tmp_path: Path) -> None:
    existing, absent = stand_ins(tmp_path)
    put_step(s3, 3, {"state.bin": b"three"})
    local = tmp_path / "ckpt"
    local.mkdir()
    (local / "latest.json").symlink_to(existing)
    events = Events()
    assert persister(s3, local, events).restore() == 3
    assert_untouched(existing, absent)
    assert not (local / "latest.json").is_symlink()
    assert json.loads((local / "latest.json").read_text())["step"] == 3
    line = (
        f"{local / 'latest.json'}: the job had put a link here (to {existing}); replaced by a regular file, "
        "not followed",
        {"level": "warning"},
    )
    assert [(m, f) for _, m, f in events.records if "put a link" in m] == [line]
    # The same on the upload's side: the job plants it again, the next step's move of latest.json replaces it
    # and says so.
    (local / "latest.json").unlink()
    (local / "latest.json").symlink_to(existing)
    checkpoints.commit_step(local, 4)
    owner = persister(s3, local, events)
    assert owner.persist_newest(None) == 4
    assert_untouched(existing, absent)
    assert json.loads((local / "latest.json").read_text())["step"] == 4
    assert [(m, f) for _, m, f in events.records if "put a link" in m] == [line, line]


@pytest.mark.parametrize("name", ["STOP", "CHECKPOINT", "START_GATE"])
@pytest.mark.parametrize("target", ["existing", "absent"])
def test_a_link_at_a_control_file_never_makes_root_create_or_truncate_its_target(
    tmp_path: Path, name: str, target: str
) -> None:
    existing, absent = stand_ins(tmp_path)
    paths = TrainerPaths(tmp_path / "scratch")
    paths.control_dir.mkdir(parents=True)
    lines: list[str] = []
    trainer = TrainerProcess([sys.executable, "-c", "pass"], paths, {"train": {}}, lines.append)
    planted = paths.control_dir / name
    pointed = existing if target == "existing" else absent
    planted.symlink_to(pointed)
    if name == "STOP":
        trainer.request_stop()
    elif name == "CHECKPOINT":
        trainer.request_checkpoint()
    else:
        trainer.start(gated=True)  # a standby's warm trainer: the gate is the agent's to set
        assert trainer.wait(timeout=60) == 0
    assert_untouched(existing, absent)
    assert planted.is_file() and not planted.is_symlink(), "the signal still reaches the job"
    assert [line for line in lines if "put a link" in line] == [
        f"trainstack agent: {planted}: the job had put a link here (to {pointed}); replaced by a regular "
        "file, not followed"
    ]


# --- the job's venv ----------------------------------------------------------------------------------------


def _requirements(tmp_path: Path) -> Path:
    requirements = tmp_path / "job" / "requirements.txt"
    requirements.parent.mkdir(parents=True, exist_ok=True)
    requirements.write_text("# nothing to install: the venv still sees the base packages\n")
    return requirements


class ScopedLaunch:
    """bootstrap/jobuser.py's JobLaunch as prepare_python uses it, recording what it was asked."""

    def __init__(self) -> None:
        self.wrapped: list[tuple[list[str], str | None]] = []
        self.given: list[Path] = []
        self.stopped: list[str | None] = []

    def wrap(self, argv: list[str], unit: str | None) -> list[str]:
        self.wrapped.append((list(argv), unit))
        return list(argv)

    def give(self, directories: Iterable[Path]) -> None:
        self.given.extend(directories)

    def unit_name(self) -> str | None:
        return "trainstack-job-test-1.scope"

    def stop(self, unit: str | None) -> None:
        self.stopped.append(unit)

    def inherited_environment(self, environ: Mapping[str, str], home: Path | None) -> dict[str, str]:
        return {k: v for k, v in environ.items() if not k.startswith("AWS_")} | {"HOME": str(home)}


def _build(tmp_path: Path, launch: Any = None, log: list[str] | None = None) -> Path:
    said = log if log is not None else []
    python = prepare_python(
        sys.executable,
        _requirements(tmp_path),
        tmp_path / "python",
        lambda *a, **_: said.append(a[1]),
        launch=launch,
    )
    return Path(python)


def test_a_venv_whose_marker_the_job_deleted_is_rebuilt_and_its_python_never_run_by_root(
    tmp_path: Path,
) -> None:
    python = _build(tmp_path)
    venv = python.parent.parent
    # The job (the venv is its own) points the interpreter at a script of its own and deletes the marker, so
    # the next life builds the venv again.
    ran = tmp_path / "ran-as-the-agent"
    script = venv / "lib" / "python.sh"
    script.write_text(f'#!/bin/sh\ntouch "{ran}"\nexec "{sys.executable}" "$@"\n')
    script.chmod(0o755)
    python.unlink()
    python.symlink_to(script)
    planted = venv / "lib" / "planted.txt"
    planted.write_text("the job's")
    (venv / VENV_READY).unlink()
    said: list[str] = []
    again = _build(tmp_path, log=said)
    assert again == python
    assert not ran.exists(), "the agent ran the job's interpreter"
    assert not planted.exists(), "the venv was repaired, not rebuilt from nothing"
    assert not script.exists() and python.resolve() != script
    marker = os.lstat(venv / VENV_READY)
    assert marker.st_uid == os.geteuid() and (venv / VENV_READY).is_file()
    assert "job environment rebuilt from scratch (not marked complete by the agent)" in said
    assert said[-1] != "job environment reused"


@pytest.mark.parametrize("target", ["existing", "absent"])
def test_a_link_at_the_venvs_ready_marker_is_never_followed(tmp_path: Path, target: str) -> None:
    existing, absent = stand_ins(tmp_path)
    python = _build(tmp_path)
    marker = python.parent.parent / VENV_READY
    marker.unlink()
    marker.symlink_to(existing if target == "existing" else absent)
    said: list[str] = []
    _build(tmp_path, log=said)
    assert_untouched(existing, absent)
    assert marker.is_file() and not marker.is_symlink()
    assert said[-1] != "job environment reused", "a link is never the agent's marker"


@pytest.mark.skipif(os.geteuid() != 0, reason="a marker of another user needs root to make")
def test_a_marker_that_is_not_the_agents_own_is_not_trusted(tmp_path: Path) -> None:
    python = _build(tmp_path)
    marker = python.parent.parent / VENV_READY
    nobody = pwd.getpwnam("nobody")
    os.chown(marker, nobody.pw_uid, nobody.pw_gid)  # the job's own file at the marker's name
    said: list[str] = []
    _build(tmp_path, log=said)
    assert "job environment reused" not in said
    assert os.lstat(marker).st_uid == os.geteuid()


def test_an_intact_venv_is_reused_without_running_anything_in_it(tmp_path: Path) -> None:
    python = _build(tmp_path)
    ran = tmp_path / "ran"
    python.unlink()
    python.write_text(f'#!/bin/sh\ntouch "{ran}"\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    said: list[str] = []
    _build(tmp_path, log=said)
    assert said[-1] == "job environment reused" and not ran.exists()


def test_pip_runs_in_the_jobs_scope_with_the_jobs_environment_and_the_scope_is_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "the-agent's")
    seen: list[dict[str, str]] = []
    real = subprocess.Popen

    def recording(argv: list[str], **kwargs: Any) -> Any:
        seen.append(dict(kwargs.get("env") or {}))
        return real(argv, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", recording)
    launch = ScopedLaunch()
    python = _build(tmp_path, launch)
    ((argv, unit),) = launch.wrapped
    assert argv[:4] == [str(python), "-m", "pip", "install"]
    assert unit == "trainstack-job-test-1.scope" and launch.stopped == [unit]
    assert "AWS_SECRET_ACCESS_KEY" not in seen[-1], "pip, the job's, never sees the agent's credentials"
    assert seen[-1]["HOME"] == str(tmp_path / "python" / "pip-cache")


def test_nothing_is_left_behind_when_the_venv_is_rebuilt(tmp_path: Path) -> None:
    """The rebuild removes links inside the old venv, never what they point to."""
    existing, absent = stand_ins(tmp_path)
    python = _build(tmp_path)
    venv = python.parent.parent
    (venv / "lib" / "to-etc").symlink_to(existing.parent, target_is_directory=True)
    (venv / VENV_READY).unlink()
    _build(tmp_path)
    assert_untouched(existing, absent)
    assert not (venv / "lib" / "to-etc").exists()
