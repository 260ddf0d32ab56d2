"""Trainer lives forked from the worker's fork server (tests/forkserver.py) instead of started as processes:
the `lives` fixture (tests/training/conftest.py). Same command, environment and output as `Run.popen` and
`Run.life`; each life costs its own work, not another ~3.7 CPU-seconds of torch imports."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from tests.forkserver import ForkedLife, ForkServer
from tests.training.conftest import REPO, Run

EXIT_STOPPED = 75


class Lives:
    """Starts lives from the fork server and kills, in `reap`, any still running when the test ends."""

    def __init__(self, server: ForkServer) -> None:
        self.server = server
        self.started: list[ForkedLife] = []
        self._count = 0

    def popen(
        self,
        run: Run,
        env: dict[str, str] | None = None,
        fault: str = "",
        *,
        exact_env: bool = False,
        log: Path | None = None,
        listener: socket.socket | None = None,
    ) -> ForkedLife:
        """`run.command()` forked. As `Run.popen`: this process's environment plus `env`, with only `fault`
        as TRAINSTACK_FAULT; with `exact_env`, `env` alone (a node launcher's). `listener` is inherited
        under its own fd number (Popen's pass_fds)."""
        full_env = dict(env or {}) if exact_env else {**os.environ, **(env or {})}
        full_env.pop("TRAINSTACK_FAULT", None)
        if fault:
            full_env["TRAINSTACK_FAULT"] = fault
        run.root.mkdir(parents=True, exist_ok=True)
        self._count += 1
        log = log or run.root / f"life-{self._count}.log"
        fds = () if listener is None else (listener.fileno(),)
        # What follows `python` in the command.
        process = self.server.start(run.command()[1:], full_env, REPO, log, pass_fds=fds)
        self.started.append(process)
        return process

    def life(
        self, run: Run, env: dict[str, str] | None = None, fault: str = "", timeout: float = 180
    ) -> tuple[int, str]:
        process = self.popen(run, env, fault)
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # A hung life fails the test and never outlives it.
            process.kill()
            output, _ = process.communicate(timeout=30)
            pytest.fail(f"{run.root}: a trainer life ran past {timeout}s\n{output[-3000:]}")
        assert process.returncode is not None
        return process.returncode, output

    def finish(self, run: Run, max_lives: int = 6) -> None:
        """Restart with the same command until the job completes, as the agent would."""
        for _ in range(max_lives):
            code, output = self.life(run)
            if code == 0:
                return
            assert code == EXIT_STOPPED, output
        pytest.fail(f"{run.root} did not complete in {max_lives} lives")

    def reap(self) -> None:
        for process in self.started:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)
