"""How a life ends (`LifeEnd`) and what the agent does about each end: the ledger's last word on the life,
the job's status, the one notification and the scale to zero, the results upload, the instance's release.

Every life ends with an outcome that says what happened (completed, preempted, stopped, cost_cap, failed,
stalled, no_data, cancelled, yielded…), written to the ledger with conditional writes so no update is lost.

A job that ends (completed, failed for good, cancelled, cost cap) with another job in the stack's queue does
not scale the group to zero: the result names that job (`LifeResult.next_job`) and the agent goes on to it on
this instance (bootstrap/agent.py). Only with the queue empty, or on `trainstack stop`, does the group go to
zero (docs/internals.md, "The job queue").
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from enum import Enum
from pathlib import Path
from typing import Any

from bootstrap.agent_config import AgentConfig
from bootstrap.errors import error_code, one_line
from bootstrap.eventlog import EventLog, iso, utc_now
from bootstrap.fleet import Fleet
from bootstrap.imds import ImdsClient, ImdsUnavailableError, InstanceIdentity
from bootstrap.jobstate import JobState
from bootstrap.ledger import FAILED_OUTCOMES, TERMINAL_STATUSES, JobLedger
from bootstrap.notify import Notifier, format_duration, format_metrics
from bootstrap.results import upload_results
from bootstrap.safefiles import read_regular
from trainstack_job.contract import RESUME_COMMAND, JobStatus, LifeOutcome
from trainstack_job.datasets import DatasetPlace, push_command
from trainstack_job.jobs import LEGACY_JOB_ID


class LifeEnd(str, Enum):
    """How one instance life ends, from the trainer's exit to the agent's own exit status.

    The ledger's life outcomes (trainstack_job.contract.LifeOutcome) with the same values, which the ledger
    stores, and the ends no ledger life records."""

    RUNNING = LifeOutcome.RUNNING.value
    COMPLETED = LifeOutcome.COMPLETED.value
    PREEMPTED = LifeOutcome.PREEMPTED.value
    INTERRUPTED = LifeOutcome.INTERRUPTED.value
    STOPPED = LifeOutcome.STOPPED.value
    COST_CAP = LifeOutcome.COST_CAP.value
    FAILED = LifeOutcome.FAILED.value
    STALLED = LifeOutcome.STALLED.value  # also what supervising a trainer that stalled twice returns
    NO_DATA = LifeOutcome.NO_DATA.value
    HANDED_OVER = LifeOutcome.HANDED_OVER.value
    SUPERSEDED = LifeOutcome.SUPERSEDED.value
    LEASE_EXPIRED = LifeOutcome.LEASE_EXPIRED.value
    SURPLUS = LifeOutcome.SURPLUS.value
    STANDBY_ENDED = LifeOutcome.STANDBY_ENDED.value
    CANCELLED = LifeOutcome.CANCELLED.value
    YIELDED = LifeOutcome.YIELDED.value
    # Not in the ledger's words:
    KILLED = "killed"  # the trainer missed the stop deadline and was killed; classified as a failure
    REPLACE = "replace"  # the GPU is broken beyond the one repair: the instance is to be replaced
    REPLACED = "replaced"  # …and was: marked unhealthy, the group launches another
    SKIPPED = "skipped"  # the group was already at zero: the job is over, nothing to do
    GAVE_UP = "gave_up"  # the job was given up (failed for good): notified and scaled to zero
    NO_JOB = "no_job"  # no job running and none queued: the group scaled to zero without a ledger life

    def ledger_outcome(self) -> LifeOutcome:
        """The ledger's outcome for this end (ValueError for the ends the ledger does not record)."""
        return LifeOutcome(self.value)


# Ends that say nothing about the job as a whole: no lease check before them. Any other end of a life that
# held the lease (completion, a failure, a stop, the cost cap, a cancel…) may end the job, notify or scale
# in, so the lease is proved first (docs/internals.md, "Only the lease's holder ends a job").
_NOT_JOB_ENDS = frozenset(
    {
        "handed_over",
        "preempted",
        "superseded",
        "lease_expired",
        "surplus",
        "standby_ended",
    }
)

