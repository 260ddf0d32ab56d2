"""One instance life: boot → GPU check → data → restore → train → persist → a truthful outcome.

Two promises shape the agent (docs/internals.md, "Agent lives"):
- a spot notice, a scale-in, SIGTERM or `trainstack stop` is acted on the moment it is seen, in every phase,
  without waiting on any network call: the watcher asks the trainer to stop itself (bootstrap/stops.py),
  and every S3, SNS and CloudWatch call runs on other threads or after the checkpoint is persisted;
- every life ends with an outcome that says what happened (bootstrap/outcomes.py), written to the ledger
  with conditional writes so no update is lost.

This module binds the life to a job and orchestrates: after the binding the life runs its phases in order
(bootstrap/phases/: the GPU check, scratch, the job's one writer, the dataset, training, each behind one
small interface); stops.py, jobstate.py (the job's state in S3, the state poller), boot.py, supervisor.py
(the job's process), generations.py (multi-node) and outcomes.py do the work.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

from bootstrap.agent_config import AgentConfig
from bootstrap.boot import AwsClients, Boot
from bootstrap.errors import one_line
from bootstrap.eventlog import EventLog, utc_now
from bootstrap.fleet import Fleet
from bootstrap.generation_fence import GenerationFence
from bootstrap.generations import Generations
from bootstrap.hostmetrics import NAMESPACE as METRIC_NAMESPACE
from bootstrap.imds import ImdsClient, InstanceIdentity
from bootstrap.jobbinding import (
    JobBinding,
    JobBindingError,
    JobDirectory,
    bind_job,
    work_in_lanes,
)
from bootstrap.jobstate import JobState
from bootstrap.lease import DRIFT_SECONDS
from bootstrap.ledger import JobEndedError, JobLedger
from bootstrap.notify import Notifier
from bootstrap.outcomes import Failure, LifeEnd, LifeFacts, LifeResult, Outcomes
from bootstrap.persist import CheckpointPersister, CheckpointRefusedError
from bootstrap.phases import Phase, life_phases, run_phases
from bootstrap.phases.writer import leaving_before_binding
from bootstrap.pinned import PinnedCodeError, prepare_job_code, prepare_pinned, run_pinned
from bootstrap.pricing import BucketUsage, PriceLookup
from bootstrap.standby import HANDOVER_POLL_SECONDS, OneWriter, Role
from bootstrap.stops import STOP_OUTCOMES, StopRequests
from bootstrap.supervisor import Supervisor
from bootstrap.trainer import CODE_ROOT, TrainerPaths, TrainerProcess
from bootstrap.watcher import RebalanceRecommendation, SpotWatcher
from trainstack_job.jobfile import BUNDLE_JOB_DIR, JobSpec
from trainstack_job.jobs import LEGACY_JOB_ID, JobPrefixes

__all__ = ["AwsClients", "InstanceLife", "LifeResult"]

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
        self.stack_config = config
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
        self.state_poll_seconds = state_poll_seconds
        # The job's lease: its length (None: the stale limit, 3 polls + 30 s) and the clock-drift margin a
        # taker waits past its end (bootstrap/lease.py). Tests shorten both.
        self._lease_seconds = lease_seconds
        self.drift_seconds = drift_seconds
        self.paths: TrainerPaths | None = None
        # Several instances train one job (docs/multi-node.md): the built-in trainer across nodes.
        self.multi_node = config.instance_count > 1 and self.user_job is None
        self.generations: Generations | None = None
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
        self.writer: OneWriter | None = None
        self.persister: CheckpointPersister | None = None
        # What runs between the binding and the outcome, in order (bootstrap/phases/): a test may add one.
        self.phases: list[Phase] = life_phases()
        # The GPUs the GPU check counted (0 on a CPU instance, as in the demo).
        self.gpu_count = 0
        # A multi-node job's commits are fenced by this node's generation (bootstrap/generation_fence.py).
        self.generation_fence: GenerationFence | None = None
        # Replaced in tests: an in-process agent must not exec another program.
        self.run_pinned: Callable[..., Any] = run_pinned
        # The pinned code fetched and checked before this agent lets go of its own threads and logs.
        self.prepare_pinned: Callable[..., Any] = prepare_pinned
        # A submitted job's own code, fetched, checked and unpacked (never executed by the agent).
        self.prepare_job_code: Callable[..., Path] = prepare_job_code
        # Queue objects and jobs this life already reported as bad: each is one line per life, not per read.
        self._reported: set[str] = set()
        # The watcher, the sentinel and the state poller run until the outcome is decided.
        self.background_stop = threading.Event()
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
        if not self.stack_config.job_id:
            # A config that defines no job: the failing agent was serving the stack's current job.
            current = self._current_job_quietly()
            has_job = current is not None
            if current is not None:
                self._assemble(_for_job(self.stack_config, current))
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
            return JobDirectory(self.clients.s3, self.stack_config, self.log).current()[0]
        except Exception as exc:  # giving up must scale to zero whatever S3 says
            self.log.event("job", "cannot read the stack's current job", error=f"{type(exc).__name__}: {exc}")
            return None

    def successor(self, *, again: bool = False) -> InstanceLife:
        """The next life on this instance, after this one's job ended (or yielded) with another queued: the
        same agent config and collaborators, bound afresh. Scratch disk and the synced dataset stay.
        `again`: the same job served afresh, as after a reboot (this life stopped on its lease's clock)."""
        return InstanceLife(self.stack_config, after=None if again else self.config.job_id, **self._init_args)

    def _holds_lease(self) -> bool | None:
        """For the outcome handlers: whether this life may end the job (bootstrap/outcomes.py)."""
        writer = self.writer
        if writer is None or writer.role is not Role.HOLDER:
            return True
        return writer.confirm()

    def _queued_next(self) -> str | None:
        """The queued job this instance takes once its job has ended (asked by the outcome handlers); in a
        pool running several jobs at once, the job any lane needs it for (holder, next, standby)."""
        if self.stack_config.lanes > 1:
            return work_in_lanes(
                self.clients.s3,
                self.stack_config,
                utc_now(),
                after=self.config.job_id,
                log=self.log,
                group_max=self._group_max_size(),
                reported=self._reported,
                stale_seconds=self.stale_seconds,
            )
        return self._queue().next_job()

    def _queue(self) -> JobDirectory:
        """The stack's jobs and queue, checked against what the group allows."""
        return JobDirectory(
            self.clients.s3,
            self.stack_config,
            self.log,
            group_max=self._group_max_size(),
            reported=self._reported,
        )

    def _group_max_size(self) -> int | None:
        try:
            groups = self.clients.autoscaling.describe_auto_scaling_groups(
                AutoScalingGroupNames=[self.stack_config.group_name]
            )
        except Exception:  # unknown: the stack's instance count stands in
            return None
        found = groups.get("AutoScalingGroups", [])
        return int(found[0]["MaxSize"]) if found else None

    def _leave_job(self) -> None:
        if self.generations is not None:
            self.generations.leave()

    # -- background threads: from boot to the outcome -----------------------------------------------

    def _start_watching(self) -> None:
        """IMDS notices and SIGTERM are watched from boot to the end of the life."""
        self._watcher = SpotWatcher(
            self.imds, self.log, self.config.poll_seconds, self.stops.on_notice, self._on_rebalance
        )
        self._watcher.start()
        self.spawn("shutdown-sentinel", lambda: self.stops.sentinel(self.background_stop))

    def _on_rebalance(self, recommendation: RebalanceRecommendation) -> None:
        """An early checkpoint at once; with a ready standby, a hand-over (decided by the state poller)."""
        self.stops.on_rebalance(recommendation)
        writer = self.writer
        if writer is not None and writer.holding and not writer.at_risk:
            writer.at_risk = True
            self.spawn("handover-watch", self._watch_for_handover)

    def _watch_for_handover(self) -> None:
        """At risk: hand over the moment a standby is ready (seconds count: the notice may follow soon)."""
        assert self.writer is not None
        while not self.background_stop.wait(HANDOVER_POLL_SECONDS) and not self.stops.is_set():
            try:
                why = self.writer.handover_due()
            except Exception:  # S3 hiccup: ask again next second; the state poller asks too
                continue
            if why is not None:
                self.stops.request(why)
                return

    def spawn(self, name: str, target: Callable[[], None]) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._background.append(thread)
        thread.start()

    def _stop_background(self) -> None:
        self.background_stop.set()
        if self._watcher is not None:
            self._watcher.stop()
        for thread in self._background:
            thread.join(timeout=2)

    def _beat(self) -> float:
        """One poll's heartbeats: this node's in the rendezvous, this life's (and its cost) in the ledger.
        Returns the job's total cost."""
        if self.generations is not None:
            self.generations.heartbeat()
        if self.writer is not None:
            why = self.writer.poll()
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
        if self.stack_config.lanes > 1 and leaving_before_binding(self, identity):
            return LifeResult(LifeEnd.SKIPPED)
        if not self._bind_job():
            return self.outcomes.nothing_queued()
        self._life_started = utc_now()
        # Other lives may run beside this one (the other nodes of a multi-node job; a single-node job's
        # holder while this instance is its standby): only silent ones are closed.
        stale = self.stale_seconds
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
        self.spawn(
            "state-poller",
            lambda: self.job.poll(
                self.background_stop, self.state_poll_seconds, self._beat, self.stops.request
            ),
        )
        guard = self._guards_before_start()
        if guard is not None:
            return guard
        outcome: LifeEnd | Failure
        try:
            outcome = run_phases(self, self.phases)
        except Exception as exc:
            # A refused checkpoint already says which object and the fix; anything else is unexpected and
            # named by its type.
            error = str(exc) if isinstance(exc, CheckpointRefusedError) else f"{type(exc).__name__}: {exc}"
            self.log.event("failed", "instance life failed", error=error)
            outcome = Failure(LifeEnd.FAILED, error, list(self.log.tail))
        finally:
            # No more heartbeats or polls: the outcome below is the last word on this life.
            self.background_stop.set()
        if isinstance(outcome, LifeEnd) and outcome in _RELEASE_FIRST:
            self._release_lease()
        try:
            return self._finish(outcome)
        finally:
            self._release_lease()

    @property
    def stale_seconds(self) -> float:
        """A life (or lease, or standby) silent this long is dead: three missed polls and half a minute."""
        if self._lease_seconds is not None:
            return self._lease_seconds
        return 3 * self.state_poll_seconds + 30

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
                self.stack_config,
                utc_now(),
                after=after,
                log=self.log,
                group_max=group_max,
                reported=self._reported,
                stale_seconds=self.stale_seconds,
            )
            if binding is None:
                return False
            try:
                if binding.pinned is not None:
                    self.prepare_pinned(self.clients.s3, self.stack_config, binding.pinned)
                self._code_root = (
                    None
                    if binding.job_code is None
                    else self.prepare_job_code(self.clients.s3, self.stack_config, binding.job_code)
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
        JobDirectory(self.clients.s3, self.stack_config, self.log, reported=self._reported).refuse(
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
                defined_job=self.stack_config.job_id,
                bundle=binding.pinned.get("bundle_key"),
            )
            self._stop_background()
            self.boot.close_logs()
            self.run_pinned(self.clients.s3, self.stack_config, binding.pinned)
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
        config = _for_job(binding.config or self.stack_config, binding.job_id)
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
        if self.writer is not None and self.writer.holding:
            persister = self.persister
            self.writer.release(persister.confirmed_step if persister is not None else None)
            self.writer.role = None

    def _guards_before_start(self) -> LifeResult | None:
        """A life that must not train: too many failures in a row, or a job-wide stop already in force."""
        ledger = self.ledger
        if ledger.consecutive_failures >= self.config.max_consecutive_failures:
            self.background_stop.set()
            why = "the previous agent run on this instance died"
            return self._finish(Failure(LifeEnd.FAILED, why, list(self.log.tail)))
        wide = self.job.job_wide_stop(cost_usd=lambda: ledger.total_cost_usd)
        if wide is not None:
            self.background_stop.set()
            return self._finish(STOP_OUTCOMES[wide.reason])
        return None

    def trainer_log_sink(self) -> Callable[[str], None]:
        assert self.identity is not None
        return self.boot.trainer_log_sink(self.identity)

    def _finish(self, outcome: LifeEnd | Failure) -> LifeResult:
        writer = self.writer
        if writer is None or writer.role is not Role.HOLDER:
            return self._outcome(outcome)
        # The state poller has stopped: the lease is kept renewed while the outcome is acted on (results
        # uploads take minutes), so no standby takes over a job that this life is ending.
        done = threading.Event()
        keeper = threading.Thread(
            target=writer.keep, args=(done, self.state_poll_seconds), name="lease-keeper", daemon=True
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
            output_dir=self.paths.output_dir if self.paths is not None else None,
            follower=self.generations.follower if self.generations is not None else False,
        )
        return self.outcomes.finish(outcome, life)


def _for_job(config: AgentConfig, job_id: str) -> AgentConfig:
    """The agent config with `job_id`'s checkpoints/, results/ and state/ (trainstack_job/jobs.py)."""
    job = JobPrefixes.of(job_id)
    prefixes = replace(config.prefixes, checkpoints=job.checkpoints, results=job.results, state=job.state)
    return replace(config, prefixes=prefixes, job_id=job_id)
