"""The job's process supervised to its exit (bootstrap/supervisor.py): a stall restarts the trainer once and
gives up the second time, a stopping trainer is killed at the stop deadline (which leaves the final upload
its measured time) or at the lease's end by this instance's clock, and each exit is said as what it means for
the life: completed, the stop's own outcome, a stop by the system, a permanent failure with its fix, or a
failure with the signature the crash-loop guard compares. No trainer process, no AWS: a scripted trainer."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import sys
import time
from collections import deque
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, cast

import pytest

from bootstrap import jobuser
from bootstrap import supervisor as supervisor_module
from bootstrap.agent_config import AgentConfig, Prefixes
from bootstrap.eventlog import EventLog
from bootstrap.imds import InstanceIdentity
from bootstrap.job import VENV_READY, pinned_constraints
from bootstrap.jobuser import job_session_policy
from bootstrap.outcomes import Failure, LifeEnd
from bootstrap.persist import CheckpointPersister, PersistResult
from bootstrap.secrets import SecretUnavailableError
from bootstrap.stops import STOP_OUTCOMES, StopRequests
from bootstrap.supervisor import Supervisor, TrainerExit, credentials_directory
from bootstrap.trainer import TrainerPaths, TrainerProcess, trainer_python
from trainstack_job.contract import RESUME_COMMAND
from trainstack_job.jobfile import JobSpec, JobSpecError


class Script:
    """The trainer as the supervisor sees it: each poll runs the next step of its script (a progress step
    to write, an exit code, or None for a poll that changes nothing), then repeats the last one."""

    def __init__(self, paths: TrainerPaths, *steps: tuple[str, Any] | None) -> None:
        self.paths = paths
        self.steps = list(steps)
        self.tail: deque[str] = deque(maxlen=40)
        self.code: int | None = None
        self.polls = 0
        self.kills: list[float] = []
        self.starts = 0
        self.first_poll = 0.0

    def poll(self) -> int | None:
        self.polls += 1
        if self.polls == 1:
            self.first_poll = time.monotonic()
        # Each test's own deadline: a supervisor that never kills nor returns fails here, named.
        assert time.monotonic() - self.first_poll < 10, f"still supervised after 10 s ({self.polls} polls)"
        if self.code is None and self.steps:
            step = self.steps.pop(0) if len(self.steps) > 1 else self.steps[0]
            kind, value = step or ("wait", None)
            if kind == "step":
                self.paths.output_dir.mkdir(parents=True, exist_ok=True)
                self.paths.progress_file.write_text(json.dumps({"step": value}))
            elif kind == "exit":
                self.code = value
        return self.code

    def kill(self) -> None:
        self.kills.append(time.monotonic())
        self.code = -9

    def start(self) -> None:
        self.starts += 1
        self.code = None


class Persister:
    """What the stop deadline reads of the persister: how long its uploads took."""

    def __init__(self, *upload_seconds: float) -> None:
        self.upload_seconds = list(upload_seconds)


class Run:
    """A supervisor with its stop requests and a log the test reads back."""

    def __init__(self, tmp_path: Path, user_job: JobSpec | None = None, **config: Any) -> None:
        self.stream = io.StringIO()
        self.log = EventLog(self.stream)
        base: dict[str, Any] = {
            "region": "us-east-1",
            "bucket": "b",
            "group_name": "g",
            "topic_arn": "arn:t",
            "log_group": "/l",
        }
        self.config = AgentConfig(**(base | config))
        self.stops = StopRequests(self.log, deadline_seconds=self.config.stop_deadline_seconds)
        self.supervisor = Supervisor(
            self.config,
            self.log,
            self.stops,
            user_job=user_job,
            job_root=tmp_path,
            trainer_command=None,
            tick_seconds=0.005,
        )
        self.paths = TrainerPaths(tmp_path / "scratch")

    def trainer(self, *steps: tuple[str, Any] | None) -> Script:
        return Script(self.paths, *steps)

    def supervise(self, trainer: Script, *uploads: float, watch_silent: bool = False) -> TrainerExit:
        return self.supervisor.supervise(
            cast(TrainerProcess, trainer),
            cast(CheckpointPersister, Persister(*uploads)),
            watch_silent=watch_silent,
        )

    def classify(
        self,
        code: TrainerExit,
        trainer: Script,
        reason: str | None = None,
        persisted: PersistResult | None = None,
    ) -> LifeEnd | Failure:
        return self.supervisor.classify_exit(
            code, reason, persisted or PersistResult(10, 10), cast(TrainerProcess, trainer)
        )

    @property
    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.stream.getvalue().splitlines()]

    def said(self, message: str) -> list[dict[str, Any]]:
        return [event for event in self.events if event["message"] == message]


def user_job(**fields: Any) -> JobSpec:
    return JobSpec(name="mine", command=("python", "train.py"), **fields)


# -- supervising to the exit ------------------------------------------------------------------------------


def test_a_trainer_that_exits_on_its_own_is_its_exit_code(tmp_path: Path) -> None:
    run = Run(tmp_path)
    trainer = run.trainer(("step", 1), ("step", 2), ("exit", 0))
    assert run.supervise(trainer) == 0
    assert trainer.kills == [] and trainer.starts == 0
    failing = run.trainer(("step", 1), ("exit", 3))
    assert run.supervise(failing) == 3


def test_a_trainer_that_stops_in_time_is_not_killed(tmp_path: Path) -> None:
    run = Run(tmp_path)
    run.stops.request("spot")
    trainer = run.trainer(None, None, ("exit", 75))
    assert run.supervise(trainer) == 75 and trainer.kills == []


def test_a_stopping_trainer_is_killed_at_the_stop_deadline(tmp_path: Path) -> None:
    """The budget less the final upload's share (twice the slowest upload + 2 s, at most half the budget)."""
    run = Run(tmp_path, stop_deadline_seconds=0.4)
    run.stops.request("spot")
    _, seen_at = run.stops.state()
    assert seen_at is not None
    trainer = run.trainer(("step", 5))
    assert run.supervise(trainer) is LifeEnd.KILLED
    [killed_at] = trainer.kills
    assert 0.2 <= killed_at - seen_at < 0.4, "killed at half the budget (the upload's share is capped)"
    [said] = run.said("trainer missed the stop deadline; killing it (its newest checkpoint may be lost)")
    assert (said["stage"], said["reason"]) == ("stop", "spot")


