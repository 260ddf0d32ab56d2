"""The start gate (`train.start_gate_file`): a warm standby's trainer is ready, waits while the file exists,
and only once the agent removes it restores the newest checkpoint and trains, exactly as an ungated start.

Two trainer launches (one gated resume, one two-rank stop) plus the session's shared baseline, each forked
from the fork server (tests/forkserver.py) without a few CPU-seconds of imports on the 2 shared cores (the
two ranks are processes torch's engine starts). The rest runs in-process, without torch.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from bootstrap.trainer import TrainerPaths
from tests.training.conftest import TINY, TOTAL_STEPS, Dataset, MakeRun, Run
from tests.training.lives import Lives
from training.__main__ import main as trainer_main
from training.__main__ import start_gate_problems
from training.config import ConfigError, build_config
from training.gate import wait_for_start_gate
from trainstack_job.contract import JobEnv
from trainstack_job.layout import latest_json

EXIT_STOPPED = 75
OPENED = "standby: start gate opened after "


def warm_line(gate: Path) -> re.Pattern[str]:
    return re.compile(
        r"standby: warm \(model built, first batch loaded\) in \d+\.\ds; waiting for the start gate "
        + re.escape(str(gate))
        + "$",
        re.MULTILINE,
    )


class Output:
    """A running trainer's merged output, read from its log as it grows, so the test can wait for a line
    with a timeout."""

    def __init__(self, lives: Lives, run: Run) -> None:
        self.log = run.root / "trainer.log"
        self.process = lives.popen(run, log=self.log)

    @property
    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait_for(self, pattern: re.Pattern[str], timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not pattern.search(self.text):
            if self.process.poll() is not None and not pattern.search(self.text):
                pytest.fail(f"the trainer exited before {pattern.pattern!r}:\n{self.text[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"no {pattern.pattern!r} within {timeout}s:\n{self.text[-3000:]}")
            time.sleep(0.02)

    def finish(self, timeout: float = 180) -> int:
        """The exit code, once the trainer has exited (and written its last line)."""
        return self.process.wait(timeout=timeout)


def oldest_checkpoint(baseline: Run) -> int:
    """The oldest step the uninterrupted run kept, one with steps after it (tiny.yaml's keep=2 leaves 15
    and 16: the gated life trains the last step, with the epoch's end and its evaluation)."""
    steps = sorted(int(p.name.removeprefix("step-")) for p in baseline.checkpoints.glob("step-*"))
    assert steps and steps[0] < TOTAL_STEPS, steps
    return steps[0]


def metrics(run: Run) -> dict[str, object]:
    document = json.loads((run.output / "metrics.json").read_text())
    return {key: document[key] for key in ("steps", "epochs", "step_losses", "final")}


def test_a_gated_trainer_waits_warm_then_restores_only_after_the_gate_and_matches_the_ungated_run(
    make_run: MakeRun, baseline: Run, lives: Lives
) -> None:
    """The checkpoint is put in checkpoint.dir only after the warm line, as the agent refreshes it right
    before removing the gate: resuming at its step + 1 proves the restore came after the gate. The baseline
    is the ungated run through that same checkpoint (test_resume shows an ungated resume from it ends on the
    baseline bit for bit), so equal results mean the warm-up batch moved neither the data order nor any RNG.
    One loader worker: the warm-up's persistent worker and its prefetched batches are reused and dropped."""
    gate = make_run().root / "START_GATE"
    run = make_run(f"train.start_gate_file={gate}", "data.num_workers=1")
    gate.parent.mkdir(parents=True, exist_ok=True)
    gate.touch()
    output = Output(lives, run)
    output.wait_for(warm_line(gate))

    time.sleep(0.5)  # several polls of the gate
    assert output.process.poll() is None, output.text
    assert OPENED not in output.text
    # A standby writes nothing of the job's: not even checkpoint.dir or progress.json exist yet.
    assert not run.checkpoints.exists() and not run.output.exists()

    step = oldest_checkpoint(baseline)
    run.checkpoints.mkdir(parents=True)
    shutil.copytree(baseline.checkpoints / f"step-{step}", run.checkpoints / f"step-{step}")
    (run.checkpoints / "latest.json").write_bytes(latest_json(step, 1))
    gate.unlink()

    code = output.finish()
    text = output.text
    assert code == 0, text[-3000:]
    warm, opened = warm_line(gate).search(text), text.find(OPENED)
    resumed = text.find(f"resuming at step {step} ")
    assert warm is not None and warm.end() < opened < resumed, text[-3000:]
    assert re.search(r"standby: start gate opened after \d+\.\ds; restoring$", text, re.MULTILINE)
    # The first step trained is the checkpoint's next one.
    first = re.search(r"epoch \d+/\d+ step (\d+)/", text[resumed:])
    assert first is not None and int(first.group(1)) == step + 1, text[-3000:]
    assert run.model.read_bytes() == baseline.model.read_bytes()
    assert metrics(run) == metrics(baseline)


def test_a_standby_warms_the_data_where_the_restored_checkpoint_resumes_and_still_matches(
    make_run: MakeRun, baseline: Run, lives: Lives
) -> None:
    """The agent restores the newest checkpoint before the gate: the warm-up batch is read at its position
    (for a streamed dataset, its shards and the read-ahead's next ones reach the disk while the standby
    waits), and the run still ends bit for bit on the baseline: the warm-up moved no RNG and no order."""
    gate = make_run().root / "START_GATE"
    run = make_run(f"train.start_gate_file={gate}")
    gate.parent.mkdir(parents=True, exist_ok=True)
    gate.touch()
    step = oldest_checkpoint(baseline)
    run.checkpoints.mkdir(parents=True)
    shutil.copytree(baseline.checkpoints / f"step-{step}", run.checkpoints / f"step-{step}")
    (run.checkpoints / "latest.json").write_bytes(latest_json(step, 1))
    output = Output(lives, run)
    output.wait_for(warm_line(gate))
    # tiny's 8 batches an epoch: step 15 is the second epoch's 7th batch done.
    assert "standby: warming the data at the newest checkpoint's position (epoch 2, batch 7)" in output.text
    gate.unlink()
    code = output.finish()
    assert code == 0, output.text[-3000:]
    assert f"resuming at step {step} " in output.text
    assert run.model.read_bytes() == baseline.model.read_bytes()
    assert metrics(run) == metrics(baseline)


@pytest.mark.slow(seconds=7)
def test_sigterm_while_two_ranks_wait_at_the_gate_exits_75_and_writes_no_step(
    make_run: MakeRun, lives: Lives
) -> None:
    """Both ranks of the elastic launcher warm up and wait; the launcher forwards the agent's SIGTERM, every
    rank leaves the gate together and the group exits 75 with checkpoint.dir untouched."""
    gate = make_run().root / "START_GATE"
    run = make_run(f"train.start_gate_file={gate}", "train.processes=2")
    gate.parent.mkdir(parents=True, exist_ok=True)
    gate.touch()
    output = Output(lives, run)
    output.wait_for(warm_line(gate))
    output.process.send_signal(signal.SIGTERM)

    code = output.finish()
    text = output.text
    assert code == EXIT_STOPPED, text[-3000:]
    assert (
        "standby: stopped on SIGTERM while waiting for the start gate; exit 75 without writing a checkpoint "
        "(a standby never writes the job's steps)"
    ) in text
    assert "Traceback" not in text and "ChildFailedError" not in text and OPENED not in text
    assert not list(run.checkpoints.glob("step-*")) and not (run.checkpoints / "latest.json").exists()
    assert not (run.output / "progress.json").exists()
    assert gate.exists()  # the agent's file: the trainer only reads it


# -- in-process: the wait, the config, the multi-node refusal --------------------------------------------


def _remove_later(path: Path, seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, lambda: path.unlink())
    timer.start()
    return timer


def test_the_wait_ends_when_the_gate_is_removed(tmp_path: Path) -> None:
    gate = tmp_path / "START_GATE"
    gate.touch()
    _remove_later(gate, 0.3)
    started = time.monotonic()
    assert wait_for_start_gate(gate, lambda: False) is True
    # The order is the promise: the wait ended after the gate went (not before). The bound only says it
    # noticed; generous, because a loaded 2-core machine can stall a thread for seconds.
    assert not gate.exists() and time.monotonic() - started < 30


def test_a_stop_while_the_gate_is_there_ends_the_wait_as_a_stop(tmp_path: Path) -> None:
    gate, stop_file = tmp_path / "START_GATE", tmp_path / "STOP"
    gate.touch()
    threading.Timer(0.2, stop_file.touch).start()
    assert wait_for_start_gate(gate, stop_file.exists) is False
    assert gate.exists()


def test_a_stop_after_the_gate_was_removed_is_left_to_the_training_loop(tmp_path: Path) -> None:
    """The agent handed the job over first: the trainer restores and stops at its first step boundary."""
    assert wait_for_start_gate(tmp_path / "gone", lambda: True) is True


def test_the_agents_gate_override_passes_the_config_check_and_leaves_the_optimisation_hash() -> None:
    paths = TrainerPaths(Path("/scratch"))
    assert "train.start_gate_file=/scratch/control/START_GATE" in paths.overrides()
    tree = {"train": {"stop_file": "/scratch/STOP", "checkpoint_request_file": "/scratch/CHECKPOINT"}}
    plain = build_config(tree)
    gated = build_config({"train": {**tree["train"], "start_gate_file": str(paths.start_gate_file)}})
    assert gated.train.start_gate_file == "/scratch/control/START_GATE"
    # Gated and ungated lives of one job are one optimisation: no "config changed" at the restore.
    assert gated.optimisation_hash() == plain.optimisation_hash()


@pytest.mark.parametrize(
    ("train", "checkpoint_dir", "problem"),
    [
        ({"stop_file": "/s/STOP", "start_gate_file": "/s/STOP"}, "/s/checkpoints", "is also train.stop_file"),
        (
            {"checkpoint_request_file": "/s/x/../GATE", "start_gate_file": "/s/GATE"},
            "/s/checkpoints",
            "is also train.checkpoint_request_file",
        ),
        ({"start_gate_file": "/s/checkpoints/GATE"}, "/s/checkpoints/", "is inside checkpoint.dir"),
    ],
)
def test_a_gate_that_is_another_agent_file_or_inside_checkpoint_dir_is_a_config_error(
    train: dict[str, str], checkpoint_dir: str, problem: str
) -> None:
    with pytest.raises(ConfigError) as error:
        build_config({"train": train, "checkpoint": {"dir": checkpoint_dir}})
    [line] = error.value.problems
    assert line.startswith("train.start_gate_file: ") and problem in line


def test_a_multi_node_job_refuses_the_gate_with_a_config_error(
    image_folders: Dataset,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Exit 2 before torch or the launcher: the node rendezvous would hold the other nodes' ranks."""
    gate = tmp_path / "START_GATE"
    config = build_config({"train": {"start_gate_file": str(gate)}})
    assert start_gate_problems(config, {}) == []
    # The agent names the gate on every start: only one that exists (the trainer would wait) is refused.
    assert start_gate_problems(config, {JobEnv.RDZV_ENDPOINT.value: "10.0.0.1:29400"}) == []
    monkeypatch.setenv(JobEnv.RDZV_ENDPOINT.value, "10.0.0.1:29400")
    monkeypatch.setenv(JobEnv.RDZV_ID.value, "job-1")
    gate.touch()
    argv = ["--config", str(TINY), *image_folders.overrides(), f"train.start_gate_file={gate}"]
    assert trainer_main(argv) == 2
    assert (
        "config error: train.start_gate_file: a multi-node job (TRAINSTACK_RDZV_ENDPOINT is set) cannot "
        "start gated"
    ) in capsys.readouterr().err
