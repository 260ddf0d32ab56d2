"""Two CPU ranks (gloo DDP) follow the one-process optimisation at the same global batch and stop together,
whether the stop reaches the launcher or one rank."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.training.conftest import MakeRun, Run
from tests.training.lives import Lives

EXIT_STOPPED = 75


def parameters(run: Run) -> dict[str, torch.Tensor]:
    state = torch.load(run.model, weights_only=True)
    # BatchNorm running statistics are rank 0's own under DDP (as in any DDP job): compare the weights.
    return {
        name: value for name, value in state.items() if "running_" not in name and "num_batches" not in name
    }


def _sigterm_to_the_launcher_once_trained(run: Run, lives: Lives, steps: int) -> tuple[int, str]:
    """Start a life and send SIGTERM to the elastic launcher once the ranks have trained `steps` steps."""
    process = lives.popen(run)
    progress = run.output / "progress.json"
    deadline = time.monotonic() + 120
    while not (progress.exists() and json.loads(progress.read_text() or "{}").get("step", 0) >= steps):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            output, _ = process.communicate()
            pytest.fail(f"the ranks never trained {steps} steps: {output[-3000:]}")
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    return process.wait(), output


@pytest.mark.slow(seconds=49)
def test_two_ranks_stopped_either_way_resume_and_match_one_process(
    make_run: MakeRun, baseline: Run, lives: Lives
) -> None:
    """One two-rank job, stopped twice, then completed.

    First SIGTERM to the elastic launcher (as the agent sends it): the engine would report a rank's 75 as a
    failure and kill ranks 30 s after its SIGTERM, so the launcher keeps SIGTERM to itself, every rank
    commits the checkpoint and the group exits 75. Then SIGTERM to rank 1 alone: rank 0 stops at the same
    step. The resumed job follows the one-process optimisation at the same global batch (the baseline's
    1 process x 2 accumulation x 8; here 2 ranks x 1 x 8). Each life's launcher is forked from the fork
    server (tests/forkserver.py); its ranks are processes that torch's engine starts, as always."""
    run = make_run("train.processes=2")
    code, output = _sigterm_to_the_launcher_once_trained(run, lives, 2)
    assert code == EXIT_STOPPED, output[-3000:]
    assert "ChildFailedError" not in output and "Traceback" not in output
    first = json.loads((run.checkpoints / "latest.json").read_text())["step"]
    assert 2 <= first <= 10, output[-3000:]  # within a few steps of the signal, with steps left to train
    manifest = json.loads((run.checkpoints / f"step-{first}" / "manifest.json").read_text())
    assert manifest["world_size"] == 2

    second = first + 3  # the step in flight when rank 1 is signalled is finished, then saved
    code, output = lives.life(run, fault=f"sigterm:micro-batch:step={second - 1},micro=0,rank=1")
    assert code == EXIT_STOPPED, output
    assert f"resuming at step {first} " in output
    assert "[rank 1] WARNING SIGTERM received" in output
    assert f"stopped at step {second} on another rank" in output  # rank 0 was never signalled
    assert json.loads((run.checkpoints / "latest.json").read_text())["step"] == second
    manifest = json.loads((run.checkpoints / f"step-{second}" / "manifest.json").read_text())
    assert manifest["world_size"] == 2

    code, output = lives.life(run)
    assert code == 0, output
    ddp, single = parameters(run), parameters(baseline)
    assert ddp.keys() == single.keys()
    for name, value in single.items():
        torch.testing.assert_close(ddp[name], value, rtol=1e-4, atol=1e-5, msg=f"{name} drifted")


def test_a_rank_under_the_launcher_records_its_real_code_and_a_clean_stop_is_not_a_failure_to_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from training.launch import RANK_STATUS_DIR, group_exit_code, rank_exit

    monkeypatch.setenv(RANK_STATUS_DIR, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    assert rank_exit(EXIT_STOPPED) == 0, "the engine would kill the other ranks on a 75"
    assert json.loads((tmp_path / "rank-1").read_text())["code"] == 75
    assert rank_exit(3) == 3, "a real failure still stops the group"
    monkeypatch.delenv(RANK_STATUS_DIR)
    assert rank_exit(EXIT_STOPPED) == EXIT_STOPPED, "outside the launcher nothing changes"
    assert (
        group_exit_code([75, 75]) == 75 and group_exit_code([75, -15]) == 1 and group_exit_code([0, 65]) == 65
    )