def test_the_stop_deadline_leaves_the_final_upload_twice_its_measured_time(tmp_path: Path) -> None:
    supervisor = Run(tmp_path, stop_deadline_seconds=100).supervisor

    def deadline(*uploads: float) -> float:
        return supervisor.trainer_deadline(1000.0, cast(CheckpointPersister, Persister(*uploads)))

    assert deadline(3.0, 1.0) == 1000 + 100 - (2 * 3 + 2), "the slowest upload, twice, plus 2 s"
    assert deadline() == 1000 + 100 - (2 * 5 + 2), "no upload measured yet: 5 s assumed"
    assert deadline(30.0) == 1000 + 100 - 50, "at most half the budget"


def test_a_trainer_still_running_at_the_leases_end_is_killed_then(tmp_path: Path) -> None:
    run = Run(tmp_path, stop_deadline_seconds=100)
    run.stops.request("lease_expiring")
    run.stops.kill_by(time.monotonic() + 0.15)
    trainer = run.trainer(("step", 5))
    started = time.monotonic()
    assert run.supervise(trainer) is LifeEnd.KILLED
    assert 0.15 <= trainer.kills[0] - started < 5, "at the lease's end, long before the stop deadline"
    [said] = run.said("trainer still running at the lease's end on this instance's clock; killing it")
    assert (said["stage"], said["reason"]) == ("stop", "lease_expiring")


def test_a_kill_time_is_only_acted_on_once_a_stop_was_asked(tmp_path: Path) -> None:
    run = Run(tmp_path)
    run.stops.kill_by(time.monotonic() - 1)
    trainer = run.trainer(("step", 1), ("step", 2), ("exit", 0))
    assert run.supervise(trainer) == 0 and trainer.kills == []


def test_a_stall_restarts_the_trainer_once_and_a_second_stall_gives_up(tmp_path: Path) -> None:
    run = Run(tmp_path, stall_minutes=0.1 / 60)
    trainer = run.trainer(("step", 7))
    assert run.supervise(trainer) is LifeEnd.STALLED
    assert trainer.starts == 1 and len(trainer.kills) == 2
    [first] = run.said("no training progress; restarting the trainer once")
    [second] = run.said("training stalled again after a restart; giving up")
    assert first["stage"] == second["stage"] == "stall"
    assert first["idle_s"] == 0 and second["idle_s"] == 0
    assert trainer.kills[1] - trainer.kills[0] >= 0.1, "the restarted trainer gets the whole stall time again"


def test_a_trainer_that_advances_is_never_taken_for_stalled(tmp_path: Path) -> None:
    run = Run(tmp_path, stall_minutes=0.05 / 60)
    trainer = slow(run.trainer(*[("step", n) for n in range(40)], ("exit", 0)))
    assert run.supervise(trainer) == 0 and trainer.kills == []


def slow(trainer: Script) -> Script:
    """Each poll takes 10 ms: a run of polls outlasts the stall limits these tests set."""
    real_poll = trainer.poll

    def poll() -> int | None:
        time.sleep(0.01)
        return real_poll()

    trainer.poll = poll  # type: ignore[method-assign]
    return trainer


def test_a_job_that_never_reports_progress_is_watched_only_when_asked(tmp_path: Path) -> None:
    run = Run(tmp_path, stall_minutes=0.05 / 60)
    silent = run.trainer(*[None] * 30, ("exit", 0))
    assert run.supervise(slow(silent)) == 0 and silent.kills == [], "a silent user job is not watched"
    watched = slow(run.trainer(None))
    assert run.supervise(watched, watch_silent=True) is LifeEnd.STALLED


def test_a_stopping_trainer_is_not_taken_for_stalled(tmp_path: Path) -> None:
    run = Run(tmp_path, stall_minutes=0.01 / 60)
    run.stops.request("spot")
    trainer = run.trainer(*[("step", 3)] * 30, ("exit", 75))
    assert run.supervise(trainer) == 75 and trainer.kills == [] and trainer.starts == 0


# -- what each exit means for the life ---------------------------------------------------------------


def test_an_exit_0_is_completed_even_after_a_stop_unless_the_lease_was_lost(tmp_path: Path) -> None:
    run = Run(tmp_path)
    trainer = run.trainer()
    assert run.classify(0, trainer) is LifeEnd.COMPLETED
    assert run.classify(0, trainer, "spot") is LifeEnd.COMPLETED
    assert run.classify(0, trainer, "lease_lost") is LifeEnd.SUPERSEDED, "the new holder ends the job"


