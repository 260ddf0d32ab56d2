"""Starts and steers a job: the built-in trainer (`python -m training`, one rank per GPU) or a user's own
command, both under the same contract (docs/job-contract.md)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from bootstrap.job import contract_env
from bootstrap.jobuser import AS_AGENT, JobLaunch
from bootstrap.safefiles import replace_file
from training.launch import LISTEN_FD_ENV
from training.stop import stop_signals_blocked
from trainstack_job.contract import PROGRESS, RESUME_COMMAND, ExitCode

DLAMI_PYTHON = Path("/opt/pytorch/bin/python")
CODE_ROOT = Path(__file__).resolve().parent.parent
# Permanent failures: retrying on another instance cannot help, so the agent stops the job at once.
PERMANENT_FAILURES: dict[int, tuple[str, str]] = {
    ExitCode.CONFIG_ERROR: (
        "the trainer config is invalid",
        f"fix the keys named above in trainstack:trainingConfig, run pulumi up, then {RESUME_COMMAND}",
    ),
    ExitCode.DATA_ERROR: (
        "the dataset has too many unreadable files",
        f"fix or remove the files named above, run trainstack data push, then {RESUME_COMMAND}",
    ),
}
# A user's job keeps the same contract (docs/job-contract.md: exits 2 and 65 are permanent: another instance
# would fail the same way), but the words are its own: Python itself exits 2 when it cannot open the script
# and argparse on a bad option, so "the trainer config is invalid" would send the user to the wrong file.
# Short: the reason is also the e-mail's subject (SNS: 100 characters).
USER_JOB_PERMANENT_FAILURES: dict[int, tuple[str, str]] = {
    ExitCode.CONFIG_ERROR: (
        "your job exited 2 (configuration error)",
        "check the job's command and arguments in the file trainstack:job names (Python exits 2 when it "
        f"cannot open the script, argparse on an unknown option), run pulumi up, then {RESUME_COMMAND}",
    ),
    ExitCode.DATA_ERROR: (
        "your job exited 65 (data error)",
        f"fix or remove the data its last lines name, run trainstack data push, then {RESUME_COMMAND}",
    ),
}


def trainer_python() -> str:
    """The DLAMI's PyTorch env when there is one (its torch matches the driver), else this interpreter."""
    return str(DLAMI_PYTHON) if DLAMI_PYTHON.exists() else sys.executable


def default_trainer_command(gpu_count: int) -> list[str]:
    """`python -m training`: one rank per GPU through PyTorch's elastic engine (training/launch.py), set up
    to keep the 0 / 75 contract for the whole group."""
    return [trainer_python(), "-m", "training", f"train.processes={max(gpu_count, 1)}"]


# Under scratch (the instance store where the type has one): a streamed dataset's shards, content-addressed.
SHARD_CACHE = "shard-cache"


