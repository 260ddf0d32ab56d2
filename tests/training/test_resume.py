"""The heart of the product: interrupted, restarted runs end bit-for-bit where an uninterrupted one does.

The lives of each job here are forked from a server that has imported the trainer once
(tests/forkserver.py): each is its own process, killed and signalled by pid like `python -m
training`, without paying ~3.7 CPU-seconds of torch imports per life. The baseline they end on is a real
`python -m training` process (tests/training/conftest.py).
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from tests.conftest import MotoServer
from tests.forkserver import ForkedLife
from tests.training.conftest import STEPS_PER_EPOCH, TOTAL_STEPS, MakeRun, Run
from tests.training.lives import Lives

EXIT_STOPPED = 75
EVERY_STEPS = 3  # conftest FAST: checkpoint.every_steps=3


def wait_until(process: ForkedLife, condition: Callable[[], bool], timeout: float = 120) -> None:
    """Poll until `condition` holds or the process exits; kill it (and fail) if neither happens in time."""
    deadline = time.monotonic() + timeout
    while process.poll() is None and not condition():
        if time.monotonic() > deadline:
            process.kill()
            process.wait(timeout=30)
            pytest.fail(f"nothing happened within {timeout}s")
        time.sleep(0.02)


def latest(checkpoints: Path) -> dict[str, object]:
    found: dict[str, object] = json.loads((checkpoints / "latest.json").read_text())
    return found


def assert_same_model(run: Run, baseline: Run) -> None:
    assert run.model.read_bytes() == baseline.model.read_bytes(), f"{run.model} differs from the baseline"


@pytest.mark.slow(seconds=25)
def test_stops_signals_a_checkpoint_request_and_a_replacement_from_s3_resume_bitwise_exact(
    make_run: MakeRun, baseline: Run, aws: MotoServer, lives: Lives
) -> None:
    """One job through every way a stop or a save is asked for, with a spot replacement in the middle,
    resumed after each and ending on the baseline.

    Lives: the agent's stop file present at start (stops at step 0, before training); SIGTERM mid-
    accumulation; SIGTERM in an epoch's last step and its last micro-batch (a step boundary), upload
    confirmed; the local disk lost, a replacement restoring from S3 alone and reading with another loader
    worker count (as an instance with another core count would), stopped by the stop file appearing
    mid-training as on a spot notice; then a checkpoint request file, saved at the next step boundary,
    deleted, and the job completes with its results in S3. One job rather than several: each life costs
    CPU and the suite must stay under 5 minutes. The stop and request files and the loader worker count are
    config keys outside the optimisation, so changing them between lives changes nothing, which the final
    comparison shows."""
    import boto3

    boto3.client("s3").create_bucket(Bucket="job")
    # Run by hand with checkpoint.uri: bootstrap/standalone.py gives the trainer the agent's persister.
    run = replace(
        make_run("checkpoint.uri=s3://job/checkpoints", "output.uri=s3://job/results"),
        module="bootstrap.standalone",
    )
    stop_file = run.root / "STOP"
    stop_file.parent.mkdir(parents=True, exist_ok=True)
    stop_file.touch()
    run = replace(run, args=[*run.args, f"train.stop_file={stop_file}"])
    code, output = lives.life(run, env=aws.env())
    assert code == EXIT_STOPPED, output
    assert latest(run.checkpoints)["step"] == 0
    assert "stopped at step 0 on stop file" in output
    stop_file.unlink()

    # Resumed from that step-0 checkpoint, stopped by SIGTERM twice: mid-accumulation (micro-batch 0 of 2),
    # then in the epoch's last step, in its last micro-batch (at a step boundary). Either way the step in
    # flight is finished, then saved.
    for step, micro in [(1, 0), (STEPS_PER_EPOCH - 1, 1)]:
        code, output = lives.life(run, env=aws.env(), fault=f"sigterm:micro-batch:step={step},micro={micro}")
        assert code == EXIT_STOPPED, output
        assert "checkpoint confirmed, exit 75" in output, output
        assert latest(run.checkpoints) | {"written_at": None} == {
            "step": step + 1,
            "epoch": 0 if step + 1 < STEPS_PER_EPOCH else 1,  # the epoch's last step saves after evaluation
            "dir": f"step-{step + 1}",
            "written_at": None,
        }, output
        assert not run.model.exists()
    resumed = STEPS_PER_EPOCH
    s3 = boto3.client("s3")
    uploaded = json.loads(s3.get_object(Bucket="job", Key="checkpoints/latest.json")["Body"].read())
    assert uploaded["step"] == resumed and uploaded["dir"] == f"step-{resumed}"

    # Spot interruption: the replacement instance starts with an empty disk and restores from S3 alone, with
    # two loader workers (the lives so far read in the main process; the last one reads with one worker).
    # Then the agent's stop file appears mid-training, as on a spot notice. It appears at a moment set by
    # the trainer's own progress, not by a poll racing it (however fast or loaded this machine is): the stop
    # file is a link to the manifest of the next periodic checkpoint, which exists once that checkpoint is
    # committed. That boundary checked for a stop before saving, so the next one sees it and stops there.
    shutil.rmtree(run.checkpoints)
    periodic = (resumed // EVERY_STEPS + 1) * EVERY_STEPS
    assert periodic + 1 < TOTAL_STEPS, "the stop must land mid-training"
    stop_file.symlink_to(run.checkpoints / f"step-{periodic}" / "manifest.json")
    code, output = lives.life(replace(run, args=[*run.args, "data.num_workers=2"]), env=aws.env())
    assert code == EXIT_STOPPED, output
    assert f"restored checkpoint from S3 (step={resumed} uri=s3://job/checkpoints)" in output
    stopped = latest(run.checkpoints)["step"]
    assert stopped == periodic + 1, output
    assert f"stopped at step {stopped} on stop file" in output
    stop_file.unlink()

    # The last life finds a checkpoint request: it saves at its first step boundary and carries on.
    # keep=10 so that checkpoint is not pruned before it is looked at; the log line names its step, which
    # tells it from a periodic checkpoint when that step happens to be one (12, 15) or the last.
    request = run.root / "CHECKPOINT"
    request.touch()
    run = replace(
        run,
        args=[
            *run.args,
            "data.num_workers=1",
            f"train.checkpoint_request_file={request}",
            "checkpoint.keep=10",
        ],
    )
    code, output = lives.life(run, env=aws.env())
    assert code == 0, output
    assert not request.exists()
    assert (run.checkpoints / f"step-{stopped + 1}" / "manifest.json").exists()
    assert f"checkpoint at step {stopped + 1} saved on request" in output
    assert_same_model(run, baseline)
    results = s3.list_objects_v2(Bucket="job", Prefix="results/")["Contents"]
    assert sorted(item["Key"] for item in results) == [
        "results/curves.png",
        "results/metrics.json",
        "results/model.pt",
    ]


@pytest.mark.slow(seconds=8)
def test_resume_after_sigkills_during_checkpoint_writes_and_at_random_is_bitwise_exact(
    make_run: MakeRun, baseline: Run, lives: Lives
) -> None:
    """One job killed with SIGKILL three times: twice in the step-6 checkpoint's write, then at a random
    moment of training, then completed.

    The moments each kill covers:
    - after the state file is written and before the manifest (between the checkpoint's files; a kill
      inside torch.save leaves the same thing, a staging directory without a manifest): that half-written
      directory is never loaded, the next life resumes at step 3. The steps trained since step 3 are lost
      with it, as in any kill mid-training.
    - after the directory is renamed into place and before latest.json names it (during the `latest`
      update; latest.json itself is replaced atomically): the complete directory is what the next life
      resumes from, step 6, although latest.json still names step 3.
    - a random moment after training has started: several steps and, every third step, a checkpoint write,
      windows no fault point names.
    Three kills rather than more: each life costs CPU and the suite must stay under 5 minutes; both named
    faults hit step 6, which leaves ten steps for the random kill to land in."""
    run = make_run()
    code, output = lives.life(run, fault="sigkill:checkpoint-state-written:step=6")
    assert code == -signal.SIGKILL, output
    assert latest(run.checkpoints)["step"] == 3
    code, output = lives.life(run, fault="sigkill:checkpoint-dir-committed:step=6")
    assert code == -signal.SIGKILL, output
    assert "resuming at step 3 " in output
    assert (run.checkpoints / "step-6" / "manifest.json").exists() and latest(run.checkpoints)["step"] == 3

    progress = run.output / "progress.json"
    progress.unlink(missing_ok=True)
    process = lives.popen(run)
    wait_until(process, progress.exists)
    # Training has started (its first log line): kill at a random moment of the next half second, which on
    # this job spans several steps and, every third step, a checkpoint write. No count of kills is asserted:
    # whether this life is still running then depends on the machine's speed (the rest of the job takes
    # about 2 s here), and a life that finished first is a fine end too.
    time.sleep(random.Random(20261129).uniform(0.0, 0.5))
    process.kill()
    output, _ = process.communicate(timeout=30)
    assert process.returncode in (-signal.SIGKILL, 0), output
    assert "resuming at step 6 " in output, output
    lives.finish(run)
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
