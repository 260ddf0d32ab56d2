"""Runs a job script the way the agent does: contract variables set, a stop file touched mid-run (the job
held at that step until the stop arrives: tests/job/hold_at_step.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.forkserver import ForkedLife, ForkServer
from tests.job.hold_at_step import HOLD_ENV
from trainstack_job.contract import JobEnv

REPO = Path(__file__).resolve().parents[2]
HOLD = Path(__file__).with_name("hold_at_step.py")


@dataclass(frozen=True)
class Run:
    returncode: int
    output: str

    @property
    def held_at(self) -> int | None:
        """The step the job was held at until its stop arrived (hold_at_step.py), if it was."""
        found = re.search(r"^test hold: at step (\d+) until the stop arrives$", self.output, re.MULTILINE)
        return int(found.group(1)) if found else None


class JobSandbox:
    """The directories and files the agent would give one job, under `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.checkpoint_dir = root / "checkpoints"
        self.output_dir = root / "output"
        self.stop_file = root / "stop"
        self.progress_file = root / "progress.json"

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1",
            JobEnv.CHECKPOINT_DIR.value: str(self.checkpoint_dir),
            JobEnv.OUTPUT_DIR.value: str(self.output_dir),
            JobEnv.DATA_DIR.value: str(self.root / "data"),
            JobEnv.STOP_FILE.value: str(self.stop_file),
            JobEnv.CHECKPOINT_REQUEST_FILE.value: str(self.root / "checkpoint-request"),
            JobEnv.PROGRESS_FILE.value: str(self.progress_file),
            JobEnv.RESTORED_STEP.value: "",
            **(extra or {}),
        }

    def progress_step(self) -> int:
        try:
            return int(json.loads(self.progress_file.read_text())["step"])
        except (OSError, ValueError, KeyError):
            return -1

    def run(
        self,
        argv: list[str],
        cwd: Path,
        *,
        stop_at_step: int | None = None,
        stop_with_sigterm: bool = False,
        timeout: float = 60,
        env: dict[str, str] | None = None,
        server: ForkServer | None = None,
    ) -> Run:
        """Run `python argv...`; with `stop_at_step`, touch the stop file (or send SIGTERM) once progress
        reaches it. The job is held at the first step it reports from there until the stop arrives, so the
        stop lands at that step however fast this machine is (`Run.held_at` names it). With `server`, the
        process is forked from it (tests/forkserver.py) instead of started afresh."""
        self.stop_file.unlink(missing_ok=True)
        self.progress_file.unlink(missing_ok=True)
        log = self.root / f"run-{time.monotonic_ns()}.log"
        deadline = time.monotonic() + timeout
        with log.open("w") as sink:
            extra = dict(env or {})
            command = [sys.executable, *argv]
            if stop_at_step is not None:
                extra[HOLD_ENV] = str(stop_at_step)
                command = [sys.executable, str(HOLD), *argv]
            process: subprocess.Popen[bytes] | ForkedLife
            if server is None:
                process = subprocess.Popen(
                    command, cwd=cwd, env=self.env(extra), stdout=sink, stderr=subprocess.STDOUT
                )
            else:
                process = server.start(command[1:], self.env(extra), cwd, log)
            try:
                while process.poll() is None and time.monotonic() < deadline:
                    if stop_at_step is not None and self.progress_step() >= stop_at_step:
                        if stop_with_sigterm:
                            process.send_signal(signal.SIGTERM)
                        else:
                            self.stop_file.touch()
                        stop_at_step = None
                    time.sleep(0.05)  # the job is held at the step until the stop arrives: no race
                returncode = process.wait(timeout=max(1.0, deadline - time.monotonic()))
            finally:
                process.kill()
                process.wait()
        return Run(returncode, log.read_text())
