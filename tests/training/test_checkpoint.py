"""The built-in trainer's checkpoint in-process: written whole (staging folder, manifest, rename,
latest.json) and read back exactly, half-written folders never restored, the newest K kept, a full disk said
in one line, and the persister of a trainer run by hand started, waited for and closed
(tests/training/test_checkpoint_store.py holds the agent's own persister against S3)."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch

from training.checkpoint import (
    FINAL_UPLOAD_SECONDS,
    CheckpointManager,
    CheckpointTimings,
    Restored,
    resume_position,
    state_from_bytes,
)
from training.faults import ENV as FAULT_ENV
from trainstack_job.context import CheckpointContext
from trainstack_job.layout import sha256_file

CONTEXT = CheckpointContext(model="resnet18", optimizer="SGD", precision="bf16", world_size=2)


def state_for(step: int) -> dict[str, Any]:
    """A trainer state with nested dicts, tensors of two dtypes and plain values."""
    return {
        "model": {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4) * step, "b": torch.ones(3) * step},
        "optimizer": {"state": {0: {"momentum_buffer": torch.full((4,), step, dtype=torch.float16)}}},
        "train": {"global_step": step, "sample": 8 * step},
        "classes": ["cat", "dog"],
    }


def assert_same_state(loaded: dict[str, Any], saved: dict[str, Any]) -> None:
    assert loaded.keys() == saved.keys()
    for key, value in saved.items():
        if isinstance(value, dict):
            assert_same_state(loaded[key], value)
        elif isinstance(value, torch.Tensor):
            assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
        else:
            assert loaded[key] == value, key


def save(manager: CheckpointManager, step: int, epoch: int = 0, **extra: Any) -> Path:
    return manager.save(state_for(step), step=step, epoch=epoch, world_size=2, config_hash="cfg", **extra)


def entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_a_saved_checkpoint_reads_back_exactly_with_its_manifest(tmp_path: Path) -> None:
    """Every tensor comes back as saved; the manifest and latest.json say what was written."""
    manager = CheckpointManager(tmp_path)
    directory = save(manager, 7, epoch=2, context=CONTEXT)
    assert directory == tmp_path / "step-7"
    assert entries(tmp_path) == ["latest.json", "step-7"]
    assert entries(directory) == ["manifest.json", "state.pt"]
    restored = CheckpointManager(tmp_path).restore_local()
    assert restored is not None and restored.step == 7 and restored.directory == directory
    assert_same_state(restored.load_state(), state_for(7))
    manifest = json.loads((directory / "manifest.json").read_text())
    assert restored.manifest == manifest
    state = directory / "state.pt"
    assert manifest["files"] == {"state.pt": {"sha256": sha256_file(state), "size": state.stat().st_size}}
    assert (manifest["step"], manifest["epoch"], manifest["world_size"], manifest["config_hash"]) == (
        7,
        2,
        2,
        "cfg",
    )
    assert manifest["written_at"]
    assert restored.context == CONTEXT
    latest = json.loads((tmp_path / "latest.json").read_text())
    assert (latest["step"], latest["epoch"], latest["dir"]) == (7, 2, "step-7")
    assert manager.latest_saved_step == 7


def test_the_state_travels_to_other_ranks_as_its_bytes(tmp_path: Path) -> None:
    """Ranks on other machines load the very file the checkpoint holds, as the restoring rank does."""
    save(CheckpointManager(tmp_path), 3)
    restored = CheckpointManager(tmp_path).restore()
    assert restored is not None
    data = restored.state_bytes()
    assert data == (tmp_path / "step-3" / "state.pt").read_bytes()
    assert_same_state(state_from_bytes(data), state_for(3))


def test_a_checkpoint_from_before_contexts_has_none(tmp_path: Path) -> None:
    """Without a context the manifest has no "context" key and the restored checkpoint says None."""
    directory = save(CheckpointManager(tmp_path), 4)
    assert "context" not in json.loads((directory / "manifest.json").read_text())
    restored = CheckpointManager(tmp_path).restore()
    assert restored is not None and restored.context is None


def test_only_data_is_loaded_never_code(tmp_path: Path) -> None:
    """A checkpoint's state.pt is data: a pickled object is refused on load, from the file or its bytes."""
    directory = save(CheckpointManager(tmp_path), 2)
    torch.save({"evil": Path("/")}, directory / "state.pt")
    restored = Restored(2, directory, {})
    with pytest.raises(Exception, match=r"[Ww]eights only load failed"):
        restored.load_state()
    with pytest.raises(Exception, match=r"[Ww]eights only load failed"):
        state_from_bytes(restored.state_bytes())


