"""The job author's helper: commits, restores, prunes and stops the way docs/job-contract.md says."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
from datetime import datetime, timezone
from pathlib import Path

import pytest

from tests.waiting import wait_until
from trainstack_job import Job
from trainstack_job.contract import ExitCode, JobEnv
from trainstack_job.layout import LATEST, MANIFEST, committed_steps, verify_dir

REPO = Path(__file__).resolve().parents[2]


def contract_env(tmp_path: Path) -> dict[str, str]:
    """The variables the agent sets, pointing into `tmp_path`."""
    return {
        JobEnv.CHECKPOINT_DIR.value: str(tmp_path / "checkpoints"),
        JobEnv.OUTPUT_DIR.value: str(tmp_path / "output"),
        JobEnv.DATA_DIR.value: str(tmp_path / "data"),
        JobEnv.STOP_FILE.value: str(tmp_path / "stop"),
        JobEnv.CHECKPOINT_REQUEST_FILE.value: str(tmp_path / "checkpoint-request"),
        JobEnv.PROGRESS_FILE.value: str(tmp_path / "progress.json"),
        JobEnv.RESTORED_STEP.value: "",
    }


@pytest.fixture()
def job(tmp_path: Path) -> Job:
    return Job.from_env(environ=contract_env(tmp_path))


def save(job: Job, step: int, payload: bytes | None = None) -> None:
    with job.save_checkpoint(step) as directory:
        (directory / "state.bin").write_bytes(payload if payload is not None else f"step {step}".encode())
        (directory / "nested").mkdir()
        (directory / "nested" / "rng.bin").write_bytes(b"rng")


def test_from_env_reads_every_contract_variable(tmp_path: Path) -> None:
    env = {**contract_env(tmp_path), JobEnv.RESTORED_STEP.value: "40"}
    job = Job.from_env(environ=env)
    assert job.managed
    assert job.checkpoint_dir == tmp_path / "checkpoints" and job.checkpoint_dir.is_dir()
    assert job.output_dir == tmp_path / "output" and job.output_dir.is_dir()
    assert job.data_dir == tmp_path / "data"
    assert job.restored_step == 40


def test_without_trainstack_it_uses_local_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    job = Job.from_env(environ={})
    assert not job.managed
    assert job.checkpoint_dir == Path("checkpoints") and (tmp_path / "checkpoints").is_dir()
    assert job.output_dir == Path("output") and (tmp_path / "output").is_dir()
    assert job.data_dir is None and job.restored_step is None
    assert not job.should_stop() and not job.checkpoint_requested()
    job.report_progress(3, 10)  # nowhere to report locally: a no-op
    save(job, 3)
    assert job.latest_checkpoint() is not None


def test_saved_checkpoint_is_committed_with_manifest_and_latest(job: Job) -> None:
    save(job, 10)
    directory = job.checkpoint_dir / "step-10"
    manifest, why = verify_dir(directory)
    assert manifest is not None, why
    assert set(manifest["files"]) == {"state.bin", "nested/rng.bin"}
    assert json.loads((job.checkpoint_dir / LATEST).read_text())["step"] == 10
    assert [p.name for p in job.checkpoint_dir.iterdir() if p.name.startswith(".")] == []
    checkpoint = job.latest_checkpoint()
    assert checkpoint is not None and checkpoint.step == 10 and checkpoint.directory == directory


def test_an_exception_in_the_block_commits_nothing(job: Job) -> None:
    save(job, 5)
    with pytest.raises(RuntimeError), job.save_checkpoint(6) as directory:
        (directory / "state.bin").write_bytes(b"half")
        raise RuntimeError("disk full")
    assert committed_steps(job.checkpoint_dir) == [5]
    assert list(job.checkpoint_dir.glob(".step-*")) == []
    assert json.loads((job.checkpoint_dir / LATEST).read_text())["step"] == 5


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(job: Job) -> None:
    save(job, 10)
    save(job, 20)
    (job.checkpoint_dir / "step-20" / "state.bin").write_bytes(b"flipped!")
    checkpoint = job.latest_checkpoint()
    assert checkpoint is not None and checkpoint.step == 10


def test_a_checkpoint_without_manifest_is_not_committed(job: Job) -> None:
    save(job, 10)
    (job.checkpoint_dir / "step-20").mkdir()
    (job.checkpoint_dir / "step-20" / "state.bin").write_bytes(b"interrupted before the manifest")
    checkpoint = job.latest_checkpoint()
    assert checkpoint is not None and checkpoint.step == 10


def test_saving_a_damaged_step_again_replaces_it(job: Job) -> None:
    save(job, 20)
    (job.checkpoint_dir / "step-20" / "state.bin").write_bytes(b"flipped!")
    save(job, 20)
    assert verify_dir(job.checkpoint_dir / "step-20")[0] is not None


def test_saving_an_intact_step_again_keeps_it(job: Job) -> None:
    save(job, 20, b"first")
    save(job, 20, b"second")
    assert (job.checkpoint_dir / "step-20" / "state.bin").read_bytes() == b"first"


def test_older_checkpoints_beyond_keep_are_pruned(tmp_path: Path) -> None:
    job = Job.from_env(environ=contract_env(tmp_path), keep=2)
    for step in (10, 20, 30, 40):
        save(job, step)
    assert committed_steps(job.checkpoint_dir) == [40, 30]
    assert sorted(p.name for p in job.checkpoint_dir.iterdir()) == [LATEST, "step-30", "step-40"]


def test_latest_json_never_moves_back(job: Job) -> None:
    save(job, 30)
    save(job, 10)
    assert json.loads((job.checkpoint_dir / LATEST).read_text())["step"] == 30


def test_stop_file_makes_should_stop_true_and_it_stays_true(job: Job) -> None:
    assert not job.should_stop()
    assert job.stop_file is not None
    job.stop_file.touch()
    assert job.should_stop()
    job.stop_file.unlink()
    assert job.should_stop()


def test_a_checkpoint_request_is_answered_by_the_next_save(job: Job) -> None:
    assert job.checkpoint_request_file is not None
    job.checkpoint_request_file.touch()
    assert job.checkpoint_requested()
    save(job, 7)
    assert not job.checkpoint_requested()
    assert committed_steps(job.checkpoint_dir) == [7]


def test_progress_is_written_as_json(job: Job) -> None:
    job.report_progress(12, 100, loss=0.5)
    assert job.progress_file is not None
    value = json.loads(job.progress_file.read_text())
    assert (value["step"], value["total_steps"], value["loss"]) == (12, 100, 0.5)


def test_progress_says_when_this_process_first_stepped_past_its_restored_step(job: Job) -> None:
    """The agent's time to first step for a job of your own: the first report past the restored step (a
    report of the restored step itself trained nothing yet), then the same moment in every report."""
    from trainstack_job.records import Progress

    assert job.progress_file is not None
    job.restored_step = 40

    def reported() -> Progress:
        assert job.progress_file is not None
        progress = Progress.from_json(json.loads(job.progress_file.read_text()))
        assert progress is not None
        return progress

    job.report_progress(40, 100)
    assert reported().first_step_at is None
    now = datetime.now(timezone.utc)
    before = now.replace(microsecond=now.microsecond // 1000 * 1000)  # said to the millisecond
    job.report_progress(41, 100)
    first = reported().first_step_at
    assert first is not None and before <= datetime.fromisoformat(first) <= datetime.now(timezone.utc)
    assert first.endswith("Z") and len(first) == len("2026-12-07T09:00:00.000Z"), "spelled as the trainer's"
    job.report_progress(42, 100)
    assert reported().first_step_at == first


def test_manifest_records_the_step_and_epoch(job: Job) -> None:
    with job.save_checkpoint(4, epoch=1) as directory:
        (directory / "state.bin").write_bytes(b"x")
    manifest = json.loads((job.checkpoint_dir / "step-4" / MANIFEST).read_text())
    assert (manifest["step"], manifest["epoch"]) == (4, 1)


LOOP = textwrap.dedent(
    """
    import time
    from trainstack_job import Job

    job = Job.from_env()
    checkpoint = job.latest_checkpoint()
    step = checkpoint.step if checkpoint else 0
    print("ready", step, flush=True)
    while step < 10_000:
        time.sleep(0.01)
        step += 1
        job.report_progress(step, 10_000)
        if job.should_stop():
            with job.save_checkpoint(step) as directory:
                (directory / "state.txt").write_text(str(step))
            job.exit_stopped(step)
    """
)


def test_sigterm_in_a_subprocess_commits_and_exits_75(tmp_path: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    env = {**os.environ, **contract_env(tmp_path), "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(
        [sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    try:
        assert process.stdout is not None
        # Nothing read yet, so nothing buffered: select says when the first line comes (readline alone
        # would wait for ever on a child that hangs before it).
        assert select.select([process.stdout], [], [], 30)[0], "the loop printed nothing within 30 s"
        assert process.stdout.readline().startswith("ready 0")
        progress = tmp_path / "progress.json"
        wait_until(progress.exists, 20, "the loop's first progress report")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == ExitCode.STOPPED
    finally:
        process.kill()
        process.wait()
    steps = committed_steps(tmp_path / "checkpoints")
    assert len(steps) == 1 and steps[0] > 0
    directory = tmp_path / "checkpoints" / f"step-{steps[0]}"
    assert verify_dir(directory)[0] is not None
    assert (directory / "state.txt").read_text() == str(steps[0])


def test_a_sigterm_pending_while_the_job_starts_is_answered_not_fatal(tmp_path: Path) -> None:
    script = tmp_path / "blocked.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, signal
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            os.kill(os.getpid(), signal.SIGTERM)  # arrives while the job is still loading
            from trainstack_job import Job
            job = Job.from_env()
            assert job.should_stop()
            with job.save_checkpoint(0) as directory:
                (directory / "state.txt").write_text("0")
            job.exit_stopped(0)
            """
        )
    )
    env = {**os.environ, **contract_env(tmp_path), "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, timeout=30, check=False)
    assert result.returncode == ExitCode.STOPPED
    assert committed_steps(tmp_path / "checkpoints") == [0]


def test_the_job_files_keep_reaches_the_helper_through_the_agents_variable(tmp_path: Path) -> None:
    environ = {"TRAINSTACK_CHECKPOINT_DIR": str(tmp_path / "ckpt"), "TRAINSTACK_CHECKPOINT_KEEP": "1"}
    job = Job.from_env(environ=environ)
    for step in (1, 2, 3):
        with job.save_checkpoint(step) as directory:
            (directory / "w").write_text(str(step))
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*")) == ["step-3"]