# Ends after which this instance has nothing left to do; any other ends the life with exit 1 so that
# systemd starts the next life on this instance (and the crash counter decides when to give up). Besides the
# ledger's outcomes, a life can end having replaced its broken instance, skipped (the group was already at
# zero) or given up on the job. One writer per job: handing over, losing the lease, a surplus instance and
# a standby's end are no failure either.
FINAL_ENDS = frozenset(
    {
        LifeEnd.COMPLETED,
        LifeEnd.PREEMPTED,
        LifeEnd.STOPPED,
        LifeEnd.COST_CAP,
        LifeEnd.NO_DATA,
        LifeEnd.HANDED_OVER,
        LifeEnd.SUPERSEDED,
        LifeEnd.LEASE_EXPIRED,
        LifeEnd.SURPLUS,
        LifeEnd.STANDBY_ENDED,
        LifeEnd.REPLACED,
        LifeEnd.SKIPPED,
        LifeEnd.GAVE_UP,
        LifeEnd.CANCELLED,
        LifeEnd.YIELDED,
        LifeEnd.NO_JOB,
    }
)


@dataclass(frozen=True)
class LifeResult:
    outcome: LifeEnd
    # The queued job this instance takes next, without a reboot (the group was not scaled to zero).
    next_job: str | None = None
    # The next life here serves `next_job` afresh, as a new boot would (the lease's holder, its standby, or
    # nobody): a life that stopped on its own clock does not know who holds the job now.
    again: bool = False

    @property
    def exit_code(self) -> int:
        return 0 if self.outcome in FINAL_ENDS else 1


@dataclass(frozen=True)
class Failure:
    """Why a life failed; `permanent` failures stop the job at once instead of costing more lives."""

    outcome: LifeEnd  # FAILED or STALLED
    reason: str
    lines: list[str]
    fix: str = ""
    permanent: bool = False
    signature: dict[str, Any] | None = None


@dataclass(frozen=True)
class LifeFacts:
    """What the outcome handlers need to know about the life that ends."""

    identity: InstanceIdentity | None
    phase: str
    output_dir: Path | None  # where the trainer wrote its results; None before training
    # This node's generation completed but global rank 0 (and the results) ran on another node.
    follower: bool = False