def test_saving_a_step_again_replaces_it_whole(tmp_path: Path) -> None:
    """A step saved twice (a life that saved it and died before moving on) holds the second save only."""
    manager = CheckpointManager(tmp_path)
    save(manager, 5)
    newer = state_for(50)
    manager.save(newer, step=5, epoch=1, world_size=2, config_hash="cfg")
    assert entries(tmp_path) == ["latest.json", "step-5"]
    restored = CheckpointManager(tmp_path).restore()
    assert restored is not None and restored.manifest["epoch"] == 1
    assert_same_state(restored.load_state(), newer)


def test_a_staging_folder_this_process_left_does_not_stop_the_next_save(tmp_path: Path) -> None:
    """A staging folder of this pid (an earlier failed save of the same step) is cleared, not tripped over."""
    manager = CheckpointManager(tmp_path)
    staging = tmp_path / f".step-6.tmp-{os.getpid()}"
    staging.mkdir()
    (staging / "state.pt").write_bytes(b"half")
    save(manager, 6)
    assert entries(tmp_path) == ["latest.json", "step-6"]
    restored = manager.restore_local()
    assert restored is not None
    assert_same_state(restored.load_state(), state_for(6))


def test_a_save_interrupted_mid_write_leaves_nothing_a_later_life_restores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save killed mid-write leaves the previous step restored, and its staging folder is cleared."""
    manager = CheckpointManager(tmp_path)
    save(manager, 3)

    def killed(*_: object, **__: object) -> None:
        raise KeyboardInterrupt  # not an OSError: nothing of the save's own cleanup runs

    monkeypatch.setattr(torch, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        save(manager, 6)
    monkeypatch.undo()
    leftovers = [name for name in entries(tmp_path) if name.startswith(".step-6")]
    assert leftovers, "the interrupted save's staging folder"
    assert json.loads((tmp_path / "latest.json").read_text())["step"] == 3
    next_life = CheckpointManager(tmp_path)
    assert entries(tmp_path) == ["latest.json", "step-3"]
    restored = next_life.restore()
    assert restored is not None and restored.step == 3


def test_half_written_folders_of_a_dead_process_are_removed_at_start(tmp_path: Path) -> None:
    """Staging folders (`.step-*`) of a process that died mid-save or mid-download go; nothing else does."""
    (tmp_path / ".step-9.tmp-12345").mkdir()
    (tmp_path / ".step-9.tmp-12345" / "state.pt").write_bytes(b"x")
    (tmp_path / ".step-11").mkdir()
    (tmp_path / "logs").mkdir()
    save(CheckpointManager(tmp_path), 4)
    CheckpointManager(tmp_path)
    assert entries(tmp_path) == ["latest.json", "logs", "step-4"]


def test_a_stray_file_named_like_a_staging_folder_never_stops_the_start(tmp_path: Path) -> None:
    """Start-up clears what it can of `.step-*` and goes on: a file by that name is no reason to fail."""
    save(CheckpointManager(tmp_path), 4)
    (tmp_path / ".step-5.tmp-1").write_bytes(b"a file, not a folder")
    restored = CheckpointManager(tmp_path).restore()
    assert restored is not None and restored.step == 4


def test_pruning_never_follows_a_link_out_of_the_checkpoint_folder(tmp_path: Path) -> None:
    """An old step that is a link (made by hand) is left, its target untouched, and the save goes on."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not the trainer's")
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / "step-1").symlink_to(outside, target_is_directory=True)
    manager = CheckpointManager(root, keep=1)
    save(manager, 2)
    assert (outside / "keep.txt").read_text() == "not the trainer's"
    restored = CheckpointManager(root).restore()
    assert restored is not None and restored.step == 2


