"""One instance life: boot → GPU check → data → restore → train → persist → a truthful outcome.

Two promises shape the agent (docs/internals.md, "Agent lives"):
- a spot notice, a scale-in, SIGTERM or `trainstack stop` is acted on the moment it is seen, in every phase,
  without waiting on any network call: the watcher asks the trainer to stop itself (bootstrap/stops.py),
  and every S3, SNS and CloudWatch call runs on other threads or after the checkpoint is persisted;
- every life ends with an outcome that says what happened (bootstrap/outcomes.py), written to the ledger
  with conditional writes so no update is lost.

This module orchestrates; stops.py, jobstate.py (the job's state in S3, the state poller), boot.py,
supervisor.py (the job's process), generations.py (multi-node) and outcomes.py do the work.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

from bootstrap.agent_config import AgentConfig
from bootstrap.boot import AwsClients, Boot
from bootstrap.datasync import DatasetVersionError, DataSync, DiskSpaceError, JobDataset, SyncAborted
from bootstrap.errors import one_line
from bootstrap.eventlog import EventLog, utc_now
from bootstrap.fleet import Fleet
from bootstrap.generation_fence import GenerationFence, GenerationSupersededError
from bootstrap.generations import Generations
from bootstrap.gpumetrics import GpuMetricPublisher
from bootstrap.hostmetrics import NAMESPACE as METRIC_NAMESPACE
from bootstrap.imds import ImdsClient, InstanceIdentity
from bootstrap.jobbinding import (
    JobBinding,
    JobBindingError,
    JobDirectory,
    bind_job,
    claim_scratch,
    work_in_lanes,
)
from bootstrap.jobstate import JobState
from bootstrap.lease import DRIFT_SECONDS, JobLease, LeaseExpiredError, LeaseLostError
from bootstrap.ledger import TERMINAL_STATUSES, JobEndedError, JobLedger
from bootstrap.notify import Notifier
from bootstrap.outcomes import Failure, LifeEnd, LifeFacts, LifeResult, Outcomes
from bootstrap.persist import TOKEN_RECORD, CheckpointPersister, CheckpointRefusedError, UploadAbandonedError
from bootstrap.pinned import PinnedCodeError, prepare_job_code, prepare_pinned, run_pinned
from bootstrap.pricing import BucketUsage, PriceLookup
from bootstrap.scratch import prepare_scratch
from bootstrap.standby import HANDOVER_POLL_SECONDS, OneWriter, Role, wait_warm
from bootstrap.stops import STOP_OUTCOMES, StopRequests
from bootstrap.supervisor import Supervisor
from bootstrap.trainer import CODE_ROOT, TrainerPaths, TrainerProcess
from bootstrap.watcher import RebalanceRecommendation, SpotWatcher
from trainstack_job.contract import RESUME_COMMAND
from trainstack_job.jobfile import BUNDLE_JOB_DIR, JobSpec, JobSpecError
from trainstack_job.jobs import LEGACY_JOB_ID, JobPrefixes

__all__ = ["AwsClients", "InstanceLife", "LifeResult"]

# After a completion or failure nothing hurries the last upload but the bill.
FINAL_UPLOAD_SECONDS = 300.0
# Ends after which the lease goes at once (before the ledger's last word): the standby continues from the
# confirmed step while this life is still closing. After any other end the job's status is written first,
# so a standby never takes over a job that just completed or was given up.
_RELEASE_FIRST = {LifeEnd.HANDED_OVER, LifeEnd.PREEMPTED}
# Jobs one life refuses before it leaves the rest to the next life (each refusal is a few S3 calls).
MAX_REFUSED_PER_LIFE = 50


class InstanceLife:
    """Runs one life. Collaborators can be injected so that tests drive it against moto and a fake trainer."""

    def __init__(
        self,
        config: AgentConfig,
        *,
        log: EventLog | None = None,
        clients: AwsClients | None = None,
        imds: ImdsClient | None = None,
        trainer_command: Sequence[str] | None = None,
        price_lookup: PriceLookup | None = None,
        identity_wait_seconds: float = 60.0,
        release_wait_seconds: float = 120.0,
        state_poll_seconds: float = 10.0,
        tick_seconds: float = 0.5,
        job_root: Path | None = None,
        after: str | None = None,
        lease_seconds: float | None = None,
        drift_seconds: float = DRIFT_SECONDS,
    ) -> None:
        # How to build the next life on this instance (`successor`): the same collaborators; a log made here
        # is made afresh, so the ended life's shippers are not fed any more.
        self._init_args: dict[str, Any] = {
            "log": log,
            "clients": clients,
            "imds": imds,
            "trainer_command": trainer_command,
            "price_lookup": price_lookup,
            "identity_wait_seconds": identity_wait_seconds,
            "release_wait_seconds": release_wait_seconds,
            "state_poll_seconds": state_poll_seconds,
            "tick_seconds": tick_seconds,
            "job_root": job_root,
            "lease_seconds": lease_seconds,
            "drift_seconds": drift_seconds,
        }
        # The job this instance's previous life just ended or yielded: this life goes on to the next one.
        self._after = after
        # The stack's view (where the current-job pointer lives) and, from here on, the configured job's own
        # prefixes: whatever runs before the life is bound (the give-up path, the storage cost) already reads
        # and writes that job's objects, not the legacy top-level ones. A config that defines no job ("")
        # has none before it binds.
        self._stack_config = config
        config = _for_job(config, config.job_id or LEGACY_JOB_ID)
        self.config = config
        self.user_job = JobSpec.from_mapping(config.user_job, "user_job") if config.user_job else None
        self.log = log or EventLog()
        self.clients = clients or AwsClients.for_region(config.region)
        self.imds = imds or ImdsClient()
        self.fleet = Fleet(self.clients.autoscaling, config.group_name)
        self.notifier = Notifier(self.clients.sns, config.topic_arn, config.stack, self.log)
        self._identity: InstanceIdentity | None = None
        self._life_started: datetime | None = None
        # How often control.json is read and the ledger's heartbeat and cost written.
        self._state_poll_seconds = state_poll_seconds
        # The job's lease: its length (None: the stale limit, 3 polls + 30 s) and the clock-drift margin a
        # taker waits past its end (bootstrap/lease.py). Tests shorten both.
        self._lease_seconds = lease_seconds
        self._drift_seconds = drift_seconds
        self._paths: TrainerPaths | None = None
        # Several instances train one job (docs/multi-node.md): the built-in trainer across nodes.
        self.multi_node = config.instance_count > 1 and self.user_job is None
        self._generations: Generations | None = None
        self.stops = StopRequests(self.log, config.stop_deadline_seconds)
        self.boot = Boot(
            config, self.log, self.imds, self.clients, self.fleet, price_lookup, identity_wait_seconds
        )
        self.cost_meter = self.boot.cost_meter
        self._trainer_command = trainer_command
        self._tick_seconds = tick_seconds
        # Where a user's job workdir is: inside the unpacked bundle on an instance, anywhere in the demo.
        self._job_root = self._own_job_root = job_root or CODE_ROOT / BUNDLE_JOB_DIR
        # The code a `trainstack run` job was submitted with, unpacked (None: this agent's own bundle).
        self._code_root: Path | None = None
        # The bound job had ended and is served again on purpose (its ledger may restart); jobbinding.py.
        self._resuming = True
        self._release_wait_seconds = release_wait_seconds
        self._assemble(config)
        # One writer per single-node job (bootstrap/standby.py); set once the life is in the ledger.
        self._writer: OneWriter | None = None
        self._persister: CheckpointPersister | None = None
        # A multi-node job's commits are fenced by this node's generation (bootstrap/generation_fence.py).
        self._generation_fence: GenerationFence | None = None
        # Replaced in tests: an in-process agent must not exec another program.
        self.run_pinned: Callable[..., Any] = run_pinned
        # The pinned code fetched and checked before this agent lets go of its own threads and logs.
        self.prepare_pinned: Callable[..., Any] = prepare_pinned
        # A submitted job's own code, fetched, checked and unpacked (never executed by the agent).
        self.prepare_job_code: Callable[..., Path] = prepare_job_code
        # Queue objects and jobs this life already reported as bad: each is one line per life, not per read.
        self._reported: set[str] = set()
        # The watcher, the sentinel and the state poller run until the outcome is decided.
        self._background_stop = threading.Event()
        self._background: list[threading.Thread] = []
        self._watcher: SpotWatcher | None = None

    def _assemble(self, config: AgentConfig) -> None:
        """The collaborators that read the job's prefixes: built for the agent config, then again for the
        job the life is bound to (its own checkpoints/, results/ and state/)."""
        self.config = config
        self.job = JobState(self.clients.s3, config, self.log)
        self.supervisor = Supervisor(
            config,
            self.log,
            self.stops,
            user_job=self.user_job,
            job_root=self._job_root,
            trainer_command=self._trainer_command,
            tick_seconds=self._tick_seconds,
            code_root=self._code_root,
        )
        self.outcomes = Outcomes(
            config,
            self.log,
            self.job,
            self.clients.s3,
            self.fleet,
            self.notifier,
            self.imds,
            builtin_trainer=self.user_job is None,
            release_wait_seconds=self._release_wait_seconds,
            next_job=self._queued_next,
            holds_lease=self._holds_lease,
            instance_id=lambda: self._identity.instance_id if self._identity is not None else None,
        )
        if getattr(self, "_identity", None) is not None:
            self.job.identity = self._identity

    @property
    def identity(self) -> InstanceIdentity | None:
        return self._identity

    @identity.setter
    def identity(self, identity: InstanceIdentity | None) -> None:
        self._identity = identity
        self.job.identity = identity  # progress.json names the instance that trains

    @property
    def phase(self) -> str:
        return self.stops.phase

    @phase.setter
    def phase(self, phase: str) -> None:
        self.stops.phase = phase

    @property
    def ledger(self) -> JobLedger:
        """The newest copy of the ledger this life has read or written."""
        return self.job.ledger

    @property
    def _trainer(self) -> TrainerProcess | None:
        """The trainer running now (the one a stop signals)."""
        return self.stops.trainer

    # -- entry points -------------------------------------------------------------------------------

    def request_shutdown(self) -> None:
        """SIGTERM to the agent (OS shutdown, scale-in): stop with a checkpoint, as for a spot notice.
        Called from a signal handler, so it only sets a flag; the sentinel thread does the rest."""
        self.stops.request_shutdown()

    def run(self) -> LifeResult:
        identity = self.identity = self.boot.identify()
        self.boot.ship_logs(identity)
        self._start_watching()
        try:
            result = self._run_life(identity)
            # With a next queued job the instance stays: the agent goes on to it (bootstrap/agent.py).
            if result.exit_code == 0 and result.next_job is None:
                self._leave_job()
                self.outcomes.release_instance(identity)
        finally:
            self._stop_background()
            self._leave_job()
            try:
                # Whatever the outcome, an exception included: the job's credentials and processes end with
                # its life, before the next job runs here as the same user (bootstrap/supervisor.py).
                self.supervisor.close()
            finally:
                self.boot.close_logs()
        return result

    def give_up(self) -> LifeResult:
        """Last resort when systemd's start limit is hit: record, notify, scale to zero."""
        identity = self.identity = self.boot.identify()
        self.boot.ship_logs(identity)
        has_job = True
        if not self._stack_config.job_id:
            # A config that defines no job: the failing agent was serving the stack's current job.
            current = self._current_job_quietly()
            has_job = current is not None
            if current is not None:
                self._assemble(_for_job(self._stack_config, current))
        try:
            return self.outcomes.gave_up_on_starting(identity, has_job=has_job)
        finally:
            self.boot.close_logs()

    def report_agent_bug(self, exc: BaseException) -> None:
        """The agent's catch-all was reached: a bug, not a job's fault. One line, one count in CloudWatch
        (`AgentErrors`, alarmable) and one e-mail, each best effort: the agent exits next either way."""
        error = f"{type(exc).__name__}: {one_line(exc)}"[:500]
        instance = self._identity.instance_id if self._identity is not None else "?"
        self.log.event("failed", "agent stopped by an unexpected error (a trainstack bug)", error=error)
        try:
            self.clients.cloudwatch.put_metric_data(
                Namespace=METRIC_NAMESPACE,
                MetricData=[
                    {
                        "MetricName": "AgentErrors",
                        "Dimensions": [{"Name": "AutoScalingGroupName", "Value": self.config.group_name}],
                        "Value": 1.0,
                        "Unit": "Count",
                    }
                ],
            )
        except Exception as metric_error:  # the e-mail below still tells
            self.log.event("failed", "could not count the agent error", error=one_line(metric_error))
        self.notifier.publish(
            f"agent error on {instance}",
            [
                f"The trainstack agent on {instance} stopped on an unexpected error: {error}",
                "This is a trainstack bug, not your job's: systemd starts the agent again in 30 s.",
                "Please report it with the agent's log: trainstack logs, or journalctl -u trainstack-agent.",
            ],
        )

    def _current_job_quietly(self) -> str | None:
        try:
            return JobDirectory(self.clients.s3, self._stack_config, self.log).current()[0]
        except Exception as exc:  # giving up must scale to zero whatever S3 says
            self.log.event("job", "cannot read the stack's current job", error=f"{type(exc).__name__}: {exc}")
            return None

    def successor(self, *, again: bool = False) -> InstanceLife:
        """The next life on this instance, after this one's job ended (or yielded) with another queued: the
        same agent config and collaborators, bound afresh. Scratch disk and the synced dataset stay.
        `again`: the same job served afresh, as after a reboot (this life stopped on its lease's clock)."""
        return InstanceLife(
            self._stack_config, after=None if again else self.config.job_id, **self._init_args
        )

    def _holds_lease(self) -> bool | None:
        """For the outcome handlers: whether this life may end the job (bootstrap/outcomes.py)."""
        writer = self._writer
        if writer is None or writer.role is not Role.HOLDER:
            return True
        return writer.confirm()

    def _queued_next(self) -> str | None:
        """The queued job this instance takes once its job has ended (asked by the outcome handlers); in a
        pool running several jobs at once, the job any lane needs it for (holder, next, standby)."""
        if self._stack_config.lanes > 1:
            return work_in_lanes(
                self.clients.s3,
                self._stack_config,
                utc_now(),
                after=self.config.job_id,
                log=self.log,
                group_max=self._group_max_size(),
                reported=self._reported,
                stale_seconds=self._stale_seconds,
            )
        return self._queue().next_job()

    def _queue(self) -> JobDirectory:
        """The stack's jobs and queue, checked against what the group allows."""
        return JobDirectory(
            self.clients.s3,
            self._stack_config,
            self.log,
            group_max=self._group_max_size(),
            reported=self._reported,
        )

    def _group_max_size(self) -> int | None:
        try:
            groups = self.clients.autoscaling.describe_auto_scaling_groups(
                AutoScalingGroupNames=[self._stack_config.group_name]
            )
        except Exception:  # unknown: the stack's instance count stands in
            return None
        found = groups.get("AutoScalingGroups", [])
        return int(found[0]["MaxSize"]) if found else None

    def _leave_job(self) -> None:
        if self._generations is not None:
            self._generations.leave()

    # -- background threads: from boot to the outcome -----------------------------------------------

    def _start_watching(self) -> None:
        """IMDS notices and SIGTERM are watched from boot to the end of the life."""
        self._watcher = SpotWatcher(
            self.imds, self.log, self.config.poll_seconds, self.stops.on_notice, self._on_rebalance
        )
        self._watcher.start()
        self._spawn("shutdown-sentinel", lambda: self.stops.sentinel(self._background_stop))

    def _on_rebalance(self, recommendation: RebalanceRecommendation) -> None:
        """An early checkpoint at once; with a ready standby, a hand-over (decided by the state poller)."""
        self.stops.on_rebalance(recommendation)
        writer = self._writer
        if writer is not None and writer.holding and not writer.at_risk:
            writer.at_risk = True
            self._spawn("handover-watch", self._watch_for_handover)

    def _watch_for_handover(self) -> None:
        """At risk: hand over the moment a standby is ready (seconds count: the notice may follow soon)."""
        assert self._writer is not None
        while not self._background_stop.wait(HANDOVER_POLL_SECONDS) and not self.stops.is_set():
            try:
                why = self._writer.handover_due()
            except Exception:  # S3 hiccup: ask again next second; the state poller asks too
                continue
            if why is not None:
                self.stops.request(why)
                return

    def _spawn(self, name: str, target: Callable[[], None]) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._background.append(thread)
        thread.start()

    def _stop_background(self) -> None:
        self._background_stop.set()
        if self._watcher is not None:
            self._watcher.stop()
        for thread in self._background:
            thread.join(timeout=2)

    def _beat(self) -> float:
        """One poll's heartbeats: this node's in the rendezvous, this life's (and its cost) in the ledger.
        Returns the job's total cost."""
        if self._generations is not None:
            self._generations.heartbeat()
        if self._writer is not None:
            why = self._writer.poll()
            if why is not None:
                self.stops.request(why)
        quote = self.boot.price(self.identity, self._life_started) if self.identity else None
        return self.job.heartbeat(quote)

    # -- the life -----------------------------------------------------------------------------------

    def _run_life(self, identity: InstanceIdentity) -> LifeResult:
        self.log.event(
            "start",
            "instance life starting",
            instance_id=identity.instance_id,
            instance_type=identity.instance_type,
            az=identity.az,
            lifecycle=identity.lifecycle,
        )
        if self.boot.group_scaled_to_zero():
            return LifeResult(LifeEnd.SKIPPED)
        if self._stack_config.lanes > 1 and self._leaving_before_binding(identity):
            return LifeResult(LifeEnd.SKIPPED)
        if not self._bind_job():
            return self.outcomes.nothing_queued()
        self._life_started = utc_now()
        # Other lives may run beside this one (the other nodes of a multi-node job; a single-node job's
        # holder while this instance is its standby): only silent ones are closed.
        stale = self._stale_seconds
        quote = self.boot.price(identity, self._life_started, announce=True)
        try:
            self.job.ledger_store.begin_life(
                identity, quote, self._life_started, stale_after_seconds=stale, restart=self._resuming
            )
        except JobEndedError as exc:
            # Bound while it ran (as its standby, say), ended since: look for work again, never run it twice.
            self.log.event(
                "job", "the job ended while this instance bound it: looking for work again", why=str(exc)
            )
            return LifeResult(LifeEnd.SKIPPED, next_job=self.config.job_id)
        self._spawn(
            "state-poller",
            lambda: self.job.poll(
                self._background_stop, self._state_poll_seconds, self._beat, self.stops.request
            ),
        )
        guard = self._guards_before_start()
        if guard is not None:
            return guard
        outcome: LifeEnd | Failure
        try:
            outcome = self._prepare_and_train()
        except Exception as exc:
            # A refused checkpoint already says which object and the fix; anything else is unexpected and
            # named by its type.
            error = str(exc) if isinstance(exc, CheckpointRefusedError) else f"{type(exc).__name__}: {exc}"
            self.log.event("failed", "instance life failed", error=error)
            outcome = Failure(LifeEnd.FAILED, error, list(self.log.tail))
        finally:
            # No more heartbeats or polls: the outcome below is the last word on this life.
            self._background_stop.set()
        if isinstance(outcome, LifeEnd) and outcome in _RELEASE_FIRST:
            self._release_lease()
        try:
            return self._finish(outcome)
        finally:
            self._release_lease()

    @property
    def _stale_seconds(self) -> float:
        """A life (or lease, or standby) silent this long is dead: three missed polls and half a minute."""
        if self._lease_seconds is not None:
            return self._lease_seconds
        return 3 * self._state_poll_seconds + 30

    def _bind_job(self) -> bool:
        """Serve the stack's current job while it runs, else the head of its queue (bootstrap/jobbinding.py),
        here or with the job's own code. False: no job runs and none is queued. A job whose code can never
        run (its bundle missing, replaced or corrupt) fails with one line naming the object and the fix, and
        the queue moves on to the next: one bad job never stops the stack."""
        after = self._after
        group_max = self._group_max_size()
        for _ in range(MAX_REFUSED_PER_LIFE):
            binding = bind_job(
                self.clients.s3,
                self._stack_config,
                utc_now(),
                after=after,
                log=self.log,
                group_max=group_max,
                reported=self._reported,
                stale_seconds=self._stale_seconds,
            )
            if binding is None:
                return False
            try:
                if binding.pinned is not None:
                    self.prepare_pinned(self.clients.s3, self._stack_config, binding.pinned)
                self._code_root = (
                    None
                    if binding.job_code is None
                    else self.prepare_job_code(self.clients.s3, self._stack_config, binding.job_code)
                )
            except PinnedCodeError as exc:
                self._refuse(binding.job_id, str(exc))
                after = binding.job_id
                continue
            return self._start_bound(binding)
        raise JobBindingError(
            f"{MAX_REFUSED_PER_LIFE} jobs in a row refused in one life; the next life goes on with the queue"
        )

    def _refuse(self, job_id: str, reason: str) -> None:
        """The job fails for good (its ledger says why, `trainstack jobs` shows it) and its submitter hears
        it once; the pointer moves on at the next bind."""
        JobDirectory(self.clients.s3, self._stack_config, self.log, reported=self._reported).refuse(
            job_id, reason
        )
        subject = f"job {job_id}: training failed: its code cannot run"
        self.notifier.publish(subject, [reason, "The next queued job runs instead."])

    def _start_bound(self, binding: JobBinding) -> bool:
        self._resuming = binding.resuming
        if binding.pinned is not None:
            self.log.event(
                "job",
                "another job of this stack is still running: continuing it with the code it started with"
                if binding.switched_from is None
                else "the next queued job runs with the code it was submitted with",
                job_id=binding.job_id,
                defined_job=self._stack_config.job_id,
                bundle=binding.pinned.get("bundle_key"),
            )
            self._stop_background()
            self.boot.close_logs()
            self.run_pinned(self.clients.s3, self._stack_config, binding.pinned)
            return True
        self.log.event(
            "job",
            "job bound",
            job_id=binding.job_id,
            **({"previous_job": binding.switched_from} if binding.switched_from else {}),
        )
        self._serve(binding)
        return True

    def _serve(self, binding: JobBinding) -> None:
        """Rebuild the life for the bound job: its record's definition (a user's job or the trainer, its
        cost cap and instance count) and its own prefixes, log streams and queue hooks."""
        config = _for_job(binding.config or self._stack_config, binding.job_id)
        self.user_job = JobSpec.from_mapping(config.user_job, "user_job") if config.user_job else None
        # A submitted job runs from its own code (as its user); any other from this agent's bundle.
        self._job_root = self._own_job_root if self._code_root is None else self._code_root / BUNDLE_JOB_DIR
        self.multi_node = config.instance_count > 1 and self.user_job is None
        before = self.boot.config
        self.boot.config = config
        if config.job_id != before.job_id and self.identity is not None:
            self.boot.ship_logs(self.identity)  # `trainstack logs --job` finds the job's own stream
        if config.prefixes.checkpoints != before.prefixes.checkpoints:
            # The storage cost counts the bound job's own checkpoints (and the dataset), as Boot's did.
            usage = [config.prefixes.checkpoints, config.prefixes.data]
            self.cost_meter.bucket_usage = BucketUsage(self.clients.s3, config.bucket, usage)
        self._assemble(config)
        if binding.job_id != LEGACY_JOB_ID and not self.multi_node:
            # A `--now` job asks this job to checkpoint and make way (docs/internals.md, "The job queue").
            queue = self._queue()
            self.job.yield_to = lambda: queue.yield_to(binding.job_id)

    def _release_lease(self) -> None:
        if self._writer is not None and self._writer.holding:
            persister = self._persister
            self._writer.release(persister.confirmed_step if persister is not None else None)
            self._writer.role = None

    def _guards_before_start(self) -> LifeResult | None:
        """A life that must not train: too many failures in a row, or a job-wide stop already in force."""
        ledger = self.ledger
        if ledger.consecutive_failures >= self.config.max_consecutive_failures:
            self._background_stop.set()
            why = "the previous agent run on this instance died"
            return self._finish(Failure(LifeEnd.FAILED, why, list(self.log.tail)))
        wide = self.job.job_wide_stop(cost_usd=lambda: ledger.total_cost_usd)
        if wide is not None:
            self._background_stop.set()
            return self._finish(STOP_OUTCOMES[wide.reason])
        return None

    def _prepare_and_train(self) -> LifeEnd | Failure:
        self.phase = "gpu-check"
        gpu_count = self.boot.preflight()
        if self.stops.is_set():
            return self.stops.stopped_before_training()
        if gpu_count is None:
            return LifeEnd.REPLACE
        scratch = prepare_scratch(self.config.scratch_dir, self.log)
        claim_scratch(scratch, self.config.job_id, self.log)
        paths = self._paths = TrainerPaths(scratch=scratch)
        if not self.multi_node and self._take_role(paths) is Role.SURPLUS:
            return LifeEnd.SURPLUS
        if self.user_job is not None and not self.user_job.data_sync:
            return self._train(paths, gpu_count)
        dataset = DataSync.for_dataset(self.clients.s3, self._stack_config, self.config.dataset, self.log)
        self.phase = "data-wait"
        if not self.boot.wait_for_dataset(dataset, self.job, self.stops, self._state_poll_seconds):
            return self.stops.stopped_before_training() if self.stops.is_set() else LifeEnd.NO_DATA
        self.phase = "data-sync"
        version = JobDataset(self.clients.s3, self.config, self.job, self.log)
        try:
            synced = dataset.sync(
                scratch / "data", should_abort=self.stops.is_set, check_version=version.check
            )
        except DatasetVersionError as exc:
            # Every instance finds the same checkpoints and the same version: only the user can settle it.
            self.log.event("failed", "dataset version differs from the job's checkpoints", error=str(exc))
            return Failure(LifeEnd.FAILED, str(exc), list(self.log.tail), fix=exc.fix, permanent=True)
        except SyncAborted:
            self.log.event("data", "dataset sync aborted by the stop", reason=self.stops.reason)
            return self.stops.stopped_before_training()
        except DiskSpaceError as exc:
            # The next instance gets the same disk: retrying would only bill for the same failure.
            self.log.event("failed", "dataset does not fit on this instance", error=str(exc))
            return Failure(
                LifeEnd.FAILED,
                str(exc),
                list(self.log.tail),
                fix="raise trainstack:rootVolumeSizeGb (or use a type with a larger instance store), "
                f"run pulumi up, then {RESUME_COMMAND}",
                permanent=True,
            )
        version.record(synced)
        return self._train(paths, gpu_count)

    # -- one writer per job (bootstrap/standby.py) --------------------------------------------------

    def _take_role(self, paths: TrainerPaths) -> Role:
        """Holder, standby or surplus: decided before the data sync, so a surplus instance leaves at once
        and a standby syncs the data while it waits."""
        assert self.identity is not None
        life_id = self.job.ledger_store.life_id or self.identity.instance_id
        self._writer = OneWriter(
            self.clients.s3,
            self.config,
            self.log,
            instance_id=self.identity.instance_id,
            life_id=life_id,
            stale_seconds=self._stale_seconds,
            instance_gone=self.fleet.instance_gone,
            drift_seconds=self._drift_seconds,
        )
        # The floor is the agent's own record of the tokens it wrote, never latest.json's token: the job
        # could write that one, and every later lease's token would start above it.
        role = self._writer.take(floor=self._persister_for(paths).token_floor() or 0)
        writer = self._writer
        # From now on the holder (or the standby once it takes over) stops on its own clock when it cannot
        # renew: no network in this thread, so it works while S3 and the state poller hang.
        self._spawn("lease-clock", lambda: writer.watch_own_clock(self.stops, self._background_stop.wait))
        if role is Role.STANDBY:
            self.job.record(lambda ledger: ledger.mark_standby(utc_now()))
            if self.config.lanes > 1:
                # Protected since before its claim; a standby trains nothing, so a lower desired capacity
                # may take it (the holder trains on). Protected again if it takes the lease over.
                self._protect_from_scale_in(False)
        self._close_dead_holder()
        return role

    def _leaving_before_binding(self, identity: InstanceIdentity) -> bool:
        """A pool running several jobs at once: this instance is protected from scale-in before it claims a
        job, so a lower desired capacity never takes it between its claim and its lease (the job would wait
        for the dead instance's claim to go stale, minutes). True when scale-in chose it before the
        protection came: it is on its way out and claims nothing. When the group cannot be read it goes on:
        a dead instance's claim still goes stale."""
        self._protect_from_scale_in(True, why="while it looks for a job and serves it")
        try:
            leaving = self.fleet.leaving(identity.instance_id)
        except Exception as exc:
            self.log.event("fleet", "could not read this instance's state in its group", error=one_line(exc))
            return False
        if leaving:
            self.log.event(
                "fleet", "scaled in before it claimed a job: it takes none", group=self.config.group_name
            )
        return leaving

    def _protect_from_scale_in(self, protected: bool = True, why: str = "while it serves the job") -> None:
        """A pool running several jobs at once: while this instance trains a job (holds its lease), a lower
        desired capacity (a cancel, the cost cap, a scheduler) takes an idle instance or a standby, never
        this one. It comes off when the instance leaves (Fleet.leave_for_good) or waits as a standby. Best
        effort: the lease still keeps one writer."""
        assert self.identity is not None
        try:
            self.fleet.protect(self.identity.instance_id, protected)
        except Exception as exc:
            self.log.event("fleet", "could not set this instance's scale-in protection", error=one_line(exc))
            return
        if protected:
            self.log.event("fleet", f"protected from scale-in {why}", group=self.config.group_name)
        else:
            self.log.event("fleet", "scale-in protection off while it waits as a standby")

    def _close_dead_holder(self) -> None:
        """A lease taken because it expired names a life whose instance vanished: close it truthfully."""
        dead = self._writer.dead_holder() if self._writer is not None else None
        if dead is None or self.identity is None:
            return
        me = self.identity.instance_id
        self.job.record(lambda ledger: ledger.close_dead_holder(dead, me))

    def _persister_for(self, paths: TrainerPaths, *, fenced: bool = False) -> CheckpointPersister:
        """The job's checkpoints in S3 ↔ this instance's checkpoint folder; `fenced`: as the lease's holder,
        every commit checked against the lease (a standby only reads). A multi-node job has no lease: its
        commits are always fenced by the generation this node trains in."""
        keep = self.user_job.checkpoint_keep if self.user_job else 3
        lease = self._writer.lease if fenced and self._writer is not None else None
        fence: JobLease | GenerationFence | None = lease
        if fence is None and self.multi_node and self.identity is not None:
            fence = self._generation_fence = GenerationFence(
                self.clients.s3,
                self.config.bucket,
                self.config.prefixes.state,
                instance_id=self.identity.instance_id,
            )
        return CheckpointPersister(
            self.clients.s3,
            self.config.bucket,
            self.config.prefixes.checkpoints,
            paths.checkpoint_dir,
            self.log,
            keep=keep,
            fence=fence,
            on_lease_lost=self._lease_lost if fence is not None else None,
            # The lease tokens it writes into latest.json, recorded where the job cannot write.
            token_record=self.config.prefixes.state + TOKEN_RECORD,
        )

    def _lease_lost(self, error: LeaseLostError) -> None:
        if isinstance(error, GenerationSupersededError):
            # The others declared this node's generation lost and train on from the confirmed checkpoint.
            self.stops.request(
                "generation_superseded", generation=error.generation, newer_generation=error.newer
            )
            return
        if isinstance(error, LeaseExpiredError):
            # Not known lost: unproven past its end by this instance's clock; the same stop as the clock's.
            self.stops.request("lease_expiring", unrenewed_s=round(error.unproven_seconds, 1))
            return
        self.stops.request("lease_lost", holder=error.holder, token=error.token)

    def _restore(self, persister: CheckpointPersister) -> int | None:
        """The newest verified checkpoint of this job; for a new job with `resume_from`, that job's."""
        restored = persister.restore(should_abort=self.stops.is_set)
        source = self.config.resume_from
        if restored is not None or not source:
            return restored
        origin = CheckpointPersister(
            self.clients.s3,
            self.config.bucket,
            JobPrefixes.of(source).checkpoints,
            persister.local_dir,
            self.log,
        )
        try:
            restored = origin.restore(should_abort=self.stops.is_set)
        finally:
            origin.close()
        self.log.event(
            "checkpoint",
            f"new job: starting from job {source}'s checkpoint"
            if restored is not None
            else f"new job: job {source} has no checkpoint to start from; starting at step 0",
            resume_from=source,
            step=restored,
        )
        return restored

    def _job_ended(self) -> bool:
        return self.job.ledger_store.load().status in TERMINAL_STATUSES

    def _wait_as_standby(self, trainer: TrainerProcess, floor: int) -> LifeEnd | Failure | None:
        """Wait warm for the lease (bootstrap/standby.py); None once this life holds it."""
        assert self._writer is not None
        self.phase = "standby"
        ended = wait_warm(
            self._writer,
            trainer,
            self.stops,
            self.log,
            gated=self.user_job is None,
            job_ended=self._job_ended,
            floor=floor,
        )
        if ended is not None:
            return ended
        self.job.record(lambda ledger: ledger.end_standby(utc_now()))
        self._close_dead_holder()
        if self.config.lanes > 1:
            self._protect_from_scale_in()  # it trains from now on
        if self._job_ended():
            # The holder completed (or the job was given up) just before it let go: nothing to continue.
            self.log.event("standby", "took the lease of a job that has ended; letting it go")
            trainer.request_stop()
            return LifeEnd.STANDBY_ENDED
        return None

    # -- training -----------------------------------------------------------------------------------

    def _train(self, paths: TrainerPaths, gpu_count: int) -> LifeEnd | Failure:
        standby = self._writer is not None and self._writer.role is Role.STANDBY
        reader = self._persister_for(paths, fenced=not standby and self._writer is not None)
        persister = self._persister = reader
        self.phase = "restore"
        try:
            restored = self._restore(reader)
            trainer = self._job_process(paths, gpu_count, restored)
        except (UploadAbandonedError, InterruptedError):
            return self.stops.stopped_before_training()
        except JobSpecError as exc:
            fix = exc.fix or f"fix the job's requirements file, run pulumi up, then {RESUME_COMMAND}"
            return Failure(LifeEnd.FAILED, exc.problems[0], list(self.log.tail), fix=fix, permanent=True)
        if standby:
            ended = self._wait_as_standby(trainer, floor=reader.token_floor() or 0)
            reader.close()
            if ended is not None:
                return ended
            # The holder's stop step, confirmed in S3 before it let go: exactly where this life resumes.
            persister = self._persister = self._persister_for(paths, fenced=True)
            self.phase = "restore"
            try:
                restored = persister.restore(should_abort=self.stops.is_set)
            except (UploadAbandonedError, InterruptedError):
                return self.stops.stopped_before_training()
            if self.user_job is not None:
                trainer = self._job_process(paths, gpu_count, restored)
        self.job.progress_file = paths.progress_file
        assert self.identity is not None  # identified before any phase of the life
        metrics = GpuMetricPublisher(
            self.clients.cloudwatch,
            self.config.group_name,
            self.log,
            instance_id=self.identity.instance_id,
            job_id=self.config.job_id,
        )
        if self.multi_node:
            assert self.identity is not None
            self._generations = Generations.for_node(
                self.config,
                self.log,
                self.stops,
                self.job,
                self.supervisor,
                self.clients.s3,
                self.imds,
                self.identity,
                paths,
                poll_seconds=self._state_poll_seconds,
                fence=self._generation_fence,
            )

        def start() -> TrainerProcess | None:
            self.phase = "training"
            if self._generations is not None:
                return None  # each generation starts it (bootstrap/generations.py)
            if standby and self.user_job is None:
                self.log.event("train", "start gate opened: the standby trains", restored_step=restored)
                trainer.open_gate()
                return trainer
            self.log.event("train", "trainer starting", argv=trainer.argv, restored_step=restored)
            trainer.start()
            return trainer

        if not self.stops.launch(start):
            return self.stops.stopped_before_training()
        persister.start()
        if gpu_count:
            metrics.start()
        try:
            code = (
                self._generations.train(trainer, persister, restored)
                if self._generations is not None
                else self.supervisor.supervise(trainer, persister, watch_silent=self.user_job is None)
            )
        finally:
            metrics.stop()
        self.phase = "final-upload"
        reason, seen_at = self.stops.state()
        deadline = (
            seen_at + self.config.stop_deadline_seconds
            if seen_at is not None
            else time.monotonic() + FINAL_UPLOAD_SECONDS
        )
        kill_at = self.stops.kill_at
        if kill_at is not None:
            # Past the lease's end by this clock the fence refuses every commit anyway.
            deadline = min(deadline, kill_at)
        persisted = persister.finish(deadline)
        persister.close()
        if self._generations is not None:
            persisted = self._generations.job_checkpoint_confirmed(persisted, persister, deadline)
        self.job.upload_progress_quietly()
        # Read again: the final upload may have found the lease lost (or past its end) after the exit.
        reason = self.stops.reason
        return self.supervisor.classify_exit(code, reason, persisted, trainer)

    def _job_process(self, paths: TrainerPaths, gpu_count: int, restored: int | None) -> TrainerProcess:
        """The job to run: a user's command in its workdir (and requirements), or the built-in trainer."""
        return self.supervisor.job_process(
            paths,
            gpu_count,
            restored,
            identity=self.identity,
            spot_interruptions=self.ledger.spot_interruptions(),
            log_sink=self._trainer_log_sink,
        )

    def _trainer_log_sink(self) -> Callable[[str], None]:
        assert self.identity is not None
        return self.boot.trainer_log_sink(self.identity)

    def _finish(self, outcome: LifeEnd | Failure) -> LifeResult:
        writer = self._writer
        if writer is None or writer.role is not Role.HOLDER:
            return self._outcome(outcome)
        # The state poller has stopped: the lease is kept renewed while the outcome is acted on (results
        # uploads take minutes), so no standby takes over a job that this life is ending.
        done = threading.Event()
        keeper = threading.Thread(
            target=writer.keep, args=(done, self._state_poll_seconds), name="lease-keeper", daemon=True
        )
        keeper.start()
        try:
            return self._outcome(outcome)
        finally:
            done.set()
            keeper.join(timeout=5)

    def _outcome(self, outcome: LifeEnd | Failure) -> LifeResult:
        life = LifeFacts(
            identity=self.identity,
            phase=self.phase,
            output_dir=self._paths.output_dir if self._paths is not None else None,
            follower=self._generations.follower if self._generations is not None else False,
        )
        return self.outcomes.finish(outcome, life)


def _for_job(config: AgentConfig, job_id: str) -> AgentConfig:
    """The agent config with `job_id`'s checkpoints/, results/ and state/ (trainstack_job/jobs.py)."""
    job = JobPrefixes.of(job_id)
    prefixes = replace(config.prefixes, checkpoints=job.checkpoints, results=job.results, state=job.state)
    return replace(config, prefixes=prefixes, job_id=job_id)
