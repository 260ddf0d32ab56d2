"""The heart of the product: interrupted, restarted runs end bit-for-bit where an uninterrupted one does."""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import time
from collections.abc import Callable

import pytest

from tests.conftest import MotoServer
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


def wait_until(process: subprocess.Popen[str], condition: Callable[[], bool], timeout: float = 120) -> None:
    """Poll until `condition` holds or the process exits; kill it (and fail) if neither happens in time."""
    deadline = time.monotonic() + timeout
    while process.poll() is None and not condition():
        if time.monotonic() > deadline:
            process.kill()
            process.communicate()
            pytest.fail(f"nothing happened within {timeout}s")
        time.sleep(0.02)


def assert_same_model(run: Run, baseline: Run) -> None:
    assert run.model.read_bytes() == baseline.model.read_bytes(), f"{run.model} differs from the baseline"


@pytest.mark.slow
def test_resume_after_sigterm_is_bitwise_exact(make_run: MakeRun, baseline: Run) -> None:
    """One job stopped three times: mid-accumulation, at a step boundary, and in an epoch's last step."""
    run = make_run()
    stops = [(1, 0), (4, 1), (STEPS_PER_EPOCH - 1, 0)]
    for step, micro in stops:
        code, output = run.life(fault=f"sigterm:micro-batch:step={step},micro={micro}")
        assert code == EXIT_STOPPED, output
        latest = json.loads((run.checkpoints / "latest.json").read_text())
        assert latest["step"] == step + 1, output  # the step in flight is finished, then saved
        assert latest["dir"] == f"step-{step + 1}"
        assert not run.model.exists()
    # The epoch's last step was saved after its evaluation: the checkpoint is at the next epoch.
    assert latest["epoch"] == 1
    finish(run)
    assert_same_model(run, baseline)


@pytest.mark.slow
def test_resume_after_sigkill_during_checkpoint_write_is_bitwise_exact(
    make_run: MakeRun, baseline: Run
) -> None:
    """Killed after the state file is written but before its manifest, then after the rename but before
    latest.json: neither half-finished checkpoint is ever loaded."""
    run = make_run()
    for fault in ("sigkill:checkpoint-state-written:step=6", "sigkill:checkpoint-dir-committed:step=9"):
        code, _ = run.life(fault=fault)
        assert code == -signal.SIGKILL
    finish(run)
    assert_same_model(run, baseline)


@pytest.mark.slow
def test_resume_after_random_sigkills_is_bitwise_exact(make_run: MakeRun, baseline: Run) -> None:
    rng = random.Random(20261129)
    run = make_run()
    progress = run.output / "progress.json"
    kills = 0
    for _ in range(3):
        progress.unlink(missing_ok=True)
        process = run.popen()
        wait_until(process, progress.exists)
        # Training has started (its first log line): kill at a random moment of the next second,
        # which on this job spans several steps and, every third step, a checkpoint write.
        time.sleep(rng.uniform(0.0, 1.0))
        process.kill()
        process.communicate()
        if process.returncode == 0:
            break  # this life finished first
        kills += 1
    assert kills >= 2
    finish(run)
    assert_same_model(run, baseline)


@pytest.mark.slow
def test_stop_file_present_at_start_stops_before_training_and_resume_is_exact(
    make_run: MakeRun, baseline: Run
) -> None:
    run = make_run()
    stop_file = run.root / "STOP"
    stop_file.parent.mkdir(parents=True, exist_ok=True)
    stop_file.touch()
    run = type(run)(run.root, [*run.args, f"train.stop_file={stop_file}"])
    code, output = run.life()
    assert code == EXIT_STOPPED, output
    assert json.loads((run.checkpoints / "latest.json").read_text())["step"] == 0
    assert "stopped at step 0 on stop file" in output
    stop_file.unlink()
    # Now the agent's stop file appears mid-training, as on a spot notice.
    progress = run.output / "progress.json"
    progress.unlink(missing_ok=True)
    process = run.popen()
    wait_until(process, lambda: progress.exists() and json.loads(progress.read_text())["step"] >= 3)
    stop_file.touch()
    output, _ = process.communicate(timeout=120)
    assert process.returncode == EXIT_STOPPED, output
    assert 3 <= json.loads((run.checkpoints / "latest.json").read_text())["step"] < TOTAL_STEPS
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
    """Two loader workers, stopped mid-run, then resumed with a different worker count."""
    run = make_run("data.num_workers=2")
    code, output = run.life(fault="sigterm:micro-batch:step=10,micro=1", timeout=90)
    assert code == EXIT_STOPPED, output
    run = type(run)(run.root, [*run.args, "data.num_workers=1"])
    code, output = run.life(timeout=90)
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


@pytest.mark.slow
def test_replacement_instance_resumes_from_s3_bitwise_exact(
    make_run: MakeRun, baseline: Run, aws: MotoServer
) -> None:
    """Spot interruption: stop (exit 75, upload confirmed), lose the local disk, resume from S3 only."""
    import boto3

    boto3.client("s3").create_bucket(Bucket="job")
    run = make_run("checkpoint.uri=s3://job/checkpoints", "output.uri=s3://job/results")
    code, output = run.life(env=aws.env(), fault="sigterm:micro-batch:step=5,micro=1")
    assert code == EXIT_STOPPED, output
    s3 = boto3.client("s3")
    latest = json.loads(s3.get_object(Bucket="job", Key="checkpoints/latest.json")["Body"].read())
    assert latest["step"] == 6 and latest["dir"] == "step-6"
    shutil.rmtree(run.checkpoints)  # the replacement instance starts with an empty disk
    code, output = run.life(env=aws.env())
    assert code == 0, output
    assert "restored checkpoint from S3 (step=6 uri=s3://job/checkpoints)" in output
    assert_same_model(run, baseline)
    results = s3.list_objects_v2(Bucket="job", Prefix="results/")["Contents"]
    assert sorted(item["Key"] for item in results) == [
        "results/curves.png",
        "results/metrics.json",
        "results/model.pt",
    ]