@pytest.mark.parametrize("reason", sorted(STOP_OUTCOMES))
def test_a_stop_ends_the_life_with_its_reasons_outcome(tmp_path: Path, reason: str) -> None:
    run = Run(tmp_path)
    assert run.classify(75, run.trainer(), reason) is STOP_OUTCOMES[reason]
    assert run.classify(1, run.trainer(), reason) is STOP_OUTCOMES[reason], "whatever the exit"


def test_an_exit_75_nobody_here_asked_for_is_the_system_stopping_the_instance(tmp_path: Path) -> None:
    run = Run(tmp_path)
    assert run.classify(75, run.trainer()) is LifeEnd.PREEMPTED
    [said] = run.said("trainer stopped by the system")
    assert (said["stage"], said["exit_code"]) == ("stop", 75)


def test_a_stall_is_a_failure_with_the_jobs_last_lines(tmp_path: Path) -> None:
    run = Run(tmp_path)
    trainer = run.trainer()
    trainer.tail.extend(f"line {n}" for n in range(30))
    failure = run.classify(LifeEnd.STALLED, trainer)
    assert failure == Failure(LifeEnd.STALLED, "trainer stalled", [f"line {n}" for n in range(5, 30)])


def test_a_failure_without_output_reports_the_agents_own_last_lines(tmp_path: Path) -> None:
    run = Run(tmp_path)
    run.log.event("train", "the agent's last word")
    failure = run.classify(LifeEnd.STALLED, run.trainer())
    assert isinstance(failure, Failure) and failure.lines == list(run.log.tail)
    failure = run.classify(1, run.trainer())
    assert isinstance(failure, Failure) and failure.lines and "the agent's last word" in failure.lines[0]


@pytest.mark.parametrize(
    ("code", "why", "fix"),
    [
        (2, "the trainer config is invalid", "fix the keys named above in trainstack:trainingConfig"),
        (65, "the dataset has too many unreadable files", "fix or remove the files named above"),
    ],
)
def test_the_builtin_trainers_permanent_failures_stop_the_job_with_the_fix(
    tmp_path: Path, code: int, why: str, fix: str
) -> None:
    run = Run(tmp_path)
    trainer = run.trainer()
    trainer.tail.append("bad key train.lr")
    failure = run.classify(code, trainer)
    assert isinstance(failure, Failure) and failure.permanent and failure.outcome is LifeEnd.FAILED
    assert failure.reason == f"{why} (trainer exit {code})"
    assert failure.fix.startswith(fix) and failure.fix.endswith(RESUME_COMMAND)
    assert failure.lines == ["bad key train.lr"]


def test_any_other_exit_is_a_failure_signed_with_its_code_and_step(tmp_path: Path) -> None:
    run = Run(tmp_path)
    trainer = run.trainer(("step", 42))
    trainer.poll()
    trainer.tail.extend(["Traceback", "RuntimeError: CUDA error"])
    failure = run.classify(1, trainer)
    assert failure == Failure(
        LifeEnd.FAILED,
        "trainer exited 1",
        ["Traceback", "RuntimeError: CUDA error"],
        signature={"exit_code": 1, "step": 42},
    )
    [said] = run.said("trainer exited with a failure")
    assert (said["stage"], said["exit_code"], said["step"]) == ("failed", 1, 42)
    killed = run.classify(LifeEnd.KILLED, trainer)
    assert isinstance(killed, Failure) and not killed.permanent
    assert killed.reason == "trainer exited killed" and killed.signature == {
        "exit_code": "killed",
        "step": 42,
    }
    assert json.loads(json.dumps(killed.signature)) == killed.signature, "plain values: the ledger stores it"


@pytest.mark.parametrize(
    ("code", "why", "fix"),
    [
        (2, "your job exited 2 (configuration error)", "check the job's command and arguments"),
        (65, "your job exited 65 (data error)", "fix or remove the data its last lines name"),
    ],
)
def test_a_users_jobs_permanent_failures_are_said_in_its_own_words(
    tmp_path: Path, code: int, why: str, fix: str
) -> None:
    run = Run(tmp_path, user_job=user_job())
    failure = run.classify(code, run.trainer())
    assert isinstance(failure, Failure) and failure.permanent
    assert (failure.reason, failure.fix.startswith(fix)) == (why, True)


def test_a_users_job_that_fails_otherwise_is_signed_with_its_code_and_step(tmp_path: Path) -> None:
    run = Run(tmp_path, user_job=user_job())
    trainer = run.trainer(("step", 9))
    trainer.poll()
    failure = run.classify(3, trainer)
    assert isinstance(failure, Failure) and not failure.permanent
    assert failure.reason == "your job exited 3" and failure.signature == {"exit_code": 3, "step": 9}
    stalled = run.classify(-11, trainer)
    assert isinstance(stalled, Failure) and stalled.reason == "your job exited -11"


def test_the_stop_line_names_the_steps_and_the_time_since_the_notice(tmp_path: Path) -> None:
    run = Run(tmp_path)
    run.stops.request("spot")
    trainer = run.trainer(("step", 44))
    trainer.poll()
    run.classify(75, trainer, "spot", PersistResult(newest_local_step=44, confirmed_step=44))
    [line] = [e for e in run.events if e["stage"] == "stop" and e["message"].startswith("trainer stopped")]
    assert (line["reason"], line["exit_code"], line["checkpoint_confirmed"]) == ("spot", 75, True)
    assert (line["checkpoint_step"], line["newest_local_step"], line["reached_step"]) == (44, 44, 44)
    assert 0 <= line["notice_to_exit_s"] < 5