@dataclass(frozen=True)
class TrainerPaths:
    """Where a job reads and writes on this instance. Checkpoints and results stay local: the agent's
    persister owns their copies in S3 (checkpoint.uri and output.uri are empty for the built-in trainer)."""

    scratch: Path

    @property
    def checkpoint_dir(self) -> Path:
        return self.scratch / "checkpoints"

    @property
    def data_dir(self) -> Path:
        return self.scratch / "data"

    @property
    def config_file(self) -> Path:
        return self.scratch / "job.yaml"

    @property
    def output_dir(self) -> Path:
        return self.scratch / "output"

    @property
    def progress_file(self) -> Path:
        return self.output_dir / PROGRESS

    @property
    def shard_cache(self) -> Path:
        """A streamed dataset's shards (training/streaming.py), fetched by the trainer itself, as the job's
        user: that user owns the folder, kept across the job's lives on this disk and cleared when another
        job takes the scratch (bootstrap/jobbinding.py), so one job never reads another's shards."""
        return self.scratch / SHARD_CACHE

    @property
    def control_dir(self) -> Path:
        """The agent ↔ job signal files. The job's user owns this folder (bootstrap/jobuser.py): it deletes
        the checkpoint request it has served and the launcher writes its node's result here; the rest of
        scratch stays the agent's."""
        return self.scratch / "control"

    @property
    def stop_file(self) -> Path:
        return self.control_dir / "STOP"

    @property
    def checkpoint_request_file(self) -> Path:
        return self.control_dir / "CHECKPOINT"

    @property
    def node_exit_file(self) -> Path:
        """A multi-node launcher's result for its node (written by the job, read by the agent)."""
        return self.control_dir / "node-exit.json"

    @property
    def start_gate_file(self) -> Path:
        """While this exists the built-in trainer warms up and waits (a standby); removed, it restores the
        newest checkpoint and trains. Beside checkpoints/, not in it: the agent refreshes that folder."""
        return self.control_dir / "START_GATE"

    def overrides(self) -> list[str]:
        """The built-in trainer's config overrides: the same places as the contract's variables."""
        return [
            f"data.train_dir={self.data_dir / 'train'}",
            f"data.val_dir={self.data_dir / 'val'}",
            f"checkpoint.dir={self.checkpoint_dir}",
            "checkpoint.uri=",
            f"output.dir={self.output_dir}",
            "output.uri=",
            f"train.stop_file={self.stop_file}",
            f"train.checkpoint_request_file={self.checkpoint_request_file}",
            f"train.start_gate_file={self.start_gate_file}",
        ]

    def contract_env(self, *, with_data: bool, restored_step: int | None) -> dict[str, str]:
        return contract_env(
            checkpoint_dir=self.checkpoint_dir,
            output_dir=self.output_dir,
            data_dir=self.data_dir if with_data else None,
            stop_file=self.stop_file,
            checkpoint_request_file=self.checkpoint_request_file,
            progress_file=self.progress_file,
            restored_step=restored_step,
        )


