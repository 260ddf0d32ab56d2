"""The Hugging Face Trainer callback: a stop request commits the Trainer's checkpoint as a trainstack step,
exits 75, and the rerun resumes at the same global step and completes."""

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

pytestmark = installed("transformers", "accelerate")  # the Trainer needs accelerate

HERE = Path(__file__).parent


@pytest.fixture()
def server() -> Iterator[ForkServer]:
    """Both lives are forked from one process that has imported the Trainer (tests/forkserver.py): the
    import is most of a life's CPU. What hf_job.py and the runner's hold (hold_at_step.py) import."""
    modules = ("transformers.models.gpt2.modeling_gpt2", "transformers.trainer", "trainstack_job.hf")
    with serving(*modules, "tests.job.hold_at_step") as started:
        yield started


@pytest.mark.slow(seconds=8)
def test_hf_trainer_job_stops_with_a_committed_checkpoint_and_resumes_at_the_same_step(
    tmp_path: Path, server: ForkServer
) -> None:
    sandbox = JobSandbox(tmp_path)
    stopped = sandbox.run(["hf_job.py"], HERE, stop_at_step=15, server=server)
    assert stopped.returncode == ExitCode.STOPPED, stopped.output
    steps = committed_steps(sandbox.checkpoint_dir)
    # Held at the first step it reported from 15 on until the stop arrived (tests/job/runner.py): the stop
    # is committed at the very step the job saw it, whatever this machine's speed.
    assert stopped.held_at is not None and 15 <= stopped.held_at < 25, stopped.output
    assert steps and steps[0] == stopped.held_at, stopped.output
    assert 10 in steps  # the Trainer's own save_steps checkpoint, committed too
    directory = sandbox.checkpoint_dir / f"step-{steps[0]}"
    assert verify_dir(directory)[0] is not None
    assert (directory / "trainer_state.json").is_file()
    assert not list(sandbox.output_dir.glob("checkpoint-*"))  # moved into the checkpoint directory

    resumed = sandbox.run(["hf_job.py"], HERE, server=server)
    assert resumed.returncode == ExitCode.COMPLETED, resumed.output
    assert re.search(rf"^start global_step {steps[0]}$", resumed.output, re.MULTILINE), resumed.output
    assert re.search(r"^end global_step 25$", resumed.output, re.MULTILINE), resumed.output  # MAX_STEPS
    assert (sandbox.output_dir / "model.safetensors").is_file()
