"""The charlm example stops on request with a committed checkpoint and resumes bit for bit. Lightning's stop
and resume under the real agent are tests/bootstrap/test_demo_queue.py's (its own restore line included); the
Lightning callback alone is tests/job/test_lightning.py's."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.forkserver import ForkServer, serving
from tests.job.conftest import installed
from tests.job.runner import REPO, JobSandbox
from trainstack_job.contract import ExitCode
from trainstack_job.layout import committed_steps, verify_dir

CHARLM = REPO / "examples" / "charlm"
# Stopped at 10, resumed to 20 (a periodic checkpoint at 15 on the way): a resume at step 10 is as exact at
# 20 steps as at 120, and each of the three runs pays only its start (Python, torch) and the steps it trains.
STOP_AT, STEPS = 10, 20
CHARLM_SMALL = [
    "train.py",
    *("--steps", str(STEPS), "--checkpoint-every", "15", "--hidden", "32", "--seq-len", "32"),
]


@pytest.fixture()
def server() -> Iterator[ForkServer]:
    """The interrupted job's two lives are forked from one process that has imported torch
    (tests/forkserver.py): the import is most of a life's CPU. The uninterrupted run they must equal is a
    process of its own, as the job runs under the agent."""
    with serving("torch", "trainstack_job", "tests.job.hold_at_step") as started:
        yield started


@pytest.mark.slow(seconds=10)
@installed("torch")
def test_charlm_stopped_and_resumed_ends_bitwise_equal_to_an_uninterrupted_run(
    tmp_path: Path, server: ForkServer
) -> None:
    interrupted = JobSandbox(tmp_path / "interrupted")
    stopped = interrupted.run(CHARLM_SMALL, CHARLM, stop_at_step=STOP_AT, server=server)
    assert stopped.returncode == ExitCode.STOPPED, stopped.output
    steps = committed_steps(interrupted.checkpoint_dir)
    # Held at the first step it reported from STOP_AT on until the stop arrived (tests/job/runner.py): the
    # stop is committed at the very step the job saw it, whatever this machine's speed.
    assert stopped.held_at is not None and STOP_AT <= stopped.held_at < STEPS, stopped.output
    assert steps and steps[0] == stopped.held_at, stopped.output
    assert verify_dir(interrupted.checkpoint_dir / f"step-{steps[0]}")[0] is not None

    resumed = interrupted.run(CHARLM_SMALL, CHARLM, server=server)
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