class TrainerProcess:
    """One run of the trainer; its output lines go to `on_line` and a tail kept for failure reports."""

    def __init__(
        self,
        command: Sequence[str],
        paths: TrainerPaths,
        job: dict[str, object],
        on_line: Callable[[str], None],
        *,
        defer_early_signals: bool = False,
        user_job: bool = False,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
        launch: JobLaunch = AS_AGENT,
        say: Callable[[str], None] | None = None,
        code_root: Path | None = None,
    ) -> None:
        self._command = list(command)
        # The code the job runs from: the agent's own bundle, or the code the job was submitted with.
        self._code_root = code_root or CODE_ROOT
        # As whom and in which cgroup the job runs (bootstrap/jobuser.py); the agent's own user by default.
        self._launch = launch
        self._unit: str | None = None
        # A user's command runs as given; the built-in trainer also gets its config file and overrides.
        self._user_job = user_job
        self._cwd = cwd or self._code_root
        self._env = dict(env or {})
        # The built-in trainer unblocks SIGTERM once its handler exists (training/stop.py), so a stop sent
        # while its interpreter starts stays pending instead of killing it. A user's job may not: it keeps
        # the default mask, and the stop file still reaches it.
        self._defer_early_signals = defer_early_signals
        self.paths = paths
        self._job = job
        self._on_line = on_line
        # Where the agent says it found a link the job planted at a signal file: the agent's log when the
        # caller gives it, else the job's own output (prefixed), so the line is never lost.
        self._say = say or (lambda line: on_line(f"trainstack agent: {line}"))
        self.tail: deque[str] = deque(maxlen=40)
        self._process: subprocess.Popen[str] | None = None
        self._pump: threading.Thread | None = None

    def update_env(self, values: dict[str, str]) -> None:
        """Variables for the next start (a multi-node job's rendezvous changes with each generation)."""
        self._env.update(values)

    @property
    def argv(self) -> list[str]:
        if self._user_job:
            return list(self._command)
        return [*self._command, "--config", str(self.paths.config_file), *self.paths.overrides()]

    def start(self, *, gated: bool = False) -> None:
        """Start the job; `gated` (a standby, built-in trainer) holds it warm until `open_gate()`."""
        self.paths.output_dir.mkdir(parents=True, exist_ok=True)
        self.paths.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        self.paths.control_dir.mkdir(parents=True, exist_ok=True)
        if not self._user_job:
            self.paths.config_file.write_text(yaml.safe_dump(self._job, sort_keys=False))
        # A stale stop or checkpoint request from an earlier run must not stop this one.
        self.paths.stop_file.unlink(missing_ok=True)
        self.paths.checkpoint_request_file.unlink(missing_ok=True)
        self.paths.progress_file.unlink(missing_ok=True)
        # A gate left by an earlier standby must never hold a holder's start.
        if gated and not self._user_job:
            self._signal(self.paths.start_gate_file)
        else:
            self.paths.start_gate_file.unlink(missing_ok=True)
        # The directories the job writes are its user's; nothing else in scratch is (bootstrap/jobuser.py).
        home = self.paths.scratch / "home"
        self._launch.give(
            [
                self.paths.output_dir,
                self.paths.checkpoint_dir,
                self.paths.control_dir,
                self.paths.shard_cache,
                home,
            ]
        )
        inherited = self._launch.inherited_environment(os.environ, home if self._launch.isolated else None)
        env = {**inherited, "PYTHONUNBUFFERED": "1", **self._env}
        # The bundle on the path: `import trainstack_job` works in any job without an install.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(self._code_root), env.get("PYTHONPATH", "")) if p)
        # The c10d store's listening socket on a multi-node generation's host (bootstrap/multinode.py): the
        # launcher serves the store on it. pass_fds makes it inheritable in the child only, at the same
        # number; the agent's copy stays non-inheritable, so no other child of the agent holds the port.
        listen_fd = self._env.get(LISTEN_FD_ENV, "").strip()
        with stop_signals_blocked() if self._defer_early_signals else contextlib.nullcontext():
            self._unit = self._launch.unit_name()
            self._process = subprocess.Popen(
                self._launch.wrap(self.argv, self._unit),
                cwd=self._cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                bufsize=1,
                # Its own process group: a signal meant for the agent does not hit the trainer unasked.
                start_new_session=True,
                pass_fds=(int(listen_fd),) if listen_fd else (),
            )
        self._pump = threading.Thread(target=self._pump_output, name="trainer-output", daemon=True)
        self._pump.start()

    def _signal(self, path: Path) -> None:
        """Create a signal file in control/, which the job's user owns: it may have put a link at the name
        (to /etc/ld.so.preload), and `touch()` as root would create the file the link names. The link is
        replaced, never followed, so the signal still reaches the job. Not fsynced: the job reads it live,
        and a stop must not wait behind a checkpoint's writeback."""
        replace_file(path, durable=False, say=self._say)

    def open_gate(self) -> None:
        """Let a gated trainer restore the (refreshed) checkpoint directory and train."""
        self.paths.start_gate_file.unlink(missing_ok=True)

    def _pump_output(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for raw in self._process.stdout:
            line = raw.rstrip("\n")
            self.tail.append(line)
            self._on_line(line)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def poll(self) -> int | None:
        code = self._process.poll() if self._process else None
        if code is not None and self._unit is not None:
            # Its main process is gone: so must be anything it left running in its scope.
            self._launch.stop(self._unit)
            self._unit = None
        return code

    def wait(self, timeout: float | None = None) -> int | None:
        if self._process is None:
            return None
        try:
            code = self._process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        if self._pump is not None:
            self._pump.join(timeout=5)
        return code

    def request_stop(self) -> None:
        """Stop at the next step boundary with a committed local checkpoint (exit 75). No network: safe to
        call from the spot watcher the moment a notice is seen."""
        self._signal(self.paths.stop_file)
        if self._process is not None and self._process.poll() is None:
            # The stop file reaches every rank; SIGTERM also wakes a trainer blocked outside the step loop.
            self._process.send_signal(signal.SIGTERM)

    def request_checkpoint(self) -> None:
        """Save a checkpoint at the next optimizer step (the persister uploads it), then carry on."""
        self._signal(self.paths.checkpoint_request_file)

    def kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGKILL)
            self.wait(timeout=30)
        # The whole cgroup, not only the process group: a process the job moved out with setsid too.
        self._launch.stop(self._unit)
        self._unit = None