def test_the_checkpoint_folder_is_created_with_its_parents(tmp_path: Path) -> None:
    """checkpoint.dir need not exist yet."""
    root = tmp_path / "a" / "b" / "checkpoints"
    manager = CheckpointManager(root)
    assert root.is_dir()
    assert manager.restore() is None and manager.latest_saved_step is None
    save(manager, 1)
    assert (root / "step-1" / "manifest.json").is_file()


def test_the_newest_k_steps_are_kept_by_number_not_by_name(tmp_path: Path) -> None:
    """keep=2 of steps 3, 10, 20: 10 and 20 stay (step-3 sorts after step-20 as text), 20 is restored."""
    manager = CheckpointManager(tmp_path, keep=2)
    for step in (3, 10, 20):
        save(manager, step)
    assert entries(tmp_path) == ["latest.json", "step-10", "step-20"]
    restored = CheckpointManager(tmp_path).restore()
    assert restored is not None and restored.step == 20


def test_three_steps_are_kept_by_default(tmp_path: Path) -> None:
    """checkpoint.keep's default: the newest three."""
    manager = CheckpointManager(tmp_path)
    for step in range(1, 6):
        save(manager, step)
    assert entries(tmp_path) == ["latest.json", "step-3", "step-4", "step-5"]


def test_things_named_like_steps_that_are_not_step_folders_are_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A file named step-99 or other folders are never counted, pruned by, restored or warned about."""
    (tmp_path / "step-99").write_bytes(b"not a folder")
    (tmp_path / "step-x").mkdir()
    (tmp_path / "notes").mkdir()
    manager = CheckpointManager(tmp_path, keep=1)
    save(manager, 5)
    assert entries(tmp_path) == ["latest.json", "notes", "step-5", "step-99", "step-x"]
    with caplog.at_level(logging.WARNING):
        restored = CheckpointManager(tmp_path).restore()
    assert restored is not None and restored.step == 5
    assert "skipping" not in caplog.text


def test_a_newer_damaged_step_is_skipped_for_the_older_good_one_saying_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Restore returns the newest step that verifies and names the one it skipped."""
    manager = CheckpointManager(tmp_path)
    save(manager, 4)
    save(manager, 8)
    (tmp_path / "step-8" / "state.pt").write_bytes(b"damaged")
    with caplog.at_level(logging.WARNING, logger="training.checkpoint"):
        restored = CheckpointManager(tmp_path).restore_local()
    assert restored is not None and restored.step == 4
    assert caplog.messages == [
        f"skipping local checkpoint step 8: {tmp_path / 'step-8' / 'state.pt'} missing or truncated"
    ]


def test_every_save_is_counted_and_timed(tmp_path: Path) -> None:
    """metrics.json's checkpoint figures: one count and one duration per save."""
    manager = CheckpointManager(tmp_path)
    started = time.monotonic()
    save(manager, 1)
    save(manager, 2)
    elapsed = time.monotonic() - started
    assert manager.timings.count == 2
    assert len(manager.timings.save_seconds) == 2
    assert all(0 <= seconds <= elapsed for seconds in manager.timings.save_seconds)


def test_the_timings_report_means_and_maxima_and_zeros_when_empty() -> None:
    """Means and maxima of the save and upload times; 0.0 for a run that never saved or uploaded."""
    assert CheckpointTimings().as_dict() == {
        "count": 0,
        "save_seconds_mean": 0.0,
        "upload_seconds_mean": 0.0,
        "save_seconds_max": 0.0,
        "upload_seconds_max": 0.0,
    }
    saves, uploads = [1.0, 2.0, 6.0], [4.0, 2.0]
    timings = CheckpointTimings(count=3, save_seconds=saves, upload_seconds=uploads)
    assert timings.as_dict() == {
        "count": 3,
        "save_seconds_mean": pytest.approx(sum(saves) / len(saves)),
        "upload_seconds_mean": pytest.approx(sum(uploads) / len(uploads)),
        "save_seconds_max": max(saves),
        "upload_seconds_max": max(uploads),
    }


