"""The heart of the product: interrupted and restarted runs end bit-for-bit where an uninterrupted one does."""

from __future__ import annotations

import json
import random
import signal
import time

import pytest

from tests.training.conftest import STEPS_PER_EPOCH, TOTAL_STEPS, MakeRun, Run

EXIT_STOPPED = 75


def finish(run: Run, max_lives: int = 6) -> None:
    """Restart with the same command until the job completes, as the agent would."""
    for _ in range(max_lives):
        code, output = run.life()
        if code == 0:
            return
        assert code == EXIT_STOPPED, output
    pytest.fail(f"{run.root} did not complete in {max_lives} lives")


def assert_same_model(run: Run, baseline: Run) -> None:
    assert run.model.read_bytes() == baseline.model.read_bytes(), f"{run.model} differs from the baseline"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("step", "micro"),
    [
        (1, 0),  # mid-accumulation, before the first checkpoint exists
        (4, 1),  # after the last micro-batch of a step, between periodic checkpoints
        (STEPS_PER_EPOCH - 1, 0),  # the last step of an epoch, mid-accumulation: eval runs before the save
    ],
    ids=["first-step-mid-accumulation", "step-boundary", "last-step-of-epoch"],
)
def test_resume_after_sigterm_is_bitwise_exact(make_run: MakeRun, baseline: Run, step: int, micro: int) -> None:
    run = make_run()
    code, output = run.life(fault=f"sigterm:micro-batch:step={step},micro={micro}")
    assert code == EXIT_STOPPED, output
    latest = json.loads((run.checkpoints / "latest.json").read_text())
    assert latest["step"] == step + 1  # the step in flight is finished, then saved
    assert latest["dir"] == f"step-{step + 1}"
    assert not run.model.exists()
    finish(run)
    assert_same_model(run, baseline)


@pytest.mark.slow
@pytest.mark.parametrize("point", ["checkpoint-state-written", "checkpoint-dir-committed"])
def test_resume_after_sigkill_during_checkpoint_write_is_bitwise_exact(
    make_run: MakeRun, baseline: Run, point: str
) -> None:
    run = make_run()
    code, _ = run.life(fault=f"sigkill:{point}:step=6")
    assert code == -signal.SIGKILL
    finish(run)
    assert_same_model(run, baseline)


@pytest.mark.slow
def test_resume_after_random_sigkills_is_bitwise_exact(make_run: MakeRun, baseline: Run) -> None:
    rng = random.Random(20261129)
    run = make_run()
    for _ in range(3):
        process = run.popen()
        # Kill somewhere between start-up (~3 s of imports) and the end of training.
        time.sleep(rng.uniform(3.0, 7.0))
        process.kill()
        process.communicate()
        if process.returncode == 0:
            break
    finish(run)
    assert_same_model(run, baseline)


@pytest.mark.slow
def test_stop_file_stops_with_exit_75_and_resume_is_exact(make_run: MakeRun, baseline: Run) -> None:
    run = make_run()
    stop_file = run.root / "STOP"
    stop_file.parent.mkdir(parents=True, exist_ok=True)
    stop_file.touch()
    run = type(run)(run.root, [*run.args, f"train.stop_file={stop_file}"])
    code, output = run.life()
    assert code == EXIT_STOPPED, output
    assert json.loads((run.checkpoints / "latest.json").read_text())["step"] == 1
    stop_file.unlink()
    finish(run)
    assert_same_model(run, baseline)


@pytest.mark.slow
def test_checkpoint_request_file_saves_deletes_it_and_continues(make_run: MakeRun, baseline: Run) -> None:
    run = make_run()
    request = run.root / "CHECKPOINT"
    request.parent.mkdir(parents=True, exist_ok=True)
    request.touch()
    run = type(run)(run.root, [*run.args, f"train.checkpoint_request_file={request}", "checkpoint.keep=10"])
    code, output = run.life()
    assert code == 0, output
    assert not request.exists()
    assert (run.checkpoints / "step-1" / "manifest.json").exists()  # saved at the first step boundary
    assert "saved on request" in output
    assert_same_model(run, baseline)


@pytest.mark.slow
def test_worker_count_does_not_change_the_result(make_run: MakeRun, baseline: Run) -> None:
    run = make_run("data.num_workers=2")
    code, output = run.life()
    assert code == 0, output
    assert_same_model(run, baseline)


def test_progress_json_has_the_agent_fields(baseline: Run) -> None:
    progress = json.loads((baseline.output / "progress.json").read_text())
    assert progress["step"] == progress["total_steps"] == TOTAL_STEPS
    assert progress["epoch"] == progress["epochs"] == 2
    for key in ("loss", "samples_per_s", "data_wait_fraction", "eta_s", "updated_at"):
        assert key in progress
    assert 0 <= progress["data_wait_fraction"] <= 1


def test_completed_run_writes_loadable_artifacts(baseline: Run) -> None:
    import torch

    state = torch.load(baseline.model, weights_only=True)
    assert "classifier.3.weight" in state and state["classifier.3.weight"].shape[0] == 4
    metrics = json.loads((baseline.output / "metrics.json").read_text())
    assert metrics["steps"] == TOTAL_STEPS and len(metrics["epochs"]) == 2
    assert {"train_loss", "val_loss", "train_accuracy", "val_accuracy"} <= set(metrics["final"])
    assert metrics["checkpoints"]["count"] >= 1
    assert (baseline.output / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    latest = json.loads((baseline.checkpoints / "latest.json").read_text())
    assert set(latest) == {"step", "epoch", "dir", "written_at"} and latest["step"] == TOTAL_STEPS