def test_a_stop_line_without_a_stop_seen_names_no_notice_time(tmp_path: Path) -> None:
    run = Run(tmp_path)
    run.classify(75, run.trainer(), "spot", PersistResult(newest_local_step=4, confirmed_step=4))
    [line] = [e for e in run.events if e["stage"] == "stop"]
    assert "notice_to_exit_s" not in line and line["reached_step"] is None


def test_a_superseded_generations_stop_line_says_its_steps_are_not_the_jobs(tmp_path: Path) -> None:
    run = Run(tmp_path)
    run.classify(
        75, run.trainer(), "generation_superseded", PersistResult(newest_local_step=50, confirmed_step=40)
    )
    [line] = [e for e in run.events if e["stage"] == "stop"]
    assert line["message"] == (
        "checkpoint step 50 NOT confirmed: a newer generation owns the job and trains on from the confirmed "
        "one; the confirmed checkpoint (step 40) is kept"
    )
    assert line["checkpoint_confirmed"] is False


def test_the_jobs_credentials_live_in_a_folder_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = TrainerPaths(tmp_path)
    monkeypatch.setattr(supervisor_module.os, "geteuid", lambda: 1000)
    assert credentials_directory(paths, "resnet-1a2b3c4d") == tmp_path / "job-credentials" / "resnet-1a2b3c4d"
    assert credentials_directory(paths, "") == tmp_path / "job-credentials" / "default"
    monkeypatch.setattr(supervisor_module.os, "geteuid", lambda: 0)
    assert credentials_directory(paths, "resnet-1a2b3c4d") == (
        Path("/run/trainstack/job-credentials") / "resnet-1a2b3c4d"
    )


# -- the job's process as built for this life (`job_process`): no process is started -----------------------


IDENTITY = InstanceIdentity("i-0abc", "g5.xlarge", "us-east-1a", "us-east-1", "spot")


def build(
    run: Run,
    *,
    gpus: int = 1,
    restored: int | None = 120,
    identity: InstanceIdentity | None = IDENTITY,
    interruptions: tuple[int, float] = (0, 0.0),
) -> TrainerProcess:
    shipped: list[str] = []
    return run.supervisor.job_process(
        run.paths,
        gpus,
        restored,
        identity=identity,
        spot_interruptions=interruptions,
        log_sink=lambda: shipped.append,
    )


def test_the_builtin_trainer_gets_the_contract_its_context_and_its_config_without_secrets(
    tmp_path: Path,
) -> None:
    run = Run(tmp_path, job={"train": {"steps": 5}}, job_id="resnet-1a2b3c4d", bundle_sha256="abc123")
    trainer = build(run, gpus=2, interruptions=(3, 6.0))
    env = trainer._env
    paths = run.paths
    assert env["TRAINSTACK_CHECKPOINT_DIR"] == str(paths.checkpoint_dir)
    assert env["TRAINSTACK_DATA_DIR"] == str(paths.data_dir), "the built-in trainer reads the synced data"
    assert env["TRAINSTACK_RESTORED_STEP"] == "120"
    assert env["TRAINSTACK_CHECKPOINT_KEEP"] == "3"
    assert env["TRAINSTACK_MTBI_HOURS"] == "2.000", "the ledger's interruptions tell the checkpoint interval"
    assert (env["TRAINSTACK_JOB_ID"], env["TRAINSTACK_CODE_HASH"]) == ("resnet-1a2b3c4d", "abc123")
    assert env["TRAINSTACK_INSTANCE_TYPE"] == "g5.xlarge"
    assert trainer._job == {"train": {"steps": 5}}
    assert trainer.argv[:1] == [sys.executable] or trainer.argv[-1].startswith("train.processes")
    assert "train.processes=2" in trainer.argv, "one rank per GPU"
    assert trainer._defer_early_signals is True, "a stop while the trainer's interpreter starts stays pending"
    assert not trainer._user_job
    [profile] = [e for e in run.events if e["stage"] == "job" and "precision" in e]
    assert profile["message"].startswith("device profile g5.xlarge")


def test_a_trainer_command_given_is_run_as_given(tmp_path: Path) -> None:
    run = Run(tmp_path)
    command = ["python", "-c", "pass"]
    run.supervisor = Supervisor(
        run.config,
        run.log,
        run.stops,
        user_job=None,
        job_root=tmp_path,
        trainer_command=command,
        tick_seconds=0.01,
    )
    trainer = build(run, identity=None, restored=None)
    assert trainer.argv[:3] == ["python", "-c", "pass"]
    assert trainer._defer_early_signals is False
    assert "TRAINSTACK_INSTANCE_TYPE" not in trainer._env and "TRAINSTACK_MTBI_HOURS" not in trainer._env
    [profile] = [e for e in run.events if e["stage"] == "job" and "precision" in e]
    assert profile["precision"] == "the job's own"