def test_a_full_disk_is_one_line_with_the_space_needed_and_free(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC is one line naming the step, the state's size, the space free and the key to raise."""
    manager = CheckpointManager(tmp_path)
    save(manager, 1)
    # Meta tensors: sizes without memory.
    fp16 = torch.empty(10**9, dtype=torch.float16, device="meta")
    fp32 = torch.empty(10**9, dtype=torch.float32, device="meta")
    # 8.250000004 GB in all: said as 8.3 (a divisor a little off would say 8.2).
    small = torch.empty(62_500_001, dtype=torch.float32, device="meta")
    state = {"first": fp16, "model": {"w": fp32, "b": small}, "step": 3, "last": fp16}
    needed = 2 * fp16.numel() * 2 + fp32.numel() * 4 + small.numel() * 4

    def full(*_: object, **__: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    usage = shutil.disk_usage(tmp_path)
    free = 2_250_000_001  # 2.3 GB, as 8.3 above

    def disk_usage(path: str | Path) -> Any:
        assert Path(path) == tmp_path, "the free space of the checkpoint folder's disk"
        return usage._replace(free=free)

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    with pytest.raises(OSError) as raised:
        manager.save(state, step=2, epoch=0, world_size=1, config_hash="cfg")
    error = raised.value
    assert error.errno == errno.ENOSPC
    assert error.filename == str(tmp_path)
    assert error.strerror == (
        f"disk full while saving checkpoint step 2 (about {needed / 1e9:.1f} GB needed, "
        f"{free / 1e9:.1f} GB free); "
        "free space or raise trainstack:rootVolumeSizeGb"
    )
    assert entries(tmp_path) == ["latest.json", "step-1"]
    assert manager.latest_saved_step == 1 and manager.timings.count == 1


def test_a_disk_too_full_for_the_staging_folder_is_still_said_as_a_full_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC from the staging folder's own mkdir is still the disk-full line."""
    manager = CheckpointManager(tmp_path)
    make_dir = Path.mkdir

    def full(path: Path, *args: Any, **kwargs: Any) -> None:
        if path.name.startswith(".step-"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        make_dir(path, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", full)
    with pytest.raises(OSError) as raised:
        save(manager, 2)
    assert raised.value.errno == errno.ENOSPC
    assert str(raised.value.strerror).startswith("disk full while saving checkpoint step 2 (about ")
    assert entries(tmp_path) == []


def test_another_disk_error_is_raised_as_it_came_and_nothing_half_written_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EIO (the instance's disk) is not reworded: the same error goes up, the staging folder goes."""
    manager = CheckpointManager(tmp_path)
    failure = OSError(errno.EIO, "Input/output error")

    def broken(*_: object, **__: object) -> None:
        raise failure

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(OSError) as raised:
        save(manager, 2)
    assert raised.value is failure
    assert entries(tmp_path) == []


@pytest.mark.parametrize(
    ("point", "files"),
    [
        # After the state file, before the manifest: only the staging folder holds the step.
        ("checkpoint-state-written", {"staging": ["state.pt"], "committed": False, "latest": 5}),
        # After the rename, before latest.json names it.
        ("checkpoint-dir-committed", {"staging": None, "committed": True, "latest": 5}),
    ],
)
def test_the_fault_points_fire_between_the_checkpoints_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, point: str, files: dict[str, Any]
) -> None:
    """The kill tests' named moments (training/faults.py) are where they say, and only at their step."""
    manager = CheckpointManager(tmp_path)
    save(manager, 3)
    seen: list[dict[str, Any]] = []

    def at_fault(_signum: int, _frame: FrameType | None) -> None:
        staging = [p for p in tmp_path.iterdir() if p.name.startswith(".step-6")]
        seen.append(
            {
                "staging": sorted(p.name for p in staging[0].iterdir()) if staging else None,
                "committed": (tmp_path / "step-6" / "manifest.json").is_file(),
                "latest": json.loads((tmp_path / "latest.json").read_text())["step"],
            }
        )

    previous = signal.signal(signal.SIGTERM, at_fault)
    try:
        monkeypatch.setenv(FAULT_ENV, f"sigterm:{point}:step=6")
        save(manager, 5)
        assert seen == []
        save(manager, 6)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert seen == [files]
    assert json.loads((tmp_path / "latest.json").read_text())["step"] == 6


# -- a trainer run by hand: its own persister ---------------------------------------------------------------


@dataclass
class Flushed:
    confirmed: bool


@dataclass
class FakePersister:
    """The persister a trainer run by hand is given: records what the checkpoint manager asks of it."""

    uri: str
    root: Path
    keep: int
    confirmed_step: int | None = None
    confirmed: bool = True
    calls: list[str] = field(default_factory=list)
    deadlines: list[float] = field(default_factory=list)
    upload_seconds: list[float] = field(default_factory=lambda: [1.5, 2.5])

    def restore(self) -> int | None:
        self.calls.append("restore")
        return None

    def start(self) -> None:
        self.calls.append("start")

    def finish(self, deadline: float) -> Flushed:
        self.calls.append("finish")
        self.deadlines.append(deadline)
        return Flushed(self.confirmed)

    def close(self) -> None:
        self.calls.append("close")


@pytest.fixture()
def made() -> list[FakePersister]:
    """The persisters the factory made, in order."""
    return []


def by_hand(root: Path, made: list[FakePersister], keep: int = 3) -> CheckpointManager:
    def factory(uri: str, directory: Path, keep: int) -> FakePersister:
        persister = FakePersister(uri, directory, keep)
        made.append(persister)
        return persister

    return CheckpointManager(root, "s3://job/checkpoints", keep, persister_factory=factory)


def test_under_the_agent_there_is_no_persister_and_nothing_to_wait_for(tmp_path: Path) -> None:
    """checkpoint.uri empty: no remote, every wait and finish is True at once, close does nothing."""
    manager = CheckpointManager(tmp_path, persister_factory=lambda *_: pytest.fail("no persister wanted"))
    save(manager, 1)
    assert manager.persister is None
    assert manager.remote_uri == "" and manager.confirmed_remote_step is None
    assert manager.wait_uploaded(timeout=0) and manager.finish(timeout=0)
    manager.close()


def test_a_uri_without_a_persister_is_refused_naming_it(tmp_path: Path) -> None:
    """The trainer never imports the agent's persister: without one it cannot upload, and names the URI."""
    with pytest.raises(ValueError, match=r"^checkpoint.uri s3://job/x: no persister to upload with"):
        CheckpointManager(tmp_path, "s3://job/x")


def test_the_persister_mirrors_this_folder_to_the_uri_keeping_k(
    tmp_path: Path, made: list[FakePersister]
) -> None:
    """The persister gets checkpoint.uri, .dir and .keep; its URI and confirmed step are reported."""
    manager = by_hand(tmp_path, made, keep=5)
    (persister,) = made
    assert (persister.uri, persister.root, persister.keep) == ("s3://job/checkpoints", tmp_path, 5)
    assert manager.remote_uri == "s3://job/checkpoints"
    assert manager.confirmed_remote_step is None
    persister.confirmed_step = 12
    assert manager.confirmed_remote_step == 12


def test_uploads_start_with_the_first_save_once(tmp_path: Path, made: list[FakePersister]) -> None:
    """The persister starts after the first checkpoint is committed, and only once."""
    manager = by_hand(tmp_path, made)
    (persister,) = made
    assert persister.calls == []
    save(manager, 1)
    save(manager, 2)
    assert persister.calls == ["start"]


def test_a_restore_consults_s3_first_then_starts_uploads_once(
    tmp_path: Path, made: list[FakePersister]
) -> None:
    """Restore asks S3 first, then starts uploads once; the restored step is the one waited for."""
    save(CheckpointManager(tmp_path), 4)
    manager = by_hand(tmp_path, made)
    (persister,) = made
    restored = manager.restore()
    assert restored is not None and restored.step == 4
    assert persister.calls == ["restore", "start"]
    assert manager.latest_saved_step == 4
    assert not manager.wait_uploaded(timeout=0.05)
    save(manager, 5)
    assert persister.calls == ["restore", "start"]


def test_waiting_for_the_upload_ends_when_the_newest_step_is_confirmed(
    tmp_path: Path, made: list[FakePersister]
) -> None:
    """The wait is True once S3 has the newest saved step, False at its timeout, never much later."""
    manager = by_hand(tmp_path, made)
    (persister,) = made
    assert manager.wait_uploaded(timeout=0.05)  # nothing saved
    save(manager, 6)
    started = time.monotonic()
    assert not manager.wait_uploaded(timeout=0.3)  # nothing confirmed
    # It waits its timeout, and not much longer (the standalone trainer's exit is bounded).
    assert 0.3 <= time.monotonic() - started < 0.9
    persister.confirmed_step = 5
    assert not manager.wait_uploaded(timeout=0.05)
    persister.confirmed_step = 6
    assert manager.wait_uploaded(timeout=0.05)
    persister.confirmed_step = 7
    assert manager.wait_uploaded(timeout=0.05)


def test_finishing_says_whether_every_step_is_persisted_by_the_deadline(
    tmp_path: Path, made: list[FakePersister]
) -> None:
    """finish reports the persister's answer by its deadline and its upload times; close closes it."""
    manager = by_hand(tmp_path, made)
    (persister,) = made
    save(manager, 1)
    before = time.monotonic()
    assert manager.finish(timeout=30)
    assert before + 30 <= persister.deadlines[0] <= time.monotonic() + 30
    assert manager.timings.upload_seconds == [1.5, 2.5]
    persister.confirmed = False
    assert manager.finish() is False
    assert persister.deadlines[1] >= before + FINAL_UPLOAD_SECONDS
    manager.close()
    assert persister.calls == ["start", "finish", "finish", "close"]


# -- where the data resumes, from the manifest alone (a gated standby's warm-up) -------------------------


def test_the_manifest_says_where_the_data_resumes_and_the_newest_committed_step_decides(
    tmp_path: Path,
) -> None:
    manager = CheckpointManager(tmp_path)
    assert resume_position(tmp_path / "absent") is None, "no checkpoint folder yet (a standby's first wait)"
    assert resume_position(tmp_path) is None
    save(manager, 3, epoch=0, step_in_epoch=3)
    save(manager, 11, epoch=1, step_in_epoch=3)
    assert json.loads((tmp_path / "step-11" / "manifest.json").read_text())["step_in_epoch"] == 3
    assert resume_position(tmp_path) == (1, 3)
    # A newer step that never committed (a kill before its manifest) is passed over for the last good one.
    (tmp_path / "step-12").mkdir()
    assert resume_position(tmp_path) == (1, 3)


def test_a_checkpoint_without_its_batch_on_record_gives_no_position(tmp_path: Path) -> None:
    """Written before manifests said the batch, or by a writer that does not: the warm-up starts at the
    beginning rather than guess, and an older step's position (behind the job) is not taken instead."""
    manager = CheckpointManager(tmp_path)
    save(manager, 3, epoch=0, step_in_epoch=3)
    directory = save(manager, 5, epoch=0)
    assert "step_in_epoch" not in json.loads((directory / "manifest.json").read_text())
    assert resume_position(tmp_path) is None
    manifest = json.loads((directory / "manifest.json").read_text())
    for epoch, batch in ((0, -1), (-1, 2), ("0", 2), (0, 2.0)):
        (directory / "manifest.json").write_text(
            json.dumps({**manifest, "epoch": epoch, "step_in_epoch": batch})
        )
        assert resume_position(tmp_path) is None, (epoch, batch)
    (directory / "manifest.json").write_text(json.dumps({**manifest, "epoch": 0, "step_in_epoch": 0}))
    assert resume_position(tmp_path) == (0, 0)


def test_the_manifest_is_indented_json_for_people_to_read(tmp_path: Path) -> None:
    """`trainstack` and a person inspecting a checkpoint read the manifest: two-space indented JSON."""
    directory = save(CheckpointManager(tmp_path), 3, epoch=0, step_in_epoch=3)
    body = (directory / "manifest.json").read_text()
    assert body == json.dumps(json.loads(body), indent=2)
