"""A stop during the trainer's start-up (before the config is read, during slow imports, during the restore)
is a clean exit 75, never a traceback or a death by the default SIGTERM action."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

import pytest

from tests.training.conftest import REPO, MakeRun, Run
from training.stop import stop_signals_blocked

EXIT_STOPPED = 75
# Far more than one test could train: the only way out is the stop.
LONG = "train.epochs=1000"


def _start(run: Run, *, blocked: bool) -> subprocess.Popen[str]:
    # `blocked`: started as a careful parent (the agent, the launcher) should, so even a stop that arrives
    # while the interpreter itself is starting is kept pending until the trainer's handler exists.
    spawn = stop_signals_blocked() if blocked else contextlib.nullcontext()
    env = {k: v for k, v in os.environ.items() if k != "TRAINSTACK_FAULT"}
    with spawn:
        return subprocess.Popen(
            run.command(), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )


def _signal_after(
    run: Run, delay: float, *, blocked: bool, signum: signal.Signals = signal.SIGTERM
) -> tuple[int, str]:
    process = _start(run, blocked=blocked)
    time.sleep(delay)
    process.send_signal(signum)
    output, _ = process.communicate(timeout=180)
    return process.returncode, output


# Three moments: while the interpreter starts (held pending by a careful parent), during the config and the
# first imports, during torch's import and the restore. Once `main` has installed its handler (first thing
# it does), a blocked and a plain spawn take the same path: each later moment is tried with one of them.
# SIGINT and SIGTERM are both stop signals, blocked and handled alike: the first moment is tried with SIGINT,
# whose default in Python (KeyboardInterrupt) is the one a traceback would come from. Each start is a full
# trainer life (imports, restore, the step-0 checkpoint): three, not one per signal and moment.
@pytest.mark.parametrize(
    ("signum", "delay", "blocked"),
    [(signal.SIGINT, 0.05, True), (signal.SIGTERM, 0.5, True), (signal.SIGTERM, 2.0, False)],
    ids=["sigint-0.05s", "sigterm-0.5s", "sigterm-2s-plain-spawn"],
)
def test_a_stop_signal_at_any_moment_of_start_up_exits_75_without_a_traceback(
    make_run: MakeRun, signum: signal.Signals, delay: float, blocked: bool
) -> None:
    run = make_run(LONG)
    code, output = _signal_after(run, delay, blocked=blocked, signum=signum)
    assert code == EXIT_STOPPED, output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output
    assert f"{signum.name} received" in output
    # The stopped life still leaves the restored step (0 here) as a checkpoint for the next life.
    assert (run.checkpoints / "latest.json").is_file(), output


def test_sigterm_before_the_ranks_start_exits_75_without_starting_them(make_run: MakeRun) -> None:
    run = make_run(LONG, "train.processes=2")
    code, output = _signal_after(run, 0.0, blocked=True)
    assert code == EXIT_STOPPED, output
    assert "SIGTERM received before training started" in output
    assert "Traceback" not in output and "[rank" not in output
