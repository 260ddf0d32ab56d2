"""The Lightning callback: a stop request commits a Lightning checkpoint, exits 75, and the rerun resumes at
the same global step and completes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.job.conftest import installed
from tests.job.runner import JobSandbox
from trainstack_job.contract import ExitCode
from trainstack_job.layout import committed_steps, verify_dir

pytestmark = installed("lightning")

HERE = Path(__file__).parent


@pytest.mark.parametrize("how", ["stop_file", "sigterm"])
def test_lightning_job_stops_with_a_committed_checkpoint_and_resumes_at_the_same_step(
    tmp_path: Path, how: str
) -> None:
    sandbox = JobSandbox(tmp_path)
    stopped = sandbox.run(["lightning_job.py"], HERE, stop_at_step=30, stop_with_sigterm=how == "sigterm")
    assert stopped.returncode == ExitCode.STOPPED, stopped.output
    steps = committed_steps(sandbox.checkpoint_dir)
    assert steps and 30 <= steps[0] < 80, stopped.output
    directory = sandbox.checkpoint_dir / f"step-{steps[0]}"
    assert verify_dir(directory)[0] is not None
    assert (directory / "lightning.ckpt").is_file()
    assert 25 in steps  # the every_n_steps checkpoint before the stop

    resumed = sandbox.run(["lightning_job.py"], HERE)
    assert resumed.returncode == ExitCode.COMPLETED, resumed.output
    assert re.search(rf"^start global_step {steps[0]}$", resumed.output, re.MULTILINE), resumed.output
    assert re.search(r"^end global_step 80$", resumed.output, re.MULTILINE), resumed.output
