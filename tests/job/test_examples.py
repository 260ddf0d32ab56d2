"""The examples under examples/ stop on request with a committed checkpoint and resume where they stopped."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.job.conftest import installed
from tests.job.runner import REPO, JobSandbox
from trainstack_job.contract import ExitCode
from trainstack_job.layout import committed_steps, verify_dir

CHARLM = REPO / "examples" / "charlm"
CHARLM_SMALL = ["train.py", "--steps", "120", "--checkpoint-every", "50", "--hidden", "32", "--seq-len", "32"]


@installed("torch")
def test_charlm_stopped_and_resumed_ends_bitwise_equal_to_an_uninterrupted_run(tmp_path: Path) -> None:
    interrupted = JobSandbox(tmp_path / "interrupted")
    stopped = interrupted.run(CHARLM_SMALL, CHARLM, stop_at_step=20)
    assert stopped.returncode == ExitCode.STOPPED, stopped.output
    steps = committed_steps(interrupted.checkpoint_dir)
    assert steps and 20 <= steps[0] < 120, stopped.output
    assert verify_dir(interrupted.checkpoint_dir / f"step-{steps[0]}")[0] is not None

    resumed = interrupted.run(CHARLM_SMALL, CHARLM)
    assert resumed.returncode == ExitCode.COMPLETED, resumed.output
    assert re.search(rf"^resumed from step {steps[0]}$", resumed.output, re.MULTILINE), resumed.output

    straight = JobSandbox(tmp_path / "straight")
    completed = straight.run(CHARLM_SMALL, CHARLM)
    assert completed.returncode == ExitCode.COMPLETED, completed.output
    assert json.loads((interrupted.output_dir / "metrics.json").read_text()) == json.loads(
        (straight.output_dir / "metrics.json").read_text()
    )
    assert (interrupted.output_dir / "sample.txt").read_text() == (
        straight.output_dir / "sample.txt"
    ).read_text()


LIGHTNING_DIGITS = REPO / "examples" / "lightning-mnist-like"
DIGITS_SMALL = ["train.py", "--steps", "150", "--checkpoint-every", "50"]


@installed("lightning")
def test_lightning_digits_stops_with_a_committed_checkpoint_and_resumes_from_it(tmp_path: Path) -> None:
    sandbox = JobSandbox(tmp_path)
    stopped = sandbox.run(DIGITS_SMALL, LIGHTNING_DIGITS, stop_at_step=10)
    assert stopped.returncode == ExitCode.STOPPED, stopped.output
    steps = committed_steps(sandbox.checkpoint_dir)
    assert steps and 10 <= steps[0] < 150, stopped.output
    directory = sandbox.checkpoint_dir / f"step-{steps[0]}"
    assert verify_dir(directory)[0] is not None

    resumed = sandbox.run(DIGITS_SMALL, LIGHTNING_DIGITS)
    assert resumed.returncode == ExitCode.COMPLETED, resumed.output
    assert f"Restored all states from the checkpoint at {directory / 'lightning.ckpt'}" in resumed.output
    assert json.loads((sandbox.output_dir / "metrics.json").read_text())["steps"] == 150
