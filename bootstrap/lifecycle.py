"""One instance life: boot → GPU check → data → restore → train → persist → a truthful outcome.

Two promises shape this module (docs/internals.md, "Agent lives"):
- a spot notice, a scale-in, SIGTERM or `trainstack stop` is acted on the moment it is seen, in every phase,
  without waiting on any network call: the watcher asks the trainer to stop itself, and every S3, SNS and
  CloudWatch call runs on other threads or after the checkpoint is persisted;
- every life ends with an outcome that says what happened (completed, preempted, stopped, cost_cap, failed,
  stalled, no_data…), written to the ledger with conditional writes so no update is lost.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from bootstrap import aws
from bootstrap.agent_config import AgentConfig
from bootstrap.datasync import DataSync, DiskSpaceError, SyncAborted
from bootstrap.efa import efa_environment, supports_device_rdma
from bootstrap.eventlog import EventLog, iso, utc_now
from bootstrap.fleet import Fleet
from bootstrap.gpumetrics import GpuMetricPublisher
from bootstrap.imds import ImdsClient, ImdsUnavailableError, InstanceIdentity
from bootstrap.job import BUNDLE_JOB_DIR, JobSpec, JobSpecError, interruption_env, prepare_python
from bootstrap.ledger import FAILED_OUTCOMES, JobLedger, LedgerStore
from bootstrap.logshipper import LogShipper, close_all
from bootstrap.multinode import RENDEZVOUS_ATTEMPTS, NodeExit, NodeGroup, wait_until_confirmed
from bootstrap.notify import Notifier, format_duration, format_metrics
from bootstrap.persist import CheckpointPersister, PersistResult, UploadAbandonedError
from bootstrap.preflight import GpuPreflight
from bootstrap.pricing import CostMeter, LifeQuote, PriceLookup
from bootstrap.rendezvous import Rendezvous
from bootstrap.results import upload_results
from bootstrap.scratch import prepare_scratch
from bootstrap.statestore import StateStore
from bootstrap.trainer import (
    CODE_ROOT,
    PERMANENT_FAILURES,
    TrainerPaths,
    TrainerProcess,
    default_trainer_command,
    trainer_python,
)
from bootstrap.watchdog import StallWatchdog, read_progress
from bootstrap.watcher import RebalanceRecommendation, SpotWatcher, TerminationNotice
from trainstack_job.contract import LEDGER, PROGRESS, RESUME_COMMAND, ExitCode, JobEnv, JobStatus, LifeOutcome

# Outcomes after which this instance has nothing left to do; any other ends the life with exit 1 so that
# systemd starts the next life on this instance (and the crash counter decides when to give up). Besides the
# ledger's life outcomes, a life can end having replaced its broken instance, skipped (the group was already
# at zero) or given up on the job.
FINAL_OUTCOMES = {
    LifeOutcome.COMPLETED,
    LifeOutcome.PREEMPTED,
    LifeOutcome.STOPPED,
    LifeOutcome.COST_CAP,
    "replaced",
    "skipped",
    "gave_up",
    LifeOutcome.NO_DATA,
}
PROGRESS_UPLOAD_SECONDS = 15.0
# After a completion or failure nothing hurries the last upload but the bill.
FINAL_UPLOAD_SECONDS = 300.0
# Why the agent asked the job to stop → what the life's outcome is once it has.
_STOP_OUTCOMES = {
    "spot": LifeOutcome.PREEMPTED,
    "scale-in": LifeOutcome.PREEMPTED,
    "shutdown": LifeOutcome.PREEMPTED,
    "control": LifeOutcome.STOPPED,
    "cost_cap": LifeOutcome.COST_CAP,
}


@dataclass(frozen=True)
class LifeResult:
    outcome: str

    @property
    def exit_code(self) -> int:
        return 0 if self.outcome in FINAL_OUTCOMES else 1


@dataclass
class AwsClients:
    s3: Any
    autoscaling: Any
    sns: Any
    logs: Any
    ec2: Any
    cloudwatch: Any

    @classmethod
    def for_region(cls, region: str, config: Any = aws.RETRY_CONFIG) -> AwsClients:
        names = ("s3", "autoscaling", "sns", "logs", "ec2", "cloudwatch")
        return cls(*(aws.client(name, region, config) for name in names))


@dataclass(frozen=True)
class Failure:
    """Why a life failed; `permanent` failures stop the job at once instead of costing more lives."""

    outcome: LifeOutcome
    reason: str
    lines: list[str]
    fix: str = ""
    permanent: bool = False
    signature: dict[str, Any] | None = None


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
    ) -> None:
        self.config = config
        # Where a user's job workdir is: inside the unpacked bundle on an instance, anywhere in the demo.
        self._job_root = job_root or CODE_ROOT / BUNDLE_JOB_DIR
        self.user_job = JobSpec.from_mapping(config.user_job, "user_job") if config.user_job else None
        self._paths: TrainerPaths | None = None
        self.log = log or EventLog()
        self.clients = clients or AwsClients.for_region(config.region)
        self.imds = imds or ImdsClient()
        self._trainer_command = list(trainer_command) if trainer_command else None
        self.cost_meter = CostMeter.for_agent(
            ec2=self.clients.ec2,
            s3=self.clients.s3,
            region=config.region,
            bucket=config.bucket,
            storage_prefixes=[config.prefixes.checkpoints, config.prefixes.data],
            root_volume_gb=config.root_volume_gb,
            fixed_price=price_lookup,
        )
        self._life_started: datetime | None = None
        self._identity_wait_seconds = identity_wait_seconds
        self._tick_seconds = tick_seconds
        self._release_wait_seconds = release_wait_seconds
        # How often control.json is read and the ledger's heartbeat and cost written.
        self._state_poll_seconds = state_poll_seconds
        prefixes = config.prefixes
        self.state = StateStore(self.clients.s3, config.bucket, prefixes.state)
        self.ledger_store = LedgerStore(self.clients.s3, config.bucket, prefixes.state + LEDGER)
        self.fleet = Fleet(self.clients.autoscaling, config.group_name)
        self.notifier = Notifier(self.clients.sns, config.topic_arn, config.stack, self.log)
        self._shippers: list[LogShipper] = []
        self.identity: InstanceIdentity | None = None
        self.phase = "boot"
        # The stop: the first reason wins; set from the watcher, the state poller or the SIGTERM sentinel.
        self._stop_lock = threading.RLock()
        self._stop_reason: str | None = None
        self._stop_seen_at: float | None = None
        self._stopping = threading.Event()
        self._trainer: TrainerProcess | None = None
        # SIGTERM only flips this flag (a signal handler must not take locks); the sentinel acts on it.
        self._shutdown_flag = False
        self._background_stop = threading.Event()
        self._background: list[threading.Thread] = []
        self._watcher: SpotWatcher | None = None
        self._progress_file: Path | None = None
        self._state_errors = 0
        # Several instances train one job (docs/multi-node.md): the built-in trainer across nodes.
        self.multi_node = config.instance_count > 1 and self.user_job is None
        self._nodes: NodeGroup | None = None
        # Set when this node's generation completed but global rank 0 (and the results) ran elsewhere.
        self._follower = False

    @property
    def ledger(self) -> JobLedger:
        """The newest copy of the ledger this life has read or written."""
        return self.ledger_store.last

    # -- entry points -------------------------------------------------------------------------------

    def request_shutdown(self) -> None:
        """SIGTERM to the agent (OS shutdown, scale-in): stop with a checkpoint, as for a spot notice.
        Called from a signal handler, so it only sets a flag; the sentinel thread does the rest."""
        self._shutdown_flag = True

    def run(self) -> LifeResult:
        self.identity = self._identify()
        self._ship_logs()
        self._start_watching()
        try:
            result = self._run_life(self.identity)
            if result.exit_code == 0:
                self._leave_job()
                self._release_instance(self.identity)
        finally:
            self._stop_background()
            self._leave_job()
            close_all(self._shippers)
        return result

    def _leave_job(self) -> None:
        """Take this node out of the multi-node rendezvous (its node file), so no one joins it as host."""
        nodes, self._nodes = self._nodes, None
        if nodes is None:
            return
        try:
            nodes.leave()
        except Exception as exc:  # its heartbeat goes stale instead; the others then stop counting on it
            self.log.event("rendezvous", "could not remove this node's file", error=_one_line(exc))

    def give_up(self) -> LifeResult:
        """Last resort when systemd's start limit is hit: record, notify, scale to zero."""
        identity = self.identity = self._identify()
        self._ship_logs()
        try:
            self._record(lambda ledger: ledger.set_status(JobStatus.FAILED))
        finally:
            self._notify_and_scale_to_zero(
                "the agent keeps failing; group scaled to zero",
                [
                    f"The trainstack agent on {identity.instance_id} failed to start repeatedly.",
                    "Read why with: trainstack logs  (or journalctl -u trainstack-agent on the instance).",
                ],
            )
            close_all(self._shippers)
        return LifeResult("gave_up")

    # -- stop requests (no network on this path) ----------------------------------------------------

    def _request_stop(self, reason: str, **fields: Any) -> None:
        with self._stop_lock:
            if self._stop_reason is not None:
                return
            self._stop_reason = reason
            self._stop_seen_at = time.monotonic()
            trainer = self._trainer
        self._stopping.set()
        if trainer is not None:
            trainer.request_stop()
        self.log.event(
            "stop",
            "stop requested" + (" from the trainer" if trainer is not None else ""),
            reason=reason,
            phase=self.phase,
            deadline_s=self.config.stop_deadline_seconds,
            **fields,
        )

    def _stop_state(self) -> tuple[str | None, float | None]:
        with self._stop_lock:
            return self._stop_reason, self._stop_seen_at

    def _on_notice(self, notice: TerminationNotice) -> None:
        self.log.event(
            "interruption", f"{notice.source} termination notice", action=notice.action, at=notice.time
        )
        self._request_stop(notice.source)

    def _on_rebalance(self, recommendation: RebalanceRecommendation) -> None:
        trainer = self._trainer
        self.log.event(
            "rebalance",
            "rebalance recommendation: early checkpoint requested"
            if trainer is not None
            else "rebalance recommendation (no trainer running yet)",
            notice_time=recommendation.notice_time,
        )
        if trainer is not None:
            trainer.request_checkpoint()

    def _start_watching(self) -> None:
        """IMDS notices and SIGTERM are watched from boot to the end of the life."""
        self._watcher = SpotWatcher(
            self.imds, self.log, self.config.poll_seconds, self._on_notice, self._on_rebalance
        )
        self._watcher.start()
        self._spawn("shutdown-sentinel", self._sentinel)

    def _sentinel(self) -> None:
        while not self._background_stop.wait(0.1):
            if self._shutdown_flag:
                self._request_stop("shutdown")
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

    # -- job state in S3, polled off the stop path --------------------------------------------------

    def _poll_state(self) -> None:
        """`trainstack stop`, the cost cap, the ledger heartbeat and progress, every state_poll_seconds.

        Runs on its own thread with bounded AWS calls: an S3 outage delays these, never a spot stop.
        """
        next_progress = 0.0
        while not self._background_stop.wait(self._state_poll_seconds):
            try:
                if self.state.stop_requested():
                    self._request_stop("control")
                if self._nodes is not None:
                    self._nodes.heartbeat()
                total = self._heartbeat()
                cap = self.config.max_cost_usd
                if cap is not None and total >= cap:
                    self._request_stop("cost_cap", cost_usd=total, cap_usd=cap)
                if time.monotonic() >= next_progress:
                    self._upload_progress()
                    next_progress = time.monotonic() + PROGRESS_UPLOAD_SECONDS
                if self._state_errors:
                    self.log.event(
                        "state", "job state in S3 reachable again", failed_polls=self._state_errors
                    )
                self._state_errors = 0
            except Exception as exc:  # S3 hiccups must not stop training; the next poll tries again
                self._state_errors += 1
                if self._state_errors == 1:
                    self.log.event(
                        "state", "cannot read or write job state; will retry", error=_one_line(exc)
                    )

    def _heartbeat(self) -> float:
        """This life's heartbeat and cost in the ledger; returns the job's total (what the cost cap reads)."""
        quote = self._price(self.identity) if self.identity else None
        return self.ledger_store.update(lambda ledger: ledger.update_cost(utc_now(), quote))

    def _record(self, change: Callable[[JobLedger], Any]) -> bool:
        """Apply a change to the ledger; False (logged) when S3 cannot take it now."""
        try:
            self.ledger_store.update(change)
        except Exception as exc:
            self.log.event(
                "state",
                "ledger not updated; the next life closes this one from its heartbeat",
                ledger=self.ledger_store.uri,
                error=_one_line(exc),
            )
            return False
        return True

    def _upload_progress(self) -> None:
        if self._progress_file is None or self.identity is None:
            return
        progress = read_progress(self._progress_file)
        if progress is None:
            return
        progress |= {
            "instance_id": self.identity.instance_id,
            "instance_type": self.identity.instance_type,
            "az": self.identity.az,
        }
        self.state.write(PROGRESS, progress)

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
        if self._group_scaled_to_zero():
            return LifeResult("skipped")
        self._life_started = utc_now()
        # Other nodes' lives run beside this one in a multi-node job: only silent ones are closed.
        stale = 3 * self._state_poll_seconds + 30 if self.multi_node else None
        self.ledger_store.begin_life(
            identity, self._price(identity, announce=True), self._life_started, stale_after_seconds=stale
        )
        self._spawn("state-poller", self._poll_state)
        guard = self._guards_before_start()
        if guard is not None:
            return guard
        try:
            outcome = self._prepare_and_train()
        except Exception as exc:
            self.log.event("failed", "instance life failed", error=f"{type(exc).__name__}: {exc}")
            outcome = Failure(LifeOutcome.FAILED, f"{type(exc).__name__}: {exc}", list(self.log.tail))
        finally:
            # No more heartbeats or polls: the outcome below is the last word on this life.
            self._background_stop.set()
        return self._finish(outcome)

    def _prepare_and_train(self) -> str | Failure:
        self.phase = "gpu-check"
        gpu_count = self._preflight()
        if self._stopping.is_set():
            return self._stopped_before_training()
        if gpu_count is None:
            return "replace"
        scratch = prepare_scratch(self.config.scratch_dir, self.log)
        if self.user_job is not None and not self.user_job.data_sync:
            return self._train(scratch, gpu_count)
        dataset = DataSync(
            self.clients.s3, self.config.bucket, self.config.prefixes.data, self.config.region, self.log
        )
        self.phase = "data-wait"
        if not self._wait_for_dataset(dataset):
            return self._stopped_before_training() if self._stopping.is_set() else LifeOutcome.NO_DATA
        self.phase = "data-sync"
        try:
            dataset.sync(scratch / "data", should_abort=self._stopping.is_set)
        except SyncAborted:
            self.log.event("data", "dataset sync aborted by the stop", reason=self._stop_state()[0])
            return self._stopped_before_training()
        except DiskSpaceError as exc:
            # The next instance gets the same disk: retrying would only bill for the same failure.
            self.log.event("failed", "dataset does not fit on this instance", error=str(exc))
            return Failure(
                LifeOutcome.FAILED,
                str(exc),
                list(self.log.tail),
                fix="raise trainstack:rootVolumeSizeGb (or use a type with a larger instance store), "
                f"run pulumi up, then {RESUME_COMMAND}",
                permanent=True,
            )
        return self._train(scratch, gpu_count)

    def _stopped_before_training(self) -> str:
        reason, _ = self._stop_state()
        assert reason is not None
        self.log.event(
            "stop", "stopped before training; nothing new to persist", reason=reason, phase=self.phase
        )
        return _STOP_OUTCOMES[reason]

    def _identify(self) -> InstanceIdentity:
        deadline = time.monotonic() + self._identity_wait_seconds
        while True:
            try:
                return self.imds.identity(self.config.region)
            except ImdsUnavailableError as exc:
                if time.monotonic() > deadline:
                    self.log.event(
                        "start", "IMDS unavailable; running with a host-derived identity", error=str(exc)
                    )
                    host = socket.gethostname()
                    return InstanceIdentity(
                        f"local-{host}", "unknown", "unknown", self.config.region, "on-demand"
                    )
                time.sleep(2)

    def _ship_logs(self) -> None:
        assert self.identity is not None
        shipper = LogShipper(self.clients.logs, self.config.log_group, f"{self.identity.instance_id}/agent")
        self._shippers.append(shipper)
        self.log.add_sink(shipper)

    def _group_scaled_to_zero(self) -> bool:
        try:
            desired = self.fleet.desired_capacity()
        except Exception as exc:  # not fatal: the worst case is one life that finds nothing to do
            self.log.event(
                "start",
                "cannot read the group's desired capacity",
                group=self.config.group_name,
                error=_one_line(exc),
            )
            return False
        if desired == 0:
            self.log.event(
                "start",
                "group is scaled to zero: the job is over, nothing to do",
                group=self.config.group_name,
            )
            return True
        return False

    def _price(self, identity: InstanceIdentity, announce: bool = False) -> LifeQuote | None:
        """This life's cost so far and its prices (bootstrap/pricing.py); None leaves the ledger at the last
        known price."""
        started = self._life_started or utc_now()
        try:
            quote = self.cost_meter.quote(identity, started, utc_now())
        except Exception as exc:
            if announce:
                self.log.event(
                    "cost", "price unavailable; cost not tracked until it is", error=_one_line(exc)
                )
            return None
        if announce:
            self.log.event(
                "cost",
                "price of this instance",
                usd_per_hour=quote.price_usd_per_hour,
                lifecycle=identity.lifecycle,
                source=quote.price_source,
            )
        return quote

    def _guards_before_start(self) -> LifeResult | None:
        ledger = self.ledger
        if ledger.consecutive_failures >= self.config.max_consecutive_failures:
            self._background_stop.set()
            return self._failed(
                Failure(
                    LifeOutcome.FAILED, "the previous agent run on this instance died", list(self.log.tail)
                )
            )
        if self.state.stop_requested():
            self._background_stop.set()
            return self._stopped_by_user()
        cap = self.config.max_cost_usd
        if cap is not None and ledger.total_cost_usd >= cap:
            self._background_stop.set()
            return self._cost_cap_reached()
        return None

    def _preflight(self) -> int | None:
        """GPU count (0 when no GPU is required), or None when the GPU is broken beyond the one repair."""
        if not self.config.gpu_required:
            self.log.event("preflight", "skipped: gpu_required is false")
            return 0
        result = GpuPreflight(trainer_python(), self.log).run()
        self.log.event("preflight", "GPU ok" if result.ok else "GPU broken", detail=result.detail)
        return result.gpu_count if result.ok else None

    def _wait_for_dataset(self, dataset: DataSync) -> bool:
        """True once `data/` holds a dataset; False after `data_wait_minutes` without one or on a stop."""
        if dataset.present():
            return True
        source = f"s3://{self.config.bucket}/{self.config.prefixes.data}"
        minutes = self.config.data_wait_minutes
        # Not "running": `trainstack data push` must not take this wait for a training run to protect.
        self._record(lambda ledger: ledger.set_status(JobStatus.WAITING_FOR_DATA))
        self.log.event(
            "data", "no dataset yet: waiting for `trainstack data push`", source=source, minutes=minutes
        )
        deadline = time.monotonic() + minutes * 60
        while time.monotonic() < deadline:
            if self._stopping.wait(max(0.0, min(self._state_poll_seconds, deadline - time.monotonic()))):
                self._record(lambda ledger: ledger.set_status(JobStatus.RUNNING))
                return False
            if dataset.present():
                self._record(lambda ledger: ledger.set_status(JobStatus.RUNNING))
                self.log.event("data", "dataset arrived", source=source)
                return True
        return False

    # -- training -----------------------------------------------------------------------------------

    def _train(self, scratch: Path, gpu_count: int) -> str | Failure:
        prefixes = self.config.prefixes
        paths = self._paths = TrainerPaths(scratch=scratch)
        keep = self.user_job.checkpoint_keep if self.user_job else 3
        persister = CheckpointPersister(
            self.clients.s3,
            self.config.bucket,
            prefixes.checkpoints,
            paths.checkpoint_dir,
            self.log,
            keep=keep,
        )
        self.phase = "restore"
        try:
            restored = persister.restore(should_abort=self._stopping.is_set)
            trainer = self._job_process(paths, gpu_count, restored)
        except (UploadAbandonedError, InterruptedError):
            return self._stopped_before_training()
        except JobSpecError as exc:
            fix = f"fix the job's requirements file, run pulumi up, then {RESUME_COMMAND}"
            return Failure(LifeOutcome.FAILED, exc.problems[0], list(self.log.tail), fix=fix, permanent=True)
        self._progress_file = paths.progress_file
        metrics = GpuMetricPublisher(self.clients.cloudwatch, self.config.group_name, self.log)
        if self.multi_node:
            self._nodes = self._node_group(paths)
        with self._stop_lock:
            if self._stop_reason is not None:
                return self._stopped_before_training()
            self.phase = "training"
            if self._nodes is None:
                self.log.event("train", "trainer starting", argv=trainer.argv, restored_step=restored)
                trainer.start()
                self._trainer = trainer
        persister.start()
        if gpu_count:
            metrics.start()
        try:
            code = (
                self._train_generations(trainer, persister, restored)
                if self._nodes is not None
                else self._supervise(trainer, persister)
            )
        finally:
            metrics.stop()
        self.phase = "final-upload"
        reason, seen_at = self._stop_state()
        deadline = (
            seen_at + self.config.stop_deadline_seconds
            if seen_at is not None
            else time.monotonic() + FINAL_UPLOAD_SECONDS
        )
        persisted = persister.finish(deadline)
        persister.close()
        persisted = self._job_checkpoint_confirmed(persisted, persister, deadline)
        self._upload_progress_quietly()
        return self._classify_exit(code, reason, persisted, trainer)

    # -- several nodes, one job (docs/multi-node.md) ------------------------------------------------

    def _node_group(self, paths: TrainerPaths) -> NodeGroup:
        assert self.identity is not None
        try:
            address = self.imds.get("local-ipv4") or socket.gethostbyname(socket.gethostname())
        except ImdsUnavailableError:
            address = socket.gethostbyname(socket.gethostname())
        rendezvous = Rendezvous(
            self.clients.s3,
            self.config.bucket,
            self.config.prefixes.state,
            instance_id=self.identity.instance_id,
            address=address,
            stack=self.config.stack,
            min_nodes=self.config.min_nodes,
            max_nodes=self.config.instance_count,
            stale_seconds=3 * self._state_poll_seconds + 30,
        )
        return NodeGroup(
            rendezvous,
            min_nodes=self.config.min_nodes,
            max_nodes=self.config.instance_count,
            exit_file=paths.scratch / "node-exit.json",
            address=address,
        )

    def _train_generations(
        self, trainer: TrainerProcess, persister: CheckpointPersister, restored: int | None
    ) -> int | str:
        """Run the trainer in one generation after another until the job completes, fails or this node
        is stopped. A generation ends for everyone when any node stops (its notice stops all ranks at one
        step, with one checkpoint): the others then join the next generation and go on with the nodes
        that remain; a node that arrives while a generation trains is absorbed by torch's own restart."""
        nodes = self._nodes
        assert nodes is not None
        failed_rendezvous = 0
        while True:
            try:
                membership = nodes.join()
            except Exception as exc:  # S3 unreachable for now: the stop path never waits on this
                failed_rendezvous += 1
                self.log.event("rendezvous", "cannot join a generation; will retry", error=_one_line(exc))
                if failed_rendezvous >= RENDEZVOUS_ATTEMPTS:
                    return int(ExitCode.FAILED)
                if self._stopping.wait(min(30.0, 2.0 * failed_rendezvous)):
                    return int(ExitCode.STOPPED)
                continue
            generation = membership.generation
            self._record(_in_generation(generation.number))
            trainer.update_env(nodes.trainer_env(membership))
            with self._stop_lock:
                if self._stop_reason is not None:
                    # The last generation ended with every rank's checkpoint committed: nothing new here.
                    return int(ExitCode.STOPPED)
                self.log.event(
                    "rendezvous",
                    "hosting generation" if membership.is_host else "joining generation",
                    generation=generation.number,
                    endpoint=generation.endpoint,
                    nodes=f"{nodes.min_nodes}..{nodes.max_nodes}",
                    restored_step=restored,
                    **({"repaired": membership.repaired} if membership.repaired else {}),
                )
                trainer.start()
                self._trainer = trainer
            code = self._supervise(trainer, persister)
            ended = nodes.node_exit()
            if code == ExitCode.COMPLETED:
                # Global rank 0's node owns the results and the job's completion; the others end quietly
                # once it has said so (a scale-in it caused may already be stopping them: still completed).
                self._follower = ended is not None and not ended.rank0_here
                if not self._follower or self._stop_state()[0] is not None or self._job_completed_elsewhere():
                    return code
                self.log.event(
                    "rendezvous", "the node with rank 0 did not complete the job; regrouping", level="warning"
                )
                continue
            if self._stop_state()[0] is not None:
                return code
            if ended is not None and ended.rendezvous_failed:
                failed_rendezvous += 1
                self.log.event(
                    "rendezvous",
                    "generation did not form; trying the next one",
                    generation=generation.number,
                    attempt=failed_rendezvous,
                )
                if failed_rendezvous >= RENDEZVOUS_ATTEMPTS or self._stopping.wait(2.0):
                    return code
                continue
            failed_rendezvous = 0
            if code != ExitCode.STOPPED:
                return code
            why = self._job_wide_stop()
            if why is not None:
                self._request_stop(why)
                return code
            self.log.event(
                "rendezvous",
                "another node left the job; every rank stopped at one step with its checkpoint, regrouping",
                generation=generation.number,
                stopped_step=ended.stopped_step if ended else None,
                world_size=ended.world_size if ended else None,
            )
            restored = self._catch_up(persister, ended)

    def _catch_up(self, persister: CheckpointPersister, ended: NodeExit | None) -> int | None:
        """Before the next generation: the job's newest checkpoint on this node too. The step every rank
        stopped at was committed by global rank 0, maybe on the node that just left: wait (up to the stop
        deadline) for its upload, then restore it from S3, so the next generation resumes there and not
        at an older step this node happens to hold."""
        if ended is not None and ended.stopped_step is not None and not ended.rank0_here:
            deadline = time.monotonic() + self.config.stop_deadline_seconds
            seen = wait_until_confirmed(
                persister.read_latest, ended.stopped_step, deadline, should_stop=self._stopping.is_set
            )
            if seen is None or seen < ended.stopped_step:
                self.log.event(
                    "checkpoint",
                    "the step every rank stopped at was not confirmed in S3 in time; resuming from the "
                    "newest one that was",
                    level="warning",
                    stopped_step=ended.stopped_step,
                    confirmed_step=seen,
                )
        try:
            return persister.restore(should_abort=self._stopping.is_set)
        except Exception as exc:  # the next generation still resumes from the newest step any node holds
            self.log.event("checkpoint", "could not restore from S3 before regrouping", error=_one_line(exc))
            return None

    def _job_wide_stop(self) -> str | None:
        """A stop that every node must follow (`trainstack stop`, the cost cap), checked when a generation
        stopped without this node asking: another node may have seen it first."""
        try:
            if self.state.stop_requested():
                return "control"
            cap = self.config.max_cost_usd
            if cap is not None and self.ledger_store.load().total_cost_usd >= cap:
                return "cost_cap"
        except Exception as exc:  # the state poller keeps asking; regrouping is the safe default
            self.log.event("state", "cannot read the job state; regrouping", error=_one_line(exc))
        return None

    def _job_completed_elsewhere(self, wait_seconds: float = 300.0) -> bool:
        """Whether the node that ran global rank 0 marked the job completed (it uploads the results)."""
        deadline = time.monotonic() + wait_seconds
        while True:
            try:
                if self.ledger_store.load().status == JobStatus.COMPLETED:
                    return True
            except Exception as exc:
                self.log.event("state", "cannot read the ledger; will retry", error=_one_line(exc))
            if time.monotonic() >= deadline:
                return False
            if self._stopping.wait(min(5.0, self._state_poll_seconds)):
                return True  # stopping (the rank-0 node's scale to zero, most likely): the job did complete

    def _job_checkpoint_confirmed(
        self, persisted: PersistResult, persister: CheckpointPersister, deadline: float
    ) -> PersistResult:
        """On a node whose ranks stopped without rank 0, the job's checkpoint is the rank-0 node's to
        upload: wait (to the stop deadline) for S3 latest.json to reach the step every rank stopped at."""
        ended = self._nodes.node_exit() if self._nodes is not None else None
        if ended is None or ended.rank0_here or ended.stopped_step is None:
            return persisted
        if persisted.confirmed_step is not None and persisted.confirmed_step >= ended.stopped_step:
            return PersistResult(ended.stopped_step, persisted.confirmed_step)
        confirmed = wait_until_confirmed(persister.read_latest, ended.stopped_step, deadline)
        return PersistResult(ended.stopped_step, confirmed)

    def _job_process(self, paths: TrainerPaths, gpu_count: int, restored: int | None) -> TrainerProcess:
        """The job to run: a user's command in its workdir (and requirements), or the built-in trainer."""
        spec = self.user_job
        env = paths.contract_env(with_data=spec is None or spec.data_sync, restored_step=restored)
        env |= interruption_env(*self.ledger.spot_interruptions())
        env[JobEnv.CHECKPOINT_KEEP.value] = str(spec.checkpoint_keep if spec else 3)
        if self.config.efa and self.identity is not None:
            # NCCL over EFA between the nodes (infra/efa.py chose an EFA type and a cluster placement group).
            env |= efa_environment(device_rdma=supports_device_rdma(self.identity.instance_type))
        if spec is None:
            command = self._trainer_command or default_trainer_command(gpu_count)
            return TrainerProcess(
                command,
                paths,
                dict(self.config.job),
                self._trainer_log_sink(),
                defer_early_signals=self._trainer_command is None,
                env=env,
            )
        workdir = self._job_root / spec.workdir
        self.phase = "job-setup"
        python = prepare_python(
            trainer_python(),
            workdir / spec.requirements if spec.requirements else None,
            paths.scratch / "python",
            self.log.event,
            should_abort=self._stopping.is_set,
        )
        # `python` in the job's command means the job's interpreter: the AMI's PyTorch env or its venv.
        command = [python if arg in ("python", "python3") else arg for arg in spec.command]
        self.log.event("job", "user job", name=spec.name, workdir=str(workdir), restored_step=restored)
        return TrainerProcess(
            command, paths, {}, self._trainer_log_sink(), user_job=True, cwd=workdir, env={**env, **spec.env}
        )

    def _trainer_log_sink(self) -> Any:
        assert self.identity is not None
        shipper = LogShipper(self.clients.logs, self.config.log_group, f"{self.identity.instance_id}/trainer")
        self._shippers.append(shipper)

        def sink(line: str) -> None:
            print(line, flush=True)
            shipper(line)

        return sink

    def _trainer_deadline(self, seen_at: float, persister: CheckpointPersister) -> float:
        """When a stopping trainer is killed: early enough to leave the final upload its measured time."""
        budget = self.config.stop_deadline_seconds
        upload = max(persister.upload_seconds, default=5.0)
        return seen_at + budget - min(budget / 2, 2 * upload + 2)

    def _supervise(self, trainer: TrainerProcess, persister: CheckpointPersister) -> int | str:
        """Run the trainer to its exit code, or "stalled" / "killed". Only local checks: no network here."""
        watchdog = StallWatchdog(self.config.stall_minutes * 60)
        restarted = False
        while True:
            code = trainer.poll()
            if code is not None:
                return code
            reason, seen_at = self._stop_state()
            if seen_at is not None:
                if time.monotonic() > self._trainer_deadline(seen_at, persister):
                    self.log.event(
                        "stop",
                        "trainer missed the stop deadline; killing it (its newest checkpoint may be lost)",
                        reason=reason,
                    )
                    trainer.kill()
                    return "killed"
            else:
                progress = read_progress(trainer.paths.progress_file)
                # A user's job that never reports progress is not watched (docs/job-contract.md), nor a
                # node of a multi-node job without global rank 0 (the rank-0 node's agent watches the job).
                watched = progress is not None or (self.user_job is None and self._nodes is None)
                if watched and watchdog.observe(progress.get("step") if progress else None):
                    idle = round(watchdog.idle_seconds())
                    trainer.kill()
                    if restarted:
                        self.log.event(
                            "stall", "training stalled again after a restart; giving up", idle_s=idle
                        )
                        return "stalled"
                    self.log.event("stall", "no training progress; restarting the trainer once", idle_s=idle)
                    restarted = True
                    watchdog.reset()
                    trainer.start()
            time.sleep(self._tick_seconds)

    def _classify_exit(
        self, code: int | str, reason: str | None, persisted: PersistResult, trainer: TrainerProcess
    ) -> str | Failure:
        progress = read_progress(trainer.paths.progress_file) or {}
        if code == ExitCode.COMPLETED:
            # A job that completed wins over a stop request that arrived meanwhile.
            return LifeOutcome.COMPLETED
        if reason is not None:
            fields: dict[str, Any] = {
                "exit_code": code,
                "checkpoint_confirmed": persisted.confirmed,
                "checkpoint_step": persisted.confirmed_step,
                "newest_local_step": persisted.newest_local_step,
                "reached_step": progress.get("step"),
            }
            _, seen_at = self._stop_state()
            if seen_at is not None:
                fields["notice_to_exit_s"] = round(time.monotonic() - seen_at, 2)
            confirmed = persisted.confirmed and code == ExitCode.STOPPED
            self.log.event(
                "stop",
                "trainer stopped; checkpoint confirmed in S3"
                if confirmed
                else "trainer stopped WITHOUT its newest checkpoint in S3; the confirmed one is kept",
                reason=reason,
                **fields,
            )
            return _STOP_OUTCOMES[reason]
        if code == ExitCode.STOPPED:
            # Nobody here asked: the OS sent the stop (shutdown), so this instance is going away.
            self.log.event("stop", "trainer stopped by the system", exit_code=code)
            return LifeOutcome.PREEMPTED
        if code == "stalled":
            return Failure(
                LifeOutcome.STALLED, "trainer stalled", list(trainer.tail)[-25:] or list(self.log.tail)
            )
        self.log.event("failed", "trainer exited with a failure", exit_code=code, step=progress.get("step"))
        lines = list(trainer.tail)[-25:] or list(self.log.tail)
        if isinstance(code, int) and code in PERMANENT_FAILURES:
            why, fix = PERMANENT_FAILURES[code]
            return Failure(LifeOutcome.FAILED, f"{why} (trainer exit {code})", lines, fix=fix, permanent=True)
        signature = {"exit_code": code, "step": progress.get("step")}
        return Failure(LifeOutcome.FAILED, f"trainer exited {code}", lines, signature=signature)

    def _upload_progress_quietly(self) -> None:
        try:
            self._upload_progress()
        except Exception as exc:
            self.log.event("state", "progress upload failed", error=_one_line(exc))

    # -- outcomes -----------------------------------------------------------------------------------

    def _finish(self, outcome: str | Failure) -> LifeResult:
        if isinstance(outcome, Failure):
            return self._failed(outcome)
        if outcome == LifeOutcome.COMPLETED:
            return self._completed()
        if outcome == LifeOutcome.PREEMPTED:
            self._record(lambda ledger: ledger.end_life(LifeOutcome.PREEMPTED, utc_now(), phase=self.phase))
            self.log.event(
                "end",
                "preempted: the group's replacement resumes from the confirmed checkpoint",
                interruptions=self.ledger.interruptions,
            )
            return LifeResult(LifeOutcome.PREEMPTED)
        if outcome == LifeOutcome.STOPPED:
            return self._stopped_by_user()
        if outcome == LifeOutcome.COST_CAP:
            return self._cost_cap_reached()
        if outcome == LifeOutcome.NO_DATA:
            return self._no_dataset()
        if outcome == "replace":
            return self._replace_unhealthy_instance()
        raise AssertionError(f"unknown outcome {outcome}")

    def _completed(self) -> LifeResult:
        if self._follower:
            # The node that ran global rank 0 holds the results: it uploaded them, marked the job completed,
            # scaled the group to zero and sent the one notification.
            self._record(lambda ledger: ledger.end_life(LifeOutcome.COMPLETED, utc_now()))
            self.log.event("end", "completed; the node that ran rank 0 uploaded the results")
            return LifeResult(LifeOutcome.COMPLETED)
        results = self.config.prefixes.results
        assert self._paths is not None
        output = self._paths.output_dir
        if self.user_job is None:
            expected = [output / name for name in ("model.pt", "metrics.json")]
            missing = ", ".join(str(path) for path in expected if not path.is_file())
            if missing:
                return self._failed(
                    Failure(
                        LifeOutcome.FAILED, f"trainer exited 0 but {missing} is missing", list(self.log.tail)
                    )
                )
        try:
            keys = upload_results(self.clients.s3, self.config.bucket, results, output)
        except Exception as exc:
            # The next life restores the final checkpoint, finishes at once and uploads again.
            reason = f"results upload failed: {_one_line(exc)}"
            return self._failed(Failure(LifeOutcome.FAILED, reason, list(self.log.tail)))
        self.log.event(
            "results", "results uploaded", uri=f"s3://{self.config.bucket}/{results}", files=len(keys)
        )
        metrics = self._metrics(output)

        def complete(ledger: JobLedger) -> None:
            ledger.end_life(LifeOutcome.COMPLETED, utc_now())
            ledger.set_status(JobStatus.COMPLETED)

        self._record(complete)
        ledger = self.ledger
        started = ledger.lives[0]["started_at"] if ledger.lives else iso(utc_now())
        duration = (utc_now() - datetime.fromisoformat(started.replace("Z", "+00:00"))).total_seconds()
        lines = [
            "Training completed.",
            f"  duration: {format_duration(duration)} over {len(ledger.lives)} instance life/lives",
            f"  spot interruptions survived: {ledger.interruptions}",
            f"  estimated cost: ${ledger.total_cost_usd:.4f}",
            "Final metrics:",
            *format_metrics(metrics),
            f"Artifacts: s3://{self.config.bucket}/{results}",
            "Fetch them with: trainstack results pull",
            f"The group {self.config.group_name} has been scaled to zero; nothing bills any more.",
        ]
        self._notify_and_scale_to_zero("training completed", lines)
        self.log.event("end", "completed; scaled to zero", cost_usd=ledger.total_cost_usd, metrics=metrics)
        return LifeResult(LifeOutcome.COMPLETED)

    @staticmethod
    def _metrics(output: Path) -> dict[str, Any] | None:
        try:
            value = json.loads((output / "metrics.json").read_text())
        except (OSError, ValueError):
            return None
        return value if isinstance(value, dict) else None

    def _failed(self, failure: Failure) -> LifeResult:
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
            life = ledger.current_life()
            if life is not None and life["outcome"] == LifeOutcome.RUNNING:
                details = {"failure": failure.signature} if failure.signature else {}
                ledger.end_life(failure.outcome, utc_now(), **details)
            verdict["failures"] = ledger.consecutive_failures
            if failure.permanent or verdict["repeated"] or ledger.consecutive_failures >= limit:
                # Another node of the same job may have given up first: it notified and scaled to zero.
                verdict["already"] = ledger.status == JobStatus.FAILED
                ledger.set_status(JobStatus.FAILED)

        self._record(end)
        repeated = bool(verdict.get("repeated"))
        failures = int(verdict.get("failures", self.ledger.consecutive_failures))
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
            return LifeResult("gave_up")
        if failure.permanent:
            subject = f"training failed: {failure.reason}; group scaled to zero"
            why = f"This failure is permanent ({failure.reason}): another instance cannot fix it."
        elif repeated:
            subject = "training failed twice at the same step; group scaled to zero"
            why = f"The job failed the same way twice in a row ({failure.reason} at the same step)."
        else:
            subject = f"training failed {failures} times in a row; group scaled to zero"
            why = f"The job failed {failures} times in a row (trainstack:maxConsecutiveFailures = {limit})."
        self._notify_and_scale_to_zero(
            subject,
            [
                why,
                f"Last failure on {self.identity.instance_id if self.identity else '?'}: {failure.reason}",
                "The group has been scaled to zero so that nothing bills. Last log lines:",
                *[f"  {line}" for line in failure.lines[-25:]],
                f"Fix: {failure.fix}"
                if failure.fix
                else f"Fix the cause, then start again: {RESUME_COMMAND}",
            ],
        )
        self.log.event("end", subject, reason=failure.reason, consecutive_failures=failures)
        return LifeResult("gave_up")

    def _no_dataset(self) -> LifeResult:
        source = f"s3://{self.config.bucket}/{self.config.prefixes.data}"

        def no_data(ledger: JobLedger) -> None:
            ledger.end_life(LifeOutcome.NO_DATA, utc_now())
            ledger.set_status(JobStatus.NO_DATA)

        self._record(no_data)
        self._notify_and_scale_to_zero(
            "no dataset; group scaled to zero",
            [
                f"{source} stayed empty for {self.config.data_wait_minutes:g} minutes, so this instance "
                "stopped billing.",
                "Upload the dataset: trainstack data push ./dataset   (train/<class>/…, val/<class>/…)",
                f"Then start training: {RESUME_COMMAND}",
            ],
        )
        return LifeResult(LifeOutcome.NO_DATA)

    def _end_job(self, outcome: LifeOutcome, status: JobStatus) -> bool:
        """End this life and the job; True unless another node of the job had already ended it the same way
        (then it has notified and scaled to zero: once per job, not once per node)."""
        first = {"value": True}

        def end(ledger: JobLedger) -> None:
            first["value"] = ledger.status != status
            ledger.end_life(outcome, utc_now())
            ledger.set_status(status)

        self._record(end)
        if not first["value"]:
            self.log.event("end", f"{status.value}: another node of this job already said so")
        return first["value"]

    def _stopped_by_user(self) -> LifeResult:
        if not self._end_job(LifeOutcome.STOPPED, JobStatus.STOPPED):
            return LifeResult(LifeOutcome.STOPPED)
        self._notify_and_scale_to_zero(
            "stopped on request; group scaled to zero",
            [
                "Training stopped on `trainstack stop`; the newest confirmed checkpoint is kept.",
                f"Checkpoints: s3://{self.config.bucket}/{self.config.prefixes.checkpoints}",
                f"Resume with: {RESUME_COMMAND}",
            ],
        )
        return LifeResult(LifeOutcome.STOPPED)

    def _cost_cap_reached(self) -> LifeResult:
        if not self._end_job(LifeOutcome.COST_CAP, JobStatus.COST_CAP):
            return LifeResult(LifeOutcome.COST_CAP)
        self._notify_and_scale_to_zero(
            "cost cap reached; group scaled to zero",
            [
                f"The job's estimated cost ${self.ledger.total_cost_usd:.4f} reached the cap "
                f"trainstack:maxCostUsd = ${self.config.max_cost_usd}.",
                f"The latest checkpoint is kept in s3://{self.config.bucket}/{self.config.prefixes.checkpoints}.",
                f"Raise trainstack:maxCostUsd, run pulumi up, then continue from it with: {RESUME_COMMAND}",
            ],
        )
        self.log.event("end", "cost cap reached; scaled to zero", cost_usd=self.ledger.total_cost_usd)
        return LifeResult(LifeOutcome.COST_CAP)

    def _replace_unhealthy_instance(self) -> LifeResult:
        assert self.identity is not None
        result = self._failed(
            Failure(LifeOutcome.FAILED, "GPU preflight failed after the driver repair", list(self.log.tail))
        )
        if result.outcome == "gave_up":
            return result
        self.notifier.publish(
            f"GPU broken on {self.identity.instance_id}; replacing it",
            [
                f"nvidia-smi / torch CUDA failed on {self.identity.instance_id} "
                f"({self.identity.instance_type}, "
                f"{self.identity.az}) even after reinstalling the driver.",
                "The instance is marked unhealthy; the group launches a replacement.",
                *[f"  {line}" for line in list(self.log.tail)[-10:]],
            ],
        )
        self.fleet.replace_instance(self.identity.instance_id)
        self.log.event("end", "instance marked unhealthy; the group replaces it")
        return LifeResult("replaced")

    def _notify_and_scale_to_zero(self, subject: str, lines: list[str]) -> None:
        # Scale to zero first: a notification that cannot be sent must never keep the group billing.
        try:
            self.fleet.scale_to_zero()
        except Exception as exc:
            self.log.event(
                "fleet",
                "scale to zero FAILED: set the group's desired capacity to 0 by hand",
                group=self.config.group_name,
                error=_one_line(exc),
            )
            self.notifier.publish(subject + " (scale to zero FAILED)", lines)
            raise
        self.log.event("fleet", "group desired capacity set to 0", group=self.config.group_name)
        self.notifier.publish(subject, lines)

    def _release_instance(self, identity: InstanceIdentity) -> None:
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
                reason=_error_code(exc),
            )
            return
        self.log.event("release", "drain hook completed; the group terminates this instance now", hook=hook)


def _in_generation(number: int) -> Callable[[JobLedger], None]:
    def change(ledger: JobLedger) -> None:
        ledger.set_generation(number)

    return change


def _error_code(exc: BaseException) -> str:
    """AWS's error code (AccessDenied, ValidationError…) or the exception's kind: one calm word."""
    response = getattr(exc, "response", None)
    code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
    return str(code or type(exc).__name__)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]
