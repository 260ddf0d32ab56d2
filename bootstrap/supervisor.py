"""The job's process on this instance: building it (a user's command or the built-in trainer), supervising
it to its exit (stall watchdog, the kill deadline of a stop) and saying what its exit means for the life.

Supervising is local only: no network call here, so a stop is never held up by S3 or CloudWatch.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bootstrap import aws
from bootstrap.agent_config import AgentConfig
from bootstrap.devices import context_env
from bootstrap.efa import efa_environment, supports_device_rdma
from bootstrap.eventlog import EventLog
from bootstrap.imds import InstanceIdentity
from bootstrap.job import interruption_env, prepare_python
from bootstrap.jobuser import LOG_STREAM_SOURCE, JobCredentials, JobLaunch, job_launch, job_session_policy
from bootstrap.outcomes import Failure, LifeEnd
from bootstrap.persist import CheckpointPersister, PersistResult
from bootstrap.secrets import ClientFactory, Redactor, SecretUnavailableError, resolve
from bootstrap.stops import STOP_OUTCOMES, StopRequests
from bootstrap.trainer import (
    PERMANENT_FAILURES,
    USER_JOB_PERMANENT_FAILURES,
    TrainerPaths,
    TrainerProcess,
    default_trainer_command,
    trainer_python,
)
from bootstrap.watchdog import StallWatchdog, read_progress
from trainstack_job.contract import RESUME_COMMAND, ExitCode, JobEnv
from trainstack_job.datasets import DatasetPlace
from trainstack_job.jobfile import JobSpec, JobSpecError
from trainstack_job.jobs import JobPrefixes
from trainstack_job.secret_refs import parse_secrets

# On an instance the job's credentials live on tmpfs, in a directory only root writes: one folder per job
# (`<job-id>/`), removed at the end of the job's life, so a job never finds another's credentials there.
CREDENTIALS_DIR = Path("/run/trainstack/job-credentials")
# The job's own log stream (the job role allows `<job-id>/<instance-id>/job` only), named in its environment.
JOB_LOG_GROUP_ENV = "TRAINSTACK_JOB_LOG_GROUP"
JOB_LOG_STREAM_ENV = "TRAINSTACK_JOB_LOG_STREAM"

# What supervising a trainer ends with: its exit code, or LifeEnd.STALLED / LifeEnd.KILLED.
TrainerExit = int | LifeEnd


class Supervisor:
    def __init__(
        self,
        config: AgentConfig,
        log: EventLog,
        stops: StopRequests,
        *,
        user_job: JobSpec | None,
        job_root: Path,
        trainer_command: Sequence[str] | None,
        tick_seconds: float,
        secret_clients: ClientFactory | None = None,
        code_root: Path | None = None,
    ) -> None:
        self.config = config
        # The code the job runs from (None: the agent's own bundle); a `trainstack run` job's own code.
        self._code_root = code_root
        self.log = log
        self.stops = stops
        self.user_job = user_job
        # Where a user's job workdir is: inside the unpacked bundle on an instance, anywhere in the demo.
        self._job_root = job_root
        self._trainer_command = list(trainer_command) if trainer_command else None
        self._tick_seconds = tick_seconds
        # As whom the job runs: detected once per agent process, said once (bootstrap/jobuser.py).
        self.launch: JobLaunch = job_launch(lambda line: log.event("job", line))
        self._credentials: JobCredentials | None = None
        self._credentials_env: dict[str, str] = {}
        # SSM / Secrets Manager clients for the job's `secrets:` (the instance role), made only when named.
        self._secret_clients = secret_clients or (lambda service: aws.client(service, config.region))
        # Masks the job's secret values in the lines the agent ships; the values live in memory only.
        self.redact = Redactor()

    def job_process(
        self,
        paths: TrainerPaths,
        gpu_count: int,
        restored: int | None,
        *,
        identity: InstanceIdentity | None,
        spot_interruptions: tuple[int, float],
        log_sink: Callable[[], Callable[[str], None]],
    ) -> TrainerProcess:
        """The job to run: a user's command in its workdir (and requirements), or the built-in trainer."""
        spec = self.user_job
        env = paths.contract_env(with_data=spec is None or spec.data_sync, restored_step=restored)
        env |= interruption_env(*spot_interruptions)
        env[JobEnv.CHECKPOINT_KEEP.value] = str(spec.checkpoint_keep if spec else 3)
        env[JobEnv.RESULTS_URI.value] = f"s3://{self.config.bucket}/{self.config.prefixes.results}"
        # What this life runs as (job, code, GPU profile and its precision): each checkpoint records it, and
        # the built-in trainer's `train.precision: auto` on a CPU trains in the profile's precision.
        context, profile_line = context_env(
            self.config.job_id, self.config.bundle_sha256, identity.instance_type if identity else None
        )
        env |= context
        self.log.event("job", profile_line, precision=context.get(JobEnv.PRECISION.value, "the job's own"))
        env |= self._job_credentials(paths, identity)
        if self.config.efa and identity is not None:
            # NCCL over EFA between the nodes (infra/efa.py chose an EFA type and a cluster placement group).
            env |= efa_environment(device_rdma=supports_device_rdma(identity.instance_type))
        secrets = self.job_secrets()
        sink = self._masked(log_sink())
        if spec is None:
            command = self._trainer_command or default_trainer_command(gpu_count)
            # The trainer config less `secrets:`: the agent reads that section, the trainer never sees it.
            # `resources:` was the submission's (the pool it runs on): the trainer never sees it either.
            trainer_config = {k: v for k, v in self.config.job.items() if k not in ("secrets", "resources")}
            return TrainerProcess(
                command,
                paths,
                trainer_config,
                sink,
                defer_early_signals=self._trainer_command is None,
                env={**env, **secrets},
                launch=self.launch,
                # A link the job planted at a signal file is named in the agent's log, not the job's output.
                say=lambda line: self.log.event("job", line, level="warning"),
                code_root=self._code_root,
            )
        workdir = self._job_root / spec.workdir
        self.stops.phase = "job-setup"
        python = prepare_python(
            trainer_python(),
            workdir / spec.requirements if spec.requirements else None,
            paths.scratch / "python",
            self.log.event,
            should_abort=self.stops.is_set,
            # The job's user owns its venv and runs pip: a requirement's install code never runs as root.
            launch=self.launch,
        )
        # `python` in the job's command means the job's interpreter: the AMI's PyTorch env or its venv.
        command = [python if arg in ("python", "python3") else arg for arg in spec.command]
        self.log.event("job", "user job", name=spec.name, workdir=str(workdir), restored_step=restored)
        return TrainerProcess(
            command,
            paths,
            {},
            sink,
            user_job=True,
            cwd=workdir,
            env={**env, **spec.env, **secrets},
            launch=self.launch,
            # A link the job planted at a signal file is named in the agent's log, not the job's output.
            say=lambda line: self.log.event("job", line, level="warning"),
            code_root=self._code_root,
        )

    def _job_credentials(self, paths: TrainerPaths, identity: InstanceIdentity | None) -> dict[str, str]:
        """The job's own AWS credentials (the job role narrowed to this job), taken once per life and kept
        fresh by the agent; none without a job role in the config (tests, the demo, older stacks)."""
        role = self.config.job_role_arn
        if not role:
            return {}
        if self._credentials is not None:
            return self._credentials_env
        stream = (
            JobPrefixes.of(self.config.job_id).log_stream(identity.instance_id, LOG_STREAM_SOURCE)
            if identity is not None
            else None
        )
        policy = job_session_policy(
            role_arn=role,
            bucket=self.config.bucket,
            job_id=self.config.job_id,
            region=self.config.region,
            log_group=self.config.log_group,
            log_stream=stream,
            # The job's own dataset only (`data/` or `datasets/<name>/`), as the agent syncs it.
            data_prefix=DatasetPlace.of(self.config.dataset, data_prefix=self.config.prefixes.data).prefix,
            jobs_prefix=self.config.prefixes.jobs,
        )
        credentials = JobCredentials(
            aws.client("sts", self.config.region),
            role_arn=role,
            policy=policy,
            session_name=f"{self.config.job_id}-{identity.instance_id if identity else 'local'}",
            region=self.config.region,
            directory=credentials_directory(paths, self.config.job_id),
            launch=self.launch,
            log=self.log.event,
        )
        try:
            env = credentials.start()
        except Exception as exc:  # the job runs without AWS credentials rather than not at all
            self.log.event(
                "job",
                "could not take the job role; the job gets no AWS credentials",
                role=role,
                error=str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__,
                fix="the instance role needs sts:AssumeRole on this role and its trust policy must name the "
                "instance role: run pulumi up to restore both (infra/identity.py declares them)",
            )
            return {}
        if stream is not None:
            env |= {JOB_LOG_GROUP_ENV: self.config.log_group, JOB_LOG_STREAM_ENV: stream}
        self._credentials, self._credentials_env = credentials, env
        self.log.event("job", "job credentials: the job role, narrowed to this job", role=role, stream=stream)
        return env

    def close(self) -> None:
        """The end of this job's life on the instance, whatever its outcome (an exception included): its
        credentials stop being refreshed and leave the instance, and every process its user still has is
        killed. Jobs run one after another as the same user: a refresher left running would keep
        rewriting credentials the next job's user can read, and a process left running would meet the
        next job. Both steps are tried; the first failure is raised after both (the agent then exits, and
        systemd stops what is left of the job with it)."""
        credentials, self._credentials, self._credentials_env = self._credentials, None, {}
        failure: Exception | None = None
        if credentials is not None:
            try:
                credentials.close()
                self.log.event("job", "job credentials stopped and removed")
            except Exception as exc:
                failure = exc
        try:
            self.launch.end_all(lambda line: self.log.event("job", line))
        except Exception as exc:
            failure = failure or exc
        if failure is not None:
            raise failure

    def job_secrets(self) -> dict[str, str]:
        """The job's `secrets:` (job.yaml, or the built-in trainer's config) read into memory for its
        environment only. The event names them, never a value; a missing or denied one is a JobSpecError
        (one line naming it and the fix: a permanent failure, no other life retries it)."""
        raw = self.user_job.secrets if self.user_job is not None else self.config.job.get("secrets")
        refs, problems = parse_secrets(raw, "secrets")
        if problems:
            raise JobSpecError(problems)
        if not refs:
            return {}
        try:
            values = resolve(refs, stack=self.config.stack, clients=self._secret_clients)
        except SecretUnavailableError as exc:
            fix = f"store it with `trainstack secrets set NAME` (or fix secrets:), then {RESUME_COMMAND}"
            raise JobSpecError([str(exc)], fix=fix) from None
        self.redact = Redactor(values.values())
        self.log.event(
            "job",
            "secrets resolved into the job's environment",
            secrets={name: refs[name].location(self.config.stack) for name in sorted(refs)},
        )
        return values

    def _masked(self, sink: Callable[[str], None]) -> Callable[[str], None]:
        """The job's output sink, masking any secret value the job prints."""
        return lambda line: sink(self.redact(line))

    def trainer_deadline(self, seen_at: float, persister: CheckpointPersister) -> float:
        """When a stopping trainer is killed: early enough to leave the final upload its measured time."""
        budget = self.config.stop_deadline_seconds
        upload = max(persister.upload_seconds, default=5.0)
        return seen_at + budget - min(budget / 2, 2 * upload + 2)

    def supervise(
        self, trainer: TrainerProcess, persister: CheckpointPersister, *, watch_silent: bool
    ) -> TrainerExit:
        """Run the trainer to its exit code, or STALLED / KILLED. Only local checks: no network here.

        `watch_silent`: whether a job that never reports progress is watched for stalls too."""
        watchdog = StallWatchdog(self.config.stall_minutes * 60)
        restarted = False
        while True:
            code = trainer.poll()
            if code is not None:
                return code
            reason, seen_at = self.stops.state()
            if seen_at is not None:
                kill_at = self.stops.kill_at
                if kill_at is not None and time.monotonic() >= kill_at:
                    # The lease ends now by this instance's clock: another life may start training at
                    # its end plus the drift margin, so this trainer goes now, checkpoint or not.
                    self.log.event(
                        "stop",
                        "trainer still running at the lease's end on this instance's clock; killing it",
                        reason=reason,
                    )
                    trainer.kill()
                    return LifeEnd.KILLED
                if time.monotonic() > self.trainer_deadline(seen_at, persister):
                    self.log.event(
                        "stop",
                        "trainer missed the stop deadline; killing it (its newest checkpoint may be lost)",
                        reason=reason,
                    )
                    trainer.kill()
                    return LifeEnd.KILLED
            else:
                progress = read_progress(trainer.paths.progress_file)
                # A user's job that never reports progress is not watched (docs/job-contract.md), nor a
                # node of a multi-node job without global rank 0 (the rank-0 node's agent watches the job).
                watched = progress is not None or watch_silent
                if watched and watchdog.observe(progress.get("step") if progress else None):
                    idle = round(watchdog.idle_seconds())
                    trainer.kill()
                    if restarted:
                        self.log.event(
                            "stall", "training stalled again after a restart; giving up", idle_s=idle
                        )
                        return LifeEnd.STALLED
                    self.log.event("stall", "no training progress; restarting the trainer once", idle_s=idle)
                    restarted = True
                    watchdog.reset()
                    trainer.start()
            time.sleep(self._tick_seconds)

    def classify_exit(
        self, code: TrainerExit, reason: str | None, persisted: PersistResult, trainer: TrainerProcess
    ) -> LifeEnd | Failure:
        progress = read_progress(trainer.paths.progress_file) or {}
        if reason is not None:
            self._log_stop(code, reason, persisted, progress)
        if code == ExitCode.COMPLETED and reason != "lease_lost":
            # A job that completed wins over a stop request that arrived meanwhile, unless another life
            # holds the lease: then that life ends the job (bootstrap/outcomes.py, only the holder ends it).
            return LifeEnd.COMPLETED
        if reason is not None:
            return STOP_OUTCOMES[reason]
        if code == ExitCode.STOPPED:
            # Nobody here asked: the OS sent the stop (shutdown), so this instance is going away.
            self.log.event("stop", "trainer stopped by the system", exit_code=code)
            return LifeEnd.PREEMPTED
        if code == LifeEnd.STALLED:
            return Failure(LifeEnd.STALLED, "trainer stalled", self._tail(trainer) or list(self.log.tail))
        self.log.event(
            "failed", "trainer exited with a failure", exit_code=_plain(code), step=progress.get("step")
        )
        lines = self._tail(trainer) or list(self.log.tail)
        if self.user_job is not None:
            # The user's job under its own name: its exit code, never the built-in trainer's meanings.
            if isinstance(code, int) and code in USER_JOB_PERMANENT_FAILURES:
                why, fix = USER_JOB_PERMANENT_FAILURES[code]
                return Failure(LifeEnd.FAILED, why, lines, fix=fix, permanent=True)
            signature = {"exit_code": _plain(code), "step": progress.get("step")}
            return Failure(LifeEnd.FAILED, f"your job exited {_plain(code)}", lines, signature=signature)
        if isinstance(code, int) and code in PERMANENT_FAILURES:
            why, fix = PERMANENT_FAILURES[code]
            return Failure(LifeEnd.FAILED, f"{why} (trainer exit {code})", lines, fix=fix, permanent=True)
        # The ledger compares it with the life before's (read back from JSON): plain values only.
        signature = {"exit_code": _plain(code), "step": progress.get("step")}
        return Failure(LifeEnd.FAILED, f"trainer exited {_plain(code)}", lines, signature=signature)

    def _tail(self, trainer: TrainerProcess) -> list[str]:
        """The job's last output lines for a failure report, its secret values masked."""
        return [self.redact(line) for line in list(trainer.tail)[-25:]]

    def _log_stop(
        self, code: TrainerExit, reason: str, persisted: PersistResult, progress: dict[str, Any]
    ) -> None:
        """The agent's one line on how the job ended after a stop request, saying what really happened:
        only an exit 75 is a stop with a checkpoint, and `checkpoint_confirmed` is true only then."""
        confirmed = persisted.confirmed and code == ExitCode.STOPPED
        fields: dict[str, Any] = {
            "reason": reason,
            "exit_code": _plain(code),
            "checkpoint_confirmed": confirmed,
            "checkpoint_step": persisted.confirmed_step,
            "newest_local_step": persisted.newest_local_step,
            "reached_step": progress.get("step"),
        }
        _, seen_at = self.stops.state()
        if seen_at is not None:
            fields["notice_to_exit_s"] = round(time.monotonic() - seen_at, 2)
        kept = f"the confirmed checkpoint (step {persisted.confirmed_step}) is kept"
        if code == ExitCode.COMPLETED:
            message = "trainer completed before the stop took effect (exit 0); nothing to resume"
        elif reason == "generation_superseded":
            # Whatever the ranks exited with, the reason decides: their steps belong to a lost generation.
            message = (
                f"checkpoint step {persisted.newest_local_step} NOT confirmed: a newer generation owns the "
                f"job and trains on from the confirmed one; {kept}"
            )
        elif code == ExitCode.STOPPED and confirmed and persisted.newest_local_step is None:
            # Stopped before this life wrote a checkpoint (e.g. while its rendezvous formed): nothing of this
            # life's is missing, but there is no step to name as confirmed either.
            step = persisted.confirmed_step
            resume = "" if step is None else f", the job's is step {step}"
            message = f"trainer stopped before it saved a checkpoint; nothing new to confirm{resume}"
        elif code == ExitCode.STOPPED:
            message = (
                "trainer stopped; checkpoint confirmed in S3"
                if confirmed
                else f"trainer stopped WITHOUT its newest checkpoint in S3; {kept}"
            )
        elif code == LifeEnd.KILLED:
            message = f"trainer missed the stop deadline and was killed before its checkpoint; {kept}"
        elif isinstance(code, int) and code < 0:
            # Popen's -N: the signal ended it (the stop's SIGTERM, unhandled), not the job's own exit.
            message = (
                f"trainer killed by signal {-code} before it could checkpoint (it does not handle the stop: "
                f"docs/job-contract.md, Stopping); {kept}"
            )
        else:
            message = f"trainer exited {_plain(code)} after the stop request instead of 75; {kept}"
        self.log.event("stop", message, **fields)


def credentials_directory(paths: TrainerPaths, job_id: str) -> Path:
    """Where one job's credentials file and profile live: its own folder, never a folder another job's
    refresher writes (tmpfs as root, else beside the job's scratch)."""
    root = CREDENTIALS_DIR if os.geteuid() == 0 else paths.scratch / "job-credentials"
    return root / (job_id or "default")


def _plain(code: TrainerExit) -> int | str:
    """The exit as the ledger and the events have always said it: the number, or "stalled" / "killed"."""
    return code.value if isinstance(code, LifeEnd) else code
