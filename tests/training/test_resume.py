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
EVERY_STEPS = 3  # conftest FAST: checkpoint.every_steps=3


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


@pytest.mark.slow(seconds=40)
def test_resume_after_stop_files_sigterms_and_a_checkpoint_request_is_bitwise_exact(
    make_run: MakeRun, baseline: Run
) -> None:
    """One job through every way a stop or a save is asked for, resumed after each, ending on the baseline.

    Lives: the agent's stop file present at start (stops at step 0, before training); SIGTERM twice
    (mid-accumulation, in an epoch's last step); the stop file appearing mid-training, as on a spot notice;
    then a checkpoint request file, saved at the next step boundary, deleted, and the job completes. SIGTERM
    in a step's last micro-batch (at a step boundary) is the S3 replacement test's stop below. One job
    rather than four: each life is ~4 s of CPU (almost all of it starting Python and importing torch) and
    the suite must stay under 5 minutes. The stop and request files are config keys outside the
    optimisation, so naming them between lives changes nothing, which the final comparison shows."""
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

    # Resumed from that step-0 checkpoint, stopped by SIGTERM twice: mid-accumulation, then in the epoch's
    # last step. (In a step's last micro-batch: test_replacement_instance_resumes_from_s3_bitwise_exact.)
    stops = [(1, 0), (STEPS_PER_EPOCH - 1, 0)]
    for step, micro in stops:
        code, output = run.life(fault=f"sigterm:micro-batch:step={step},micro={micro}")
        assert code == EXIT_STOPPED, output
        latest = json.loads((run.checkpoints / "latest.json").read_text())
        assert latest["step"] == step + 1, output  # the step in flight is finished, then saved
        assert latest["dir"] == f"step-{step + 1}"
        assert not run.model.exists()
    # The epoch's last step was saved after its evaluation: the checkpoint is at the next epoch.
    assert latest["epoch"] == 1
    resumed = latest["step"]

    # Now the agent's stop file appears mid-training, as on a spot notice. It appears at a moment set by the
    # trainer's own progress, not by a poll racing it (however fast or loaded this machine is): the stop
    # file is a link to the manifest of the next periodic checkpoint, which exists once that checkpoint is
    # committed. That boundary checked for a stop before saving, so the next one sees it and stops there.
    periodic = (resumed // EVERY_STEPS + 1) * EVERY_STEPS
    assert periodic + 1 < TOTAL_STEPS, "the stop must land mid-training"
    stop_file.symlink_to(run.checkpoints / f"step-{periodic}" / "manifest.json")
    code, output = run.life()
    assert code == EXIT_STOPPED, output
    stopped = json.loads((run.checkpoints / "latest.json").read_text())["step"]
    assert stopped == periodic + 1, output
    assert f"stopped at step {stopped} on stop file" in output
    stop_file.unlink()

    # The last life finds a checkpoint request: it saves at its first step boundary and carries on.
    # keep=10 so that checkpoint is not pruned before it is looked at; the log line names its step, which
    # tells it from a periodic checkpoint when that step happens to be one (12, 15) or the last.
    request = run.root / "CHECKPOINT"
    request.touch()
    run = type(run)(run.root, [*run.args, f"train.checkpoint_request_file={request}", "checkpoint.keep=10"])
    code, output = run.life()
    assert code == 0, output
    assert not request.exists()
    assert (run.checkpoints / f"step-{stopped + 1}" / "manifest.json").exists()
    assert f"checkpoint at step {stopped + 1} saved on request" in output
    assert_same_model(run, baseline)


@pytest.mark.slow(seconds=35)
def test_resume_after_sigkills_during_checkpoint_writes_and_at_random_is_bitwise_exact(
    make_run: MakeRun, baseline: Run
) -> None:
    """One job killed with SIGKILL four times: twice mid-checkpoint, then mid-step at a random step, then at
    a random moment.

    The step-6 checkpoint is hit twice: killed after its state file is written but before its manifest
    (the half-written directory is never loaded: the next life resumes at step 3), then after the rename
    but before latest.json (a complete directory that latest.json does not name yet). Then, from step 6,
    a kill in a micro-batch of a step drawn at random, and one at a random moment, then the job completes.
    One job rather than two: each life is ~4 s of CPU and the suite must stay under 5 minutes. Both faults
    hit step 6, which leaves ten steps for the random kills to land in."""
    run = make_run()
    code, output = run.life(fault="sigkill:checkpoint-state-written:step=6")
    assert code == -signal.SIGKILL, output
    code, output = run.life(fault="sigkill:checkpoint-dir-committed:step=6")
    assert code == -signal.SIGKILL, output
    assert "resuming at step 3 " in output
    rng = random.Random(20261129)
    # A step and micro-batch drawn at random, killed there by the trainer's fault hook: it lands however
    # fast or loaded this machine is.
    step, micro = rng.randint(7, TOTAL_STEPS - 2), rng.randint(0, 1)
    code, output = run.life(fault=f"sigkill:micro-batch:step={step},micro={micro}")
    assert code == -signal.SIGKILL, output
    progress = run.output / "progress.json"
    progress.unlink(missing_ok=True)
    process = run.popen()
    wait_until(process, progress.exists)
    # Training has started (its first log line): kill at a random moment of the next half second, which on
    # this job spans several steps and, every third step, a checkpoint write: windows no fault point names.
    # No count of kills is asserted: whether this life is still running then depends on the machine's
    # speed (the rest of the job takes about 2 s here), and a life that finished first is a fine end too.
    time.sleep(rng.uniform(0.0, 0.5))
    process.kill()
    output, _ = process.communicate()
    assert process.returncode in (-signal.SIGKILL, 0), output
    finish(run)
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


@pytest.mark.slow(seconds=14)
def test_replacement_instance_resumes_from_s3_bitwise_exact(
    make_run: MakeRun, baseline: Run, aws: MotoServer
) -> None:
    """Spot interruption: stop (exit 75, upload confirmed), lose the local disk, resume from S3 only, on a
    replacement with another loader worker count.

    The first life reads with two loader workers; the replacement reads with one, as an instance of another
    size (another core count) would. The worker count must not change the result. Both checks share this
    job: each life is ~4 s of CPU and the suite must stay under 5 minutes."""
    import boto3

    boto3.client("s3").create_bucket(Bucket="job")
    run = make_run("checkpoint.uri=s3://job/checkpoints", "output.uri=s3://job/results", "data.num_workers=2")
    # SIGTERM in the step's last micro-batch, at a step boundary: the step is finished, then saved.
    code, output = run.life(env=aws.env(), fault="sigterm:micro-batch:step=5,micro=1")
    assert code == EXIT_STOPPED, output
    assert not run.model.exists()
    assert json.loads((run.checkpoints / "latest.json").read_text()) | {"written_at": None} == {
        "step": 6,
        "epoch": 0,
        "dir": "step-6",
        "written_at": None,
    }
    s3 = boto3.client("s3")
    latest = json.loads(s3.get_object(Bucket="job", Key="checkpoints/latest.json")["Body"].read())
    assert latest["step"] == 6 and latest["dir"] == "step-6"
    shutil.rmtree(run.checkpoints)  # the replacement instance starts with an empty disk
    run = type(run)(run.root, [*run.args, "data.num_workers=1"])
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
