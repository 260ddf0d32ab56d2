"""The Lightning callback: a stop request (stop file or SIGTERM) commits a Lightning checkpoint, exits 75, and
the rerun resumes at the same global step and completes."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.forkserver import ForkServer, serving
from tests.job.conftest import installed
from tests.job.runner import JobSandbox
from trainstack_job.contract import ExitCode
from trainstack_job.layout import committed_steps, verify_dir

pytestmark = installed("lightning")

HERE = Path(__file__).parent


@pytest.fixture()
def server() -> Iterator[ForkServer]:
    """The job's lives are forked from one process that has imported Lightning (tests/forkserver.py): the
    import is most of a life's CPU. What lightning_job.py and the runner's hold (hold_at_step.py) import."""
    with serving("lightning.pytorch", "trainstack_job.lightning", "tests.job.hold_at_step") as started:
        yield started


@pytest.mark.slow(seconds=10)
def test_lightning_job_stopped_either_way_resumes_each_time_at_the_committed_step(
    tmp_path: Path, server: ForkServer
) -> None:
    """One job, two stops: the agent's stop file, then SIGTERM. Each commits a Lightning checkpoint and exits
    75; each next life starts at the committed step; the last one completes."""
    sandbox = JobSandbox(tmp_path)
    resumed_at = 0
    for how, at in (("stop_file", 30), ("sigterm", 40)):
        stopped = sandbox.run(
            ["lightning_job.py"], HERE, stop_at_step=at, stop_with_sigterm=how == "sigterm", server=server
        )
        assert stopped.returncode == ExitCode.STOPPED, f"{how}: {stopped.output}"
        assert re.search(rf"^start global_step {resumed_at}$", stopped.output, re.MULTILINE), stopped.output
        steps = committed_steps(sandbox.checkpoint_dir)
        # Held at the first step it reported from `at` on until the stop arrived (tests/job/runner.py): the
        # stop is committed at the very step the job saw it, whatever this machine's speed.
        assert stopped.held_at is not None and at <= stopped.held_at < 50, f"{how}: {stopped.output}"
        assert steps and steps[0] == stopped.held_at, f"{how}: {stopped.output}"
        directory = sandbox.checkpoint_dir / f"step-{steps[0]}"
        assert verify_dir(directory)[0] is not None
        assert (directory / "lightning.ckpt").is_file()
        if how == "stop_file":
            assert 25 in steps  # the every_n_steps checkpoint before the stop
        resumed_at = steps[0]

    resumed = sandbox.run(["lightning_job.py"], HERE, server=server)
    assert resumed.returncode == ExitCode.COMPLETED, resumed.output
    assert re.search(rf"^start global_step {resumed_at}$", resumed.output, re.MULTILINE), resumed.output
    assert re.search(r"^end global_step 50$", resumed.output, re.MULTILINE), resumed.output  # MAX_STEPS