def test_a_users_job_runs_its_command_in_its_workdir_with_its_env(tmp_path: Path) -> None:
    (tmp_path / "jobs" / "mine").mkdir(parents=True)
    spec = JobSpec(
        name="mine", command=("python", "train.py", "--lr", "python"), workdir="jobs/mine", env={"SEED": "7"},
        data_sync=False, checkpoint_keep=5,
    )  # fmt: skip
    run = Run(tmp_path, user_job=spec)
    trainer = build(run)
    python = trainer.argv[0]
    assert python != "python" and Path(python).name.startswith("python"), "the job's interpreter"
    assert trainer.argv[1:] == ["train.py", "--lr", python], "every bare `python` is the job's interpreter"
    assert trainer._cwd == tmp_path / "jobs" / "mine" and trainer._user_job
    env = trainer._env
    assert env["SEED"] == "7" and env["TRAINSTACK_CHECKPOINT_KEEP"] == "5"
    # Where results outlive the instance (a tracker's run, TensorBoard's by default): the job's own prefix.
    assert env["TRAINSTACK_RESULTS_URI"] == f"s3://{run.config.bucket}/{run.config.prefixes.results}"
    assert "TRAINSTACK_DATA_DIR" not in env, "a job that syncs no data is given no data folder"
    assert run.stops.phase == "job-setup"
    [said] = run.said("user job")
    assert (said["stage"], said["name"], said["workdir"], said["restored_step"]) == (
        "job", "mine", str(tmp_path / "jobs" / "mine"), 120,
    )  # fmt: skip


def test_an_efa_instance_gives_the_job_its_efa_settings(tmp_path: Path) -> None:
    trainer = build(
        Run(tmp_path, efa=True), identity=InstanceIdentity("i-1", "p4d.24xlarge", "a", "r", "spot")
    )
    assert trainer._env["FI_PROVIDER"] == "efa"
    assert trainer._env.get("FI_EFA_USE_DEVICE_RDMA") == "1", "p4d's EFA does RDMA"
    plain = build(Run(tmp_path / "plain"), identity=InstanceIdentity("i-1", "p4d.24xlarge", "a", "r", "spot"))
    assert "FI_PROVIDER" not in plain._env
    unknown = build(Run(tmp_path / "unknown", efa=True), identity=None)
    assert "FI_PROVIDER" not in unknown._env, "no instance known: no EFA settings"


# -- the job's own credentials: the job role narrowed to this job (`_job_credentials`, `close`) -----------