class Outcomes:
    """The outcome handlers: each ends the life in the ledger and, where the job ends, notifies once and
    scales the group to zero."""

    def __init__(
        self,
        config: AgentConfig,
        log: EventLog,
        job: JobState,
        s3: Any,
        fleet: Fleet,
        notifier: Notifier,
        imds: ImdsClient,
        *,
        builtin_trainer: bool,
        release_wait_seconds: float,
        next_job: Callable[[], str | None] | None = None,
        holds_lease: Callable[[], bool | None] | None = None,
        instance_id: Callable[[], str | None] | None = None,
    ) -> None:
        self.config = config
        # This instance's id once known: in a pool running several jobs at once, a job's end takes this
        # instance out of the group, not the group to zero (its other jobs run on).
        self._instance_id = instance_id or (lambda: None)
        self.log = log
        self.job = job
        self.s3 = s3
        self.fleet = fleet
        self.notifier = notifier
        self.imds = imds
        # The built-in trainer always writes model.pt and metrics.json; a user's job writes what it writes.
        self._builtin_trainer = builtin_trainer
        self._release_wait_seconds = release_wait_seconds
        # The head of the stack's queue once this job has ended (None: no queue, the group goes to zero).
        self._next_job = next_job
        # Proves this life still holds the job's lease with a conditional write (bootstrap/standby.py
        # OneWriter.confirm): True held, False another life holds it, None unknown before the lease's end.
        # None: the life holds no lease (a multi-node job, a life that never took one).
        self._holds_lease = holds_lease

    def finish(self, outcome: LifeEnd | Failure, life: LifeFacts) -> LifeResult:
        if outcome == LifeEnd.LEASE_EXPIRED:
            return self.lease_expired(life)
        if isinstance(outcome, Failure) or outcome.value not in _NOT_JOB_ENDS:
            lost = self.not_the_holder(life)
            if lost is not None:
                return lost
        if isinstance(outcome, Failure):
            return self.failed(outcome, life)
        if outcome == LifeEnd.COMPLETED:
            return self.completed(life)
        if outcome == LifeEnd.PREEMPTED:
            self.job.record(
                lambda ledger: ledger.end_life(LifeOutcome.PREEMPTED, utc_now(), phase=life.phase)
            )
            self.log.event(
                "end",
                "preempted: the group's replacement resumes from the confirmed checkpoint",
                interruptions=self.job.ledger.interruptions,
            )
            return LifeResult(LifeEnd.PREEMPTED)
        if outcome == LifeEnd.STOPPED:
            return self.stopped_by_user()
        if outcome == LifeEnd.COST_CAP:
            return self.cost_cap_reached()
        if outcome == LifeEnd.NO_DATA:
            return self.no_dataset()
        if outcome == LifeEnd.REPLACE:
            return self.replace_unhealthy_instance(life)
        if outcome in (LifeEnd.HANDED_OVER, LifeEnd.SUPERSEDED, LifeEnd.SURPLUS, LifeEnd.STANDBY_ENDED):
            return self.one_writer_end(outcome, life)
        if outcome == LifeEnd.CANCELLED:
            return self.cancelled()
        if outcome == LifeEnd.YIELDED:
            return self.yielded(life)
        raise AssertionError(f"unknown outcome {outcome}")

    def not_the_holder(self, life: LifeFacts) -> LifeResult | None:
        """None while this life holds the job's lease (proved now) or holds none; else how it ends instead:
        `superseded` when another life holds the lease (it ends the job: no results, status, e-mail or
        scale-in from here), `lease_expired` when S3 could not say before the lease's end."""
        if self._holds_lease is None:
            return None
        held = self._holds_lease()
        if held is True:
            return None
        if held is False:
            return self.one_writer_end(LifeEnd.SUPERSEDED, life)
        return self.lease_expired(life)

    def lease_expired(self, life: LifeFacts) -> LifeResult:
        """The lease could not be renewed before its end by this instance's clock (S3 unreachable from here):
        the trainer was stopped (or ended) before that end, the job is left as it is, and the next life on
        this instance serves it again: holder if the lease is still free, else standby, else it leaves."""
        self.job.record(
            lambda ledger: ledger.end_life(LifeOutcome.LEASE_EXPIRED, utc_now(), phase=life.phase)
        )
        self.log.event(
            "end",
            "lease expired on this instance's clock: stopped writing the job; the next life here serves it "
            "again (a standby may hold it by now)",
        )
        return LifeResult(LifeEnd.LEASE_EXPIRED, next_job=self.config.job_id, again=True)

    def completed(self, life: LifeFacts) -> LifeResult:
        if life.follower:
            # The node that ran global rank 0 holds the results: it uploaded them, marked the job completed,
            # scaled the group to zero and sent the one notification.
            self.job.record(lambda ledger: ledger.end_life(LifeOutcome.COMPLETED, utc_now()))
            self.log.event("end", "completed; the node that ran rank 0 uploaded the results")
            # Every node goes on to the next queued job, as the node that ran rank 0 does.
            return LifeResult(LifeEnd.COMPLETED, next_job=self.queued_next())
        results = self.config.prefixes.results
        output = life.output_dir
        assert output is not None
        if self._builtin_trainer:
            expected = [output / name for name in ("model.pt", "metrics.json")]
            missing = ", ".join(str(path) for path in expected if not path.is_file())
            if missing:
                reason = f"trainer exited 0 but {missing} is missing"
                return self.failed(Failure(LifeEnd.FAILED, reason, list(self.log.tail)), life)
        try:
            keys = upload_results(
                self.s3,
                self.config.bucket,
                results,
                output,
                say=lambda line: self.log.event("results", line, level="warning"),
            )
        except Exception as exc:
            # The next life restores the final checkpoint, finishes at once and uploads again.
            reason = f"results upload failed: {one_line(exc)}"
            return self.failed(Failure(LifeEnd.FAILED, reason, list(self.log.tail)), life)
        self.log.event(
            "results", "results uploaded", uri=f"s3://{self.config.bucket}/{results}", files=len(keys)
        )
        # The upload may have taken long: the status is the job's end, written only by the lease's holder.
        lost = self.not_the_holder(life)
        if lost is not None:
            return lost
        metrics = _metrics(output)

        def complete(ledger: JobLedger) -> None:
            ledger.end_life(LifeOutcome.COMPLETED, utc_now())
            ledger.set_status(JobStatus.COMPLETED)

        self.job.record(complete)
        ledger = self.job.ledger
        started = ledger.lives[0]["started_at"] if ledger.lives else iso(utc_now())
        duration = (utc_now() - datetime.fromisoformat(started.replace("Z", "+00:00"))).total_seconds()
        lines = [
            f"Training completed: job {self.config.job_id}.",
            f"  duration: {format_duration(duration)} over {len(ledger.lives)} instance life/lives",
            f"  spot interruptions survived: {ledger.interruptions}",
            f"  estimated cost: ${ledger.total_cost_usd:.4f}",
            "Final metrics:",
            *format_metrics(metrics),
            f"Artifacts: s3://{self.config.bucket}/{results}",
            f"Fetch them with: trainstack results pull --job {self.config.job_id}",
        ]
        following = self.queued_next()
        if following is not None:
            self.notify_next(following, "training completed", lines)
            self.log.event("end", "completed", cost_usd=ledger.total_cost_usd, metrics=metrics)
            return LifeResult(LifeEnd.COMPLETED, next_job=following)
        lines.append(f"The group {self.config.group_name} has been scaled to zero; nothing bills any more.")
        self.notify_and_scale_to_zero("training completed", lines)
        self.log.event("end", "completed; scaled to zero", cost_usd=ledger.total_cost_usd, metrics=metrics)
        return LifeResult(LifeEnd.COMPLETED)

    def failed(self, failure: Failure, life: LifeFacts) -> LifeResult:
        limit = self.config.max_consecutive_failures
        verdict: dict[str, Any] = {}

        def end(ledger: JobLedger) -> None:
            # The same failure at the same step as the life before: a third life would fail there too.
            previous = ledger.previous_life()
            verdict["repeated"] = (
                failure.signature is not None
                and previous is not None
                and previous.get("outcome") in FAILED_OUTCOMES
                and previous.get("failure") == failure.signature
            )
            current = ledger.current_life()
            if current is not None and current["outcome"] == LifeOutcome.RUNNING:
                details = {"failure": failure.signature} if failure.signature else {}
                ledger.end_life(failure.outcome.ledger_outcome(), utc_now(), **details)
            verdict["failures"] = ledger.consecutive_failures
            if failure.permanent or verdict["repeated"] or ledger.consecutive_failures >= limit:
                # Another node of the same job may have given up first: it notified and scaled to zero.
                verdict["already"] = ledger.status == JobStatus.FAILED
                ledger.set_status(JobStatus.FAILED)

        self.job.record(end)
        repeated = bool(verdict.get("repeated"))
        failures = int(verdict.get("failures", self.job.ledger.consecutive_failures))
        if not (failure.permanent or repeated or failures >= limit):
            self.log.event(
                "end",
                "life failed; systemd starts the next life",
                reason=failure.reason,
                consecutive_failures=failures,
                limit=limit,
            )
            return LifeResult(failure.outcome)
        if verdict.get("already"):
            self.log.event("end", "the job had already been given up by another node", reason=failure.reason)
            return LifeResult(LifeEnd.GAVE_UP, next_job=self.queued_next())
        if failure.permanent:
            subject = f"training failed: {failure.reason}"
            why = f"This failure is permanent ({failure.reason}): another instance cannot fix it."
        elif repeated:
            subject = "training failed twice at the same step"
            why = f"The job failed the same way twice in a row ({failure.reason} at the same step)."
        else:
            subject = f"training failed {failures} times in a row"
            why = f"The job failed {failures} times in a row (trainstack:maxConsecutiveFailures = {limit})."
        following = self.queued_next()
        lines = [
            why,
            f"Last failure on {life.identity.instance_id if life.identity else '?'}: {failure.reason}",
            "The group has been scaled to zero so that nothing bills. Last log lines:"
            if following is None
            else "Last log lines:",
            *[f"  {line}" for line in failure.lines[-25:]],
            f"Fix: {failure.fix}" if failure.fix else f"Fix the cause, then start again: {RESUME_COMMAND}",
        ]
        if following is not None:
            self.notify_next(following, subject, lines)
            self.log.event("end", subject, reason=failure.reason, consecutive_failures=failures)
            return LifeResult(LifeEnd.GAVE_UP, next_job=following)
        subject += "; group scaled to zero"
        self.notify_and_scale_to_zero(subject, lines)
        self.log.event("end", subject, reason=failure.reason, consecutive_failures=failures)
        return LifeResult(LifeEnd.GAVE_UP)

    def gave_up_on_starting(self, identity: InstanceIdentity, *, has_job: bool = True) -> LifeResult:
        """systemd's start limit was hit (`--give-up`): the job failed; notify and scale to zero.
        `has_job`: False when the agent config defines no job and none is current (no ledger to mark)."""
        try:
            if has_job:
                self.job.record(lambda ledger: ledger.set_status(JobStatus.FAILED))
        finally:
            self.notify_and_scale_to_zero(
                "the agent keeps failing; group scaled to zero",
                [
                    f"The trainstack agent on {identity.instance_id} failed to start repeatedly.",
                    "Read why with: trainstack logs  (or journalctl -u trainstack-agent on the instance).",
                ],
            )
        return LifeResult(LifeEnd.GAVE_UP)

    def no_dataset(self) -> LifeResult:
        dataset = self.config.dataset
        place = DatasetPlace.of(dataset, data_prefix=self.config.prefixes.data)
        source = f"s3://{self.config.bucket}/{place.prefix}"

        def no_data(ledger: JobLedger) -> None:
            ledger.end_life(LifeOutcome.NO_DATA, utc_now())
            ledger.set_status(JobStatus.NO_DATA)

        self.job.record(no_data)
        self.notify_and_scale_to_zero(
            "no dataset; group scaled to zero",
            [
                f"{source} stayed empty for {self.config.data_wait_minutes:g} minutes, so this instance "
                "stopped billing.",
                f"Upload the dataset: {push_command(dataset)}"
                + ("   (train/<class>/…, val/<class>/…)" if self._builtin_trainer else ""),
                f"Then start training: {RESUME_COMMAND}",
            ],
        )
        return LifeResult(LifeEnd.NO_DATA)

    def end_job(self, outcome: LifeOutcome, status: JobStatus) -> bool:
        """End this life and the job; True unless another node of the job had already ended it the same way
        (then it has notified and scaled to zero: once per job, not once per node)."""
        first = {"value": True}

        def end(ledger: JobLedger) -> None:
            first["value"] = ledger.status != status
            ledger.end_life(outcome, utc_now())
            ledger.set_status(status)

        self.job.record(end)
        if not first["value"]:
            self.log.event("end", f"{status.value}: another node of this job already said so")
        return first["value"]

    def stopped_by_user(self) -> LifeResult:
        if not self.end_job(LifeOutcome.STOPPED, JobStatus.STOPPED):
            return LifeResult(LifeEnd.STOPPED)
        self.notify_and_scale_to_zero(
            "stopped on request; group scaled to zero",
            [
                "Training stopped on `trainstack stop`; the newest confirmed checkpoint is kept.",
                f"Checkpoints: s3://{self.config.bucket}/{self.config.prefixes.checkpoints}",
                f"Resume with: {RESUME_COMMAND}",
            ],
        )
        return LifeResult(LifeEnd.STOPPED)

    def cost_cap_reached(self) -> LifeResult:
        if not self.end_job(LifeOutcome.COST_CAP, JobStatus.COST_CAP):
            return LifeResult(LifeEnd.COST_CAP, next_job=self.queued_next())
        total = self.job.ledger.total_cost_usd
        lines = [
            f"The job's estimated cost ${total:.4f} reached the cap "
            f"trainstack:maxCostUsd = ${self.config.max_cost_usd}.",
            f"The latest checkpoint is kept in s3://{self.config.bucket}/{self.config.prefixes.checkpoints}.",
            f"Raise trainstack:maxCostUsd, run pulumi up, then continue from it with: {RESUME_COMMAND}",
        ]
        following = self.queued_next()
        if following is not None:
            self.notify_next(following, "cost cap reached", lines)
            self.log.event("end", "cost cap reached", cost_usd=total, next_job=following)
            return LifeResult(LifeEnd.COST_CAP, next_job=following)
        self.notify_and_scale_to_zero("cost cap reached; group scaled to zero", lines)
        self.log.event("end", "cost cap reached; scaled to zero", cost_usd=self.job.ledger.total_cost_usd)
        return LifeResult(LifeEnd.COST_CAP)

    def cancelled(self) -> LifeResult:
        """`trainstack cancel`: the job stopped with its checkpoint confirmed (or before it trained) and is
        over; the next queued job runs here, or the group goes to zero."""
        if not self.end_job(LifeOutcome.CANCELLED, JobStatus.CANCELLED):
            return LifeResult(LifeEnd.CANCELLED, next_job=self.queued_next())
        lines = [
            "The job was cancelled (`trainstack cancel`); its newest confirmed checkpoint is kept in "
            f"s3://{self.config.bucket}/{self.config.prefixes.checkpoints}.",
        ]
        following = self.queued_next()
        if following is not None:
            self.notify_next(following, "cancelled", lines)
            self.log.event("end", "cancelled", next_job=following)
            return LifeResult(LifeEnd.CANCELLED, next_job=following)
        self.notify_and_scale_to_zero("cancelled; group scaled to zero", lines)
        self.log.event("end", "cancelled; scaled to zero")
        return LifeResult(LifeEnd.CANCELLED)

    def yielded(self, life: LifeFacts) -> LifeResult:
        """A `--now` job asked for this instance: this job stopped at a confirmed checkpoint and waits in the
        queue again (status `queued`), to resume from that checkpoint after it. No notification: it is not
        over."""

        def wait_again(ledger: JobLedger) -> None:
            ledger.end_life(LifeOutcome.YIELDED, utc_now(), phase=life.phase)
            ledger.set_status(JobStatus.QUEUED)

        self.job.record(wait_again)
        # The head is the `--now` job; if that one went away meanwhile, it is this job again. Unreadable:
        # the next life binds again and finds whichever it is.
        following = self.queued_next() or self.config.job_id
        self.log.event(
            "end",
            "yielded to a --now job: back in the queue, resumes from its confirmed checkpoint",
            next_job=following,
        )
        return LifeResult(LifeEnd.YIELDED, next_job=following)

    def nothing_queued(self) -> LifeResult:
        """No job running and none queued: nothing bills for nothing. No ledger is touched (no job). In a pool
        running several jobs at once: nothing here needs this instance, which leaves (the others run on)."""
        if self._leaves_alone():
            self.log.event("queue", "no job of the pool needs this instance: it leaves the group")
        else:
            self.log.event("queue", "no job is running and the queue holds none: scaling the group to zero")
        try:
            done = self._stop_billing()
        except Exception as exc:
            self.log.event(
                "fleet",
                "scale to zero FAILED: set the group's desired capacity to 0 by hand",
                group=self.config.group_name,
                error=one_line(exc),
            )
            raise
        self.log.event("fleet", done, group=self.config.group_name)
        return LifeResult(LifeEnd.NO_JOB)

    def _leaves_alone(self) -> bool:
        """Whether this life stops its own bill only (a pool of several lanes), not the whole group's."""
        return self.config.lanes > 1 and self._instance_id() is not None

    def _stop_billing(self) -> str:
        """The group to zero, or in a pool running several jobs at once this instance out of it, one fewer
        wanted: what was done, for the log."""
        instance = self._instance_id()
        if self.config.lanes > 1 and instance is not None:
            self.fleet.leave_for_good(instance)
            return "left the group, one instance fewer wanted; the pool's other jobs run on"
        self.fleet.scale_to_zero()
        return "group desired capacity set to 0"

    def queued_next(self) -> str | None:
        """The queued job this instance takes next; None (the group goes to zero) when there is none or the
        queue cannot be read: an unreadable queue must never keep a GPU billing."""
        if self._next_job is None:
            return None
        try:
            return self._next_job()
        except Exception as exc:
            self.log.event("queue", "cannot read the job queue; scaling to zero", error=one_line(exc))
            return None

    def _subject(self, subject: str) -> str:
        """Every notification names its job (the legacy job's keep their old subjects)."""
        job = self.config.job_id
        return subject if job == LEGACY_JOB_ID else f"job {job}: {subject}"

    def notify_next(self, following: str, subject: str, lines: list[str]) -> None:
        """The job ended and the queue holds `following`: say so; the group stays up for it."""
        if self.config.lanes > 1:
            # A pool of several lanes: the job that needs this instance next may be one it waits for as its
            # standby, not one it trains at once.
            said = f"This instance serves {following} next (no reboot): it trains it or waits as its standby."
            self.log.event("queue", "this instance serves the pool's next job needing it", next_job=following)
        else:
            said = f"The next queued job, {following}, runs on this instance now (no reboot)."
            self.log.event("queue", "the next queued job runs on this instance", next_job=following)
        self.notifier.publish(self._subject(f"{subject}; next: {following}"), [*lines, said])

    def replace_unhealthy_instance(self, life: LifeFacts) -> LifeResult:
        identity = life.identity
        assert identity is not None
        result = self.failed(
            Failure(LifeEnd.FAILED, "GPU preflight failed after the driver repair", list(self.log.tail)), life
        )
        if result.outcome == LifeEnd.GAVE_UP:
            return result
        self.notifier.publish(
            f"GPU broken on {identity.instance_id}; replacing it",
            [
                f"nvidia-smi / torch CUDA failed on {identity.instance_id} "
                f"({identity.instance_type}, "
                f"{identity.az}) even after reinstalling the driver.",
                "The instance is marked unhealthy; the group launches a replacement.",
                *[f"  {line}" for line in list(self.log.tail)[-10:]],
            ],
        )
        self.fleet.replace_instance(identity.instance_id)
        self.log.event("end", "instance marked unhealthy; the group replaces it")
        return LifeResult(LifeEnd.REPLACED)

    def one_writer_end(self, outcome: LifeEnd, life: LifeFacts) -> LifeResult:
        """A life that stops writing (or never wrote) so that the job keeps one writer: no failure, no
        interruption. One that handed over, lost the lease or found the job staffed leaves the group, which
        stops its bill; a standby whose wait ended is going away already (its notice, the job's end)."""
        self.job.record(lambda ledger: ledger.end_life(outcome.ledger_outcome(), utc_now(), phase=life.phase))
        messages = {
            LifeEnd.HANDED_OVER: "handed over: the standby continues from the confirmed step",
            LifeEnd.SUPERSEDED: "superseded: another instance holds the lease; this one stopped writing",
            LifeEnd.SURPLUS: "surplus: the job has its writer and its standby",
            LifeEnd.STANDBY_ENDED: "standby ended without taking the job over",
        }
        message = messages[outcome]
        if outcome is LifeEnd.SUPERSEDED and self.config.instance_count > 1 and not self.config.user_job:
            # A multi-node job has no lease: its commits are fenced by generation (generation_fence.py).
            message = "superseded: a newer generation owns the job; this node stopped writing"
        self.log.event("end", message)
        if outcome is not LifeEnd.STANDBY_ENDED and life.identity is not None:
            try:
                if self.config.lanes > 1:
                    # It trained until now (a pool of several lanes protects its holders from scale-in).
                    self.fleet.protect(life.identity.instance_id, False)
                decrement = self.fleet.leave(
                    life.identity.instance_id, instance_count=self.config.instance_count
                )
            except Exception as exc:  # the group's own scale-in or the spot notice still ends it
                self.log.event("fleet", "could not leave the group", error=one_line(exc), level="warning")
            else:
                self.log.event("fleet", "left the group", decrement=decrement, group=self.config.group_name)
        if outcome is LifeEnd.STANDBY_ENDED and self._job_over():
            # The job ended (or yielded) while this instance waited warm: it stays in the group, so it goes
            # on with the queue like the holder (there, the next job's standby), never idling billed.
            following = self.queued_next()
            if following is None and self._leaves_alone():
                # A pool of several lanes: the holder took only itself out; this standby goes too.
                self.log.event("fleet", self._stop_billing(), group=self.config.group_name)
            return LifeResult(outcome, next_job=following)
        return LifeResult(outcome)

    def _job_over(self) -> bool:
        try:
            status = self.job.ledger_store.load().status
        except Exception:  # unknown: the agent exits as before and the next boot binds afresh
            return False
        return status in TERMINAL_STATUSES or status == JobStatus.QUEUED

    def notify_and_scale_to_zero(self, subject: str, lines: list[str]) -> None:
        # Scale to zero first: a notification that cannot be sent must never keep the group billing.
        try:
            done = self._stop_billing()
        except Exception as exc:
            self.log.event(
                "fleet",
                "scale to zero FAILED: set the group's desired capacity to 0 by hand",
                group=self.config.group_name,
                error=one_line(exc),
            )
            self.notifier.publish(self._subject(subject) + " (scale to zero FAILED)", lines)
            raise
        self.log.event("fleet", done, group=self.config.group_name)
        if self._leaves_alone():
            subject = subject.replace("group scaled to zero", "its instance left the group")
        self.notifier.publish(self._subject(subject), lines)

    def release_instance(self, identity: InstanceIdentity) -> None:
        """Complete the group's drain hook once the instance is terminating, so it stops billing at once
        instead of after the hook's heartbeat timeout."""
        hook = self.config.lifecycle_hook
        if not hook:
            return
        deadline = time.monotonic() + self._release_wait_seconds
        while time.monotonic() < deadline:
            try:
                if self.imds.get("autoscaling/target-lifecycle-state") == "Terminated":
                    break
            except ImdsUnavailableError:
                pass
            time.sleep(2)
        else:
            self.log.event("release", "instance not terminating; drain hook left alone", hook=hook)
            return
        try:
            self.fleet.complete_lifecycle_action(hook, identity.instance_id)
        except Exception as exc:
            # Not an error: the hook's timeout releases the instance anyway, a few minutes later.
            self.log.event(
                "release",
                "drain hook not completed (moto lacks CompleteLifecycleAction; on AWS this is a permission "
                "or API problem); the group releases the instance at the hook's timeout",
                hook=hook,
                reason=error_code(exc),
            )
            return
        self.log.event("release", "drain hook completed; the group terminates this instance now", hook=hook)


# metrics.json is a few lines; the job owns the folder, so it may put anything there.
MAX_METRICS_BYTES = 2**20


def _metrics(output: Path) -> dict[str, Any] | None:
    """The job's final metrics, read as the job wrote them: never through a link, a FIFO or past a bound
    (the job owns output/; root reads it)."""
    raw = read_regular(output / "metrics.json", MAX_METRICS_BYTES)
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None