class Sts:
    """STS as the agent's client sees it: each AssumeRole recorded and answered with an hour's credentials,
    or refused with `error`."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.calls: list[dict[str, Any]] = []

    def assume_role(self, **kwargs: Any) -> dict[str, Any]:
        self.calls.append(kwargs)
        if self.error is not None:
            raise self.error
        expiration = datetime.now(timezone.utc) + timedelta(hours=1)
        return {
            "Credentials": {
                "AccessKeyId": "ASIAJOB",
                "SecretAccessKey": "secret",
                "SessionToken": "token",
                "Expiration": expiration,
            }
        }


ROLE = "arn:aws:iam::123456789012:role/trainstack-test-job"


@pytest.fixture()
def sts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Sts:
    fake = Sts()
    asked: list[tuple[str, str]] = []

    def client(service: str, region: str) -> Any:
        asked.append((service, region))
        assert (service, region) == ("sts", "us-east-1")
        return fake

    monkeypatch.setattr(supervisor_module.aws, "client", client)
    monkeypatch.setattr(supervisor_module, "CREDENTIALS_DIR", tmp_path / "run-credentials")
    return fake


def credentialed(tmp_path: Path, **config: Any) -> Run:
    values: dict[str, Any] = {
        "job_role_arn": ROLE,
        "job_id": "resnet-1a2b3c4d",
        "log_group": "/trainstack/test",
        "dataset": "flowers",
    }
    return Run(tmp_path, **(values | config))


def test_the_job_gets_the_job_role_narrowed_to_this_job_through_a_profile(sts: Sts, tmp_path: Path) -> None:
    run = credentialed(tmp_path)
    env = build(run)._env
    [call] = sts.calls
    stream = "resnet-1a2b3c4d/i-0abc/job"
    assert call["RoleArn"] == ROLE and call["RoleSessionName"] == "resnet-1a2b3c4d-i-0abc"
    assert json.loads(call["Policy"]) == job_session_policy(
        role_arn=ROLE,
        bucket="b",
        job_id="resnet-1a2b3c4d",
        region="us-east-1",
        log_group="/trainstack/test",
        log_stream=stream,
        data_prefix="datasets/flowers/",
        jobs_prefix=run.config.prefixes.jobs,
    )
    directory = supervisor_module.CREDENTIALS_DIR / "resnet-1a2b3c4d"
    assert env["AWS_CONFIG_FILE"] == str(directory / "config") and (directory / "credentials.json").is_file()
    assert env["AWS_EC2_METADATA_DISABLED"] == "true", "never the instance role instead"
    assert (env["TRAINSTACK_JOB_LOG_GROUP"], env["TRAINSTACK_JOB_LOG_STREAM"]) == ("/trainstack/test", stream)
    [said] = run.said("job credentials: the job role, narrowed to this job")
    assert (said["stage"], said["role"], said["stream"]) == ("job", ROLE, stream)

    again = build(run)._env
    assert len(sts.calls) == 1, "one session a life: the refresher keeps it fresh"
    assert {k: again[k] for k in env if k.startswith(("AWS_", "TRAINSTACK_JOB_LOG"))} == {
        k: env[k] for k in env if k.startswith(("AWS_", "TRAINSTACK_JOB_LOG"))
    }
    run.supervisor.close()
    assert not (directory / "credentials.json").exists(), "the job's credentials leave with its life"
    assert run.said("job credentials stopped and removed")


def test_without_an_instance_the_session_is_local_and_names_no_log_stream(sts: Sts, tmp_path: Path) -> None:
    run = credentialed(tmp_path)
    env = build(run, identity=None)._env
    [call] = sts.calls
    assert call["RoleSessionName"] == "resnet-1a2b3c4d-local"
    assert json.loads(call["Policy"]) == job_session_policy(
        role_arn=ROLE,
        bucket="b",
        job_id="resnet-1a2b3c4d",
        region="us-east-1",
        log_group="/trainstack/test",
        log_stream=None,
        data_prefix="datasets/flowers/",
        jobs_prefix=run.config.prefixes.jobs,
    )
    assert "AWS_CONFIG_FILE" in env and "TRAINSTACK_JOB_LOG_STREAM" not in env
    assert run.said("job credentials: the job role, narrowed to this job")[0]["stream"] is None
    run.supervisor.close()


def test_a_job_role_that_cannot_be_taken_leaves_the_job_without_credentials_and_says_how_to_fix_it(
    sts: Sts, tmp_path: Path
) -> None:
    sts.error = RuntimeError("AccessDenied: not authorized to perform sts:AssumeRole\nsecond line")
    run = credentialed(tmp_path)
    env = build(run)._env
    assert not any(key.startswith("AWS_") or key.startswith("TRAINSTACK_JOB_LOG") for key in env)
    [said] = run.said("could not take the job role; the job gets no AWS credentials")
    assert (said["stage"], said["role"]) == ("job", ROLE)
    assert said["error"] == "AccessDenied: not authorized to perform sts:AssumeRole"
    assert said["fix"] == (
        "the instance role needs sts:AssumeRole on this role and its trust policy must name the instance "
        "role: run pulumi up to restore both (infra/identity.py declares them)"
    )
    build(run)
    assert len(sts.calls) == 2, "not taken: the next start of the job tries again"
    sts.error = RuntimeError()
    build(credentialed(tmp_path / "again"))
    assert run.said("could not take the job role; the job gets no AWS credentials")


def test_an_error_without_words_is_named_by_its_kind(sts: Sts, tmp_path: Path) -> None:
    sts.error = TimeoutError()
    run = credentialed(tmp_path)
    build(run)
    [said] = run.said("could not take the job role; the job gets no AWS credentials")
    assert said["error"] == "TimeoutError"


def test_no_job_role_no_credentials_and_no_sts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(service: str, region: str) -> Any:
        raise AssertionError("no job role: no STS client")

    monkeypatch.setattr(supervisor_module.aws, "client", refuse)
    env = build(Run(tmp_path))._env
    assert "AWS_CONFIG_FILE" not in env


def test_the_stop_lines_words_exactly(tmp_path: Path) -> None:
    run = Run(tmp_path)
    run.classify(0, run.trainer(), "spot", PersistResult(newest_local_step=9, confirmed_step=9))
    run.classify(75, run.trainer(), "spot", PersistResult(newest_local_step=None, confirmed_step=None))
    lines = [e["message"] for e in run.events if e["stage"] == "stop"]
    assert lines == [
        "trainer completed before the stop took effect (exit 0); nothing to resume",
        "trainer stopped before it saved a checkpoint; nothing new to confirm",
    ]


def test_the_stop_line_says_how_long_the_job_took_to_exit_after_the_notice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = Run(tmp_path)
    run.stops.request("spot")
    _, seen_at = run.stops.state()
    assert seen_at is not None
    seen: float = seen_at

    class Clock:
        @staticmethod
        def monotonic() -> float:
            return seen + 1.234

    monkeypatch.setattr(supervisor_module, "time", Clock)
    run.classify(75, run.trainer(), "spot", PersistResult(newest_local_step=4, confirmed_step=4))
    [line] = [e for e in run.events if e["stage"] == "stop" and e["message"] != "stop requested"]
    assert line["notice_to_exit_s"] == pytest.approx(1.234, abs=0.006)


def test_a_users_jobs_failures_carry_its_last_lines(tmp_path: Path) -> None:
    run = Run(tmp_path, user_job=user_job())
    trainer = run.trainer()
    trainer.tail.extend(["usage: train.py", "error: unrecognized arguments"])
    for code, permanent in ((2, True), (1, False)):
        failure = run.classify(code, trainer)
        assert isinstance(failure, Failure) and failure.permanent is permanent
        assert failure.outcome is LifeEnd.FAILED
        assert failure.lines == ["usage: train.py", "error: unrecognized arguments"]


# -- more of the job's process: links at its signal files, its venv, its config, its secrets, its end -----


@pytest.mark.parametrize("users_job", [False, True])
def test_a_link_the_job_planted_at_a_signal_file_is_said_in_the_agents_log_not_the_jobs(
    tmp_path: Path, users_job: bool
) -> None:
    (tmp_path / "jobs").mkdir()
    run = Run(tmp_path, user_job=user_job(workdir="jobs") if users_job else None)
    shipped: list[str] = []
    trainer = run.supervisor.job_process(
        run.paths, 1, None, identity=None, spot_interruptions=(0, 0.0), log_sink=lambda: shipped.append
    )
    run.paths.control_dir.mkdir(parents=True, exist_ok=True)
    target = tmp_path / "root-owned"
    run.paths.stop_file.symlink_to(target)
    trainer.request_stop()
    assert not target.exists(), "the link was replaced, never followed"
    assert shipped == [], "the agent's word never goes into the job's output"
    [said] = [e for e in run.events if e.get("level") == "warning"]
    assert said["stage"] == "job" and str(run.paths.stop_file.name) in said["message"]


def test_the_builtin_trainer_sees_neither_its_secrets_nor_its_resources_section(tmp_path: Path) -> None:
    job = {"train": {"steps": 5}, "resources": {"gpus": 1}}
    trainer = build(Run(tmp_path, job=job))
    assert trainer._job == {"train": {"steps": 5}}


def test_the_job_runs_from_the_code_it_was_submitted_with(tmp_path: Path) -> None:
    code = tmp_path / "submitted"
    run = Run(tmp_path)
    run.supervisor = Supervisor(
        run.config,
        run.log,
        run.stops,
        user_job=None,
        job_root=tmp_path,
        trainer_command=None,
        tick_seconds=0.01,
        code_root=code,
    )
    assert build(run)._cwd == code
    (tmp_path / "w").mkdir()
    users = Supervisor(
        run.config,
        run.log,
        run.stops,
        user_job=user_job(workdir="w"),
        job_root=tmp_path,
        trainer_command=None,
        tick_seconds=0.01,
        code_root=code,
    )
    trainer = users.job_process(
        run.paths, 1, None, identity=None, spot_interruptions=(0, 0.0), log_sink=lambda: lambda _: None
    )
    assert trainer._code_root == code


def test_python3_in_a_users_command_is_the_jobs_interpreter_too(tmp_path: Path) -> None:
    (tmp_path / "w").mkdir()
    run = Run(tmp_path, user_job=JobSpec(name="mine", command=("python3", "train.py"), workdir="w"))
    argv = build(run).argv
    assert argv[0] != "python3" and argv[1:] == ["train.py"]


def test_a_users_job_with_requirements_runs_in_its_venv_built_once_per_instance(tmp_path: Path) -> None:
    """The venv is keyed by the requirements, the pinned packages and the base interpreter; one this agent
    completed before is reused (building one is bootstrap/job.py's, tests/bootstrap/test_user_job.py)."""
    workdir = tmp_path / "w"
    workdir.mkdir()
    requirements = workdir / "requirements.txt"
    requirements.write_text("# nothing beyond the AMI's own\n")
    run = Run(tmp_path, user_job=user_job(workdir="w", requirements="requirements.txt"))
    base = trainer_python()
    key = hashlib.sha256(requirements.read_bytes() + pinned_constraints(base).encode() + base.encode())
    venv = run.paths.scratch / "python" / f"venv-{key.hexdigest()[:16]}"
    venv.mkdir(parents=True)
    (venv / VENV_READY).write_text("")
    trainer = build(run)
    assert trainer.argv[0] == str(venv / "bin" / "python")
    [reused] = run.said("job environment reused")
    assert (reused["stage"], reused["requirements"], reused["venv"]) == ("job", str(requirements), str(venv))


def test_the_jobs_venv_is_built_as_the_jobs_user_and_a_stop_during_the_build_interrupts_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pip runs a requirement's install code: as the job's unprivileged user (the supervisor's launch), never
    root; and a stop that comes while it installs (a spot notice, a cancel) ends the build rather than
    waiting for it, so the job never starts (bootstrap/job.py's prepare_python polls both)."""
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "requirements.txt").write_text("einops\n")
    built: dict[str, Any] = {}

    def prepare(base: str, requirements: Path | None, *args: Any, **options: Any) -> str:
        built.update(options, requirements=requirements)
        return base

    monkeypatch.setattr("bootstrap.supervisor.prepare_python", prepare)
    run = Run(tmp_path, user_job=user_job(workdir="w", requirements="requirements.txt"))
    build(run)
    assert built["requirements"] == tmp_path / "w" / "requirements.txt"
    assert built["launch"] is run.supervisor.launch, "pip must run as the job's user"
    should_abort = built["should_abort"]
    assert not should_abort()
    run.stops.request("spot interruption notice")
    assert should_abort(), "a stop during the build must interrupt it"


def test_an_efa_instances_settings_come_on_top_of_the_contract(tmp_path: Path) -> None:
    trainer = build(
        Run(tmp_path, efa=True), identity=InstanceIdentity("i-1", "p4d.24xlarge", "a", "r", "spot")
    )
    assert trainer._env["FI_PROVIDER"] == "efa" and "TRAINSTACK_CHECKPOINT_DIR" in trainer._env


def test_the_profile_line_names_the_precision_the_job_gets(tmp_path: Path) -> None:
    run = Run(tmp_path)
    env = build(run)._env
    [profile] = [e for e in run.events if e["stage"] == "job" and "precision" in e]
    assert profile["precision"] == env["TRAINSTACK_PRECISION"]


def test_a_secrets_section_that_is_not_a_mapping_is_a_job_file_problem(tmp_path: Path) -> None:
    run = Run(tmp_path, job={"secrets": ["HF_TOKEN"]})
    with pytest.raises(JobSpecError) as caught:
        run.supervisor.job_secrets()
    assert caught.value.problems and all(p.startswith("secrets") for p in caught.value.problems)


def test_a_secret_that_cannot_be_read_says_how_to_store_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unreadable(*args: Any, **kwargs: Any) -> dict[str, str]:
        raise SecretUnavailableError("secrets.HF_TOKEN: SSM parameter /trainstack/dev/hf does not exist")

    monkeypatch.setattr(supervisor_module, "resolve", unreadable)
    run = Run(tmp_path, job={"secrets": {"HF_TOKEN": "hf"}})
    with pytest.raises(JobSpecError) as caught:
        run.supervisor.job_secrets()
    assert caught.value.problems == ["secrets.HF_TOKEN: SSM parameter /trainstack/dev/hf does not exist"]
    assert (
        caught.value.fix
        == f"store it with `trainstack secrets set NAME` (or fix secrets:), then {RESUME_COMMAND}"
    )


def test_the_agent_says_once_as_whom_jobs_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jobuser, "_detected", None)
    run = Run(tmp_path)
    [said] = [e for e in run.events if e["message"] == run.supervisor.launch.describe()]
    assert said["stage"] == "job"


def test_a_jobs_end_raises_the_first_failure_after_trying_both_steps(
    sts: Sts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = credentialed(tmp_path)
    build(run)
    ended: list[str] = []

    def refuse_close(self: Any) -> None:
        raise OSError("credentials folder busy")

    def end_all(self: Any, say: Callable[[str], None]) -> None:
        ended.append("end_all")
        raise RuntimeError("a process survived")

    monkeypatch.setattr(supervisor_module.JobCredentials, "close", refuse_close)
    monkeypatch.setattr(type(run.supervisor.launch), "end_all", end_all)
    with pytest.raises(OSError, match="credentials folder busy"):
        run.supervisor.close()
    assert ended == ["end_all"], "the processes are ended even when the credentials could not be"
    with pytest.raises(RuntimeError, match="a process survived"):
        run.supervisor.close()


def test_credentials_outside_root_live_beside_the_jobs_scratch(
    sts: Sts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(supervisor_module.os, "geteuid", lambda: 1000)
    run = credentialed(tmp_path, dataset="", prefixes=Prefixes(data="inputs/", jobs="queue/"))
    env = build(run)._env
    directory = run.paths.scratch / "job-credentials" / "resnet-1a2b3c4d"
    assert env["AWS_CONFIG_FILE"] == str(directory / "config")
    assert env["AWS_REGION"] == "us-east-1"
    [call] = sts.calls
    policy = json.loads(call["Policy"])
    assert policy == job_session_policy(
        role_arn=ROLE,
        bucket="b",
        job_id="resnet-1a2b3c4d",
        region="us-east-1",
        log_group="/trainstack/test",
        log_stream="resnet-1a2b3c4d/i-0abc/job",
        data_prefix="inputs/",
        jobs_prefix="queue/",
    )
    run.supervisor.close()
    [stopped] = run.said("job credentials stopped and removed")
    assert stopped["stage"] == "job"


def test_a_long_error_is_cut_at_200_characters(sts: Sts, tmp_path: Path) -> None:
    sts.error = RuntimeError("x" * 300)
    run = credentialed(tmp_path)
    build(run)
    [said] = run.said("could not take the job role; the job gets no AWS credentials")
    assert said["error"] == "x" * 200


def test_secrets_are_read_in_the_stacks_region_and_said_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    regions: list[tuple[str, str]] = []
    monkeypatch.setattr(
        supervisor_module.aws, "client", lambda service, region: regions.append((service, region))
    )

    def resolve(refs: Any, *, stack: str, clients: Callable[[str], Any]) -> dict[str, str]:
        clients("ssm")
        return {"HF_TOKEN": "value"}

    monkeypatch.setattr(supervisor_module, "resolve", resolve)
    run = Run(tmp_path, job={"secrets": {"HF_TOKEN": "hf"}}, region="eu-west-1")
    assert run.supervisor.job_secrets() == {"HF_TOKEN": "value"}
    assert regions == [("ssm", "eu-west-1")]
    [said] = run.said("secrets resolved into the job's environment")
    assert said["stage"] == "job" and "value" not in json.dumps(said)


@pytest.mark.parametrize("users_job", [False, True])
def test_the_job_runs_as_whom_the_agent_detected(tmp_path: Path, users_job: bool) -> None:
    (tmp_path / "w").mkdir()
    run = Run(tmp_path, user_job=user_job(workdir="w") if users_job else None)
    run.supervisor.launch = dataclasses.replace(run.supervisor.launch)  # this agent's own, not a default
    assert build(run)._launch is run.supervisor.launch


def test_the_builtin_trainers_output_reaches_the_agents_sink(tmp_path: Path) -> None:
    run = Run(tmp_path)
    command = [sys.executable, "-c", "print('step 1 of 2')"]
    run.supervisor = Supervisor(
        run.config,
        run.log,
        run.stops,
        user_job=None,
        job_root=tmp_path,
        trainer_command=command,
        tick_seconds=0.01,
    )
    shipped: list[str] = []
    trainer = run.supervisor.job_process(
        run.paths, 1, None, identity=None, spot_interruptions=(0, 0.0), log_sink=lambda: shipped.append
    )
    trainer.start()
    assert trainer.wait(timeout=30) == 0, "the trainer's process did not end within 30 s"
    deadline = time.monotonic() + 10
    while "step 1 of 2" not in shipped and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "step 1 of 2" in shipped, f"the trainer's line never reached the sink: {shipped}"
