"""One instance life: preflight → scratch → data → train (restoring the latest checkpoint) → outcome."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from bootstrap import aws
from bootstrap.agent_config import AgentConfig
from bootstrap.datasync import DataSync
from bootstrap.eventlog import EventLog, iso, utc_now
from bootstrap.fleet import Fleet
from bootstrap.gpumetrics import GpuMetricPublisher
from bootstrap.imds import ImdsClient, ImdsUnavailableError, InstanceIdentity
from bootstrap.ledger import JobLedger
from bootstrap.logshipper import LogShipper
from bootstrap.notify import Notifier, format_duration, format_metrics
from bootstrap.preflight import GpuPreflight
from bootstrap.pricing import PriceLookup, SpotPriceLookup
from bootstrap.scratch import prepare_scratch
from bootstrap.statestore import LEDGER, PROGRESS, StateStore
from bootstrap.trainer import (
    EXIT_COMPLETED,
    EXIT_STOPPED,
    TrainerPaths,
    TrainerProcess,
    default_trainer_command,
    trainer_python,
)
from bootstrap.watchdog import StallWatchdog, read_progress
from bootstrap.watcher import RebalanceRecommendation, SpotWatcher, TerminationNotice

# Outcomes after which this instance has nothing left to do; any other ends the life with exit 1 so that
# systemd starts the next life on this instance (and the crash counter decides when to give up).
FINAL_OUTCOMES = {
    "completed",
    "preempted",
    "stopped",
    "cost_cap",
    "replaced",
    "skipped",
    "gave_up",
    "no_data",
}
PROGRESS_UPLOAD_SECONDS = 15.0
# Why the agent asked the trainer to stop → what the life's outcome is once it has.
_STOP_OUTCOMES = {
    "spot": "preempted",
    "scale-in": "preempted",
    "shutdown": "preempted",
    "control": "stopped",
    "cost_cap": "cost_cap",
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
    def for_region(cls, region: str) -> AwsClients:
        return cls(
            *(aws.client(name, region) for name in ("s3", "autoscaling", "sns", "logs", "ec2", "cloudwatch"))
        )


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
    ) -> None:
        self.config = config
        self.log = log or EventLog()
        self.clients = clients or AwsClients.for_region(config.region)
        self.imds = imds or ImdsClient()
        self._trainer_command = list(trainer_command) if trainer_command else None
        self._price_lookup = price_lookup or SpotPriceLookup(self.clients.ec2)
        self._identity_wait_seconds = identity_wait_seconds
        self._tick_seconds = tick_seconds
        self._release_wait_seconds = release_wait_seconds
        # How often control.json is read and the cost updated (each cost check writes the ledger).
        self._state_poll_seconds = state_poll_seconds
        prefixes = config.prefixes
        self.state = StateStore(self.clients.s3, config.bucket, prefixes.state)
        self.fleet = Fleet(self.clients.autoscaling, config.group_name)
        self.notifier = Notifier(self.clients.sns, config.topic_arn, config.stack, self.log)
        self._notice: TerminationNotice | None = None
        self._notice_at: float | None = None
        self._shutdown = threading.Event()
        self._shippers: list[LogShipper] = []
        self.identity: InstanceIdentity | None = None
        self.ledger = JobLedger()

    # -- entry points -------------------------------------------------------------------------------

    def request_shutdown(self) -> None:
        """SIGTERM to the agent (OS shutdown): stop the trainer with a checkpoint, as for a spot notice."""
        self._shutdown.set()

    def run(self) -> LifeResult:
        self.identity = self._identify()
        self._ship_logs()
        try:
            result = self._run_life(self.identity)
            if result.exit_code == 0:
                self._release_instance(self.identity)
        finally:
            for shipper in self._shippers:
                shipper.close()
        return result

    def give_up(self) -> LifeResult:
        """Last resort when systemd's start limit is hit: record, notify, scale to zero."""
        identity = self.identity = self._identify()
        self._ship_logs()
        try:
            self.ledger = JobLedger(self.state.read(LEDGER))
            self.ledger.set_status("failed")
            self._save_ledger()
        finally:
            self._notify_and_scale_to_zero(
                "the agent keeps failing; group scaled to zero",
                [
                    f"The trainstack agent on {identity.instance_id} failed to start repeatedly.",
                    "Read why with: trainstack logs  (or journalctl -u trainstack-agent on the instance).",
                ],
            )
            for shipper in self._shippers:
                shipper.close()
        return LifeResult("gave_up")

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
            self.log.event(
                "release",
                "could not complete the drain hook; the group proceeds at its timeout",
                hook=hook,
                error=str(exc).splitlines()[0][:200],
            )
            return
        self.log.event("release", "drain hook completed; the group terminates this instance now", hook=hook)

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
        self.ledger = JobLedger(self.state.read(LEDGER))
        self.ledger.begin_life(identity, self._price(identity), utc_now())
        self._save_ledger()
        guard = self._guards_before_start()
        if guard is not None:
            return guard
        try:
            gpu_count = self._preflight()
            if gpu_count is None:
                return self._replace_unhealthy_instance()
            scratch = prepare_scratch(self.config.scratch_dir, self.log)
            dataset = DataSync(
                self.clients.s3, self.config.bucket, self.config.prefixes.data, self.config.region, self.log
            )
            if not self._wait_for_dataset(dataset):
                return self._no_dataset()
            dataset.sync(scratch / "data")
            outcome, trainer = self._train(scratch, gpu_count)
        except Exception as exc:
            self.log.event("failed", "instance life failed", error=f"{type(exc).__name__}: {exc}")
            return self._failed("failed", f"{type(exc).__name__}: {exc}", list(self.log.tail))
        return self._finish(outcome, trainer)

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
                error=str(exc),
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

    def _price(self, identity: InstanceIdentity) -> float | None:
        try:
            price = self._price_lookup(identity.instance_type, identity.az)
        except Exception as exc:
            self.log.event("cost", "spot price unavailable; cost not tracked for this life", error=str(exc))
            return None
        self.log.event("cost", "price of this instance", usd_per_hour=price, lifecycle=identity.lifecycle)
        return price

    def _save_ledger(self) -> None:
        self.state.write(LEDGER, self.ledger.data)

    def _guards_before_start(self) -> LifeResult | None:
        if self.ledger.consecutive_failures >= self.config.max_consecutive_failures:
            return self._failed("failed", "the previous agent run on this instance died", list(self.log.tail))
        if self.state.stop_requested():
            return self._stopped_by_user()
        if self._over_cost_cap():
            return self._cost_cap_reached()
        return None

    def _over_cost_cap(self) -> bool:
        cap = self.config.max_cost_usd
        return cap is not None and self.ledger.update_cost(utc_now()) >= cap

    def _preflight(self) -> int | None:
        """GPU count (0 when no GPU is required), or None when the GPU is broken beyond the one repair."""
        if not self.config.gpu_required:
            self.log.event("preflight", "skipped: gpu_required is false")
            return 0
        result = GpuPreflight(trainer_python(), self.log).run()
        self.log.event("preflight", "GPU ok" if result.ok else "GPU broken", detail=result.detail)
        return result.gpu_count if result.ok else None

    # -- training -----------------------------------------------------------------------------------

    def _on_notice(self, notice: TerminationNotice) -> None:
        self._notice = notice
        self._notice_at = time.monotonic()
        self.log.event(
            "interruption", f"{notice.source} termination notice", action=notice.action, at=notice.time
        )

    def _train(self, scratch: Path, gpu_count: int) -> tuple[str, TrainerProcess]:
        prefixes = self.config.prefixes
        paths = TrainerPaths(
            scratch=scratch,
            checkpoint_uri=f"s3://{self.config.bucket}/{prefixes.checkpoints.rstrip('/')}",
            output_uri=f"s3://{self.config.bucket}/{prefixes.results.rstrip('/')}",
        )
        command = self._trainer_command or default_trainer_command(gpu_count)
        trainer_log = self._trainer_log_sink()
        trainer = TrainerProcess(command, paths, dict(self.config.job), trainer_log)

        def on_rebalance(recommendation: RebalanceRecommendation) -> None:
            self.log.event(
                "rebalance",
                "rebalance recommendation: early checkpoint requested",
                notice_time=recommendation.notice_time,
            )
            trainer.request_checkpoint()

        watcher = SpotWatcher(self.imds, self.log, self.config.poll_seconds, self._on_notice, on_rebalance)
        metrics = GpuMetricPublisher(self.clients.cloudwatch, self.config.group_name, self.log)
        watcher.start()
        if gpu_count:
            metrics.start()
        try:
            outcome = self._supervise(trainer)
        finally:
            watcher.stop()
            metrics.stop()
            self._upload_progress(trainer)
        return outcome, trainer

    def _trainer_log_sink(self) -> Any:
        assert self.identity is not None
        shipper = LogShipper(self.clients.logs, self.config.log_group, f"{self.identity.instance_id}/trainer")
        self._shippers.append(shipper)

        def sink(line: str) -> None:
            print(line, flush=True)
            shipper(line)

        return sink

    def _supervise(self, trainer: TrainerProcess) -> str:
        """Run the trainer to an outcome: completed, preempted, stopped, cost_cap, failed or stalled."""
        watchdog = StallWatchdog(self.config.stall_minutes * 60)
        self.log.event("train", "trainer starting", argv=trainer.argv)
        trainer.start()
        restarted = False
        stop_reason: str | None = None
        stop_deadline = 0.0
        next_state = next_progress = time.monotonic()
        while True:
            code = trainer.poll()
            if code is not None:
                return self._classify_exit(code, stop_reason, trainer)
            now = time.monotonic()
            if stop_reason is None:
                check_state = now >= next_state
                stop_reason = self._stop_reason(check_state)
                next_state = now + self._state_poll_seconds if check_state else next_state
                if stop_reason is not None:
                    self.log.event(
                        "stop",
                        "stop requested from the trainer",
                        reason=stop_reason,
                        deadline_s=self.config.stop_deadline_seconds,
                    )
                    trainer.request_stop()
                    stop_deadline = now + self.config.stop_deadline_seconds
            elif now > stop_deadline:
                self.log.event(
                    "stop",
                    "trainer missed the stop deadline; killing it (checkpoint NOT confirmed)",
                    reason=stop_reason,
                )
                trainer.kill()
                return _STOP_OUTCOMES[stop_reason]
            if now >= next_progress:
                self._upload_progress(trainer)
                next_progress = now + PROGRESS_UPLOAD_SECONDS
            progress = read_progress(trainer.paths.progress_file)
            if stop_reason is None and watchdog.observe(progress.get("step") if progress else None):
                idle = round(watchdog.idle_seconds())
                trainer.kill()
                if restarted:
                    self.log.event("stall", "training stalled again after a restart; giving up", idle_s=idle)
                    return "stalled"
                self.log.event("stall", "no training progress; restarting the trainer once", idle_s=idle)
                restarted = True
                watchdog.reset()
                trainer.start()
            time.sleep(self._tick_seconds)

    def _stop_reason(self, check_state: bool) -> str | None:
        if self._notice is not None:
            return self._notice.source
        if self._shutdown.is_set():
            return "shutdown"
        if not check_state:
            return None
        try:
            if self.state.stop_requested():
                return "control"
            over = self._over_cost_cap()
            self._save_ledger()
            if over:
                return "cost_cap"
        except Exception as exc:  # S3 hiccups must not stop training; the next tick tries again
            self.log.event("state", "cannot read or write job state; will retry", error=str(exc))
        return None

    def _classify_exit(self, code: int, stop_reason: str | None, trainer: TrainerProcess) -> str:
        if stop_reason is not None:
            confirmed = code == EXIT_STOPPED
            fields: dict[str, Any] = {"exit_code": code, "checkpoint_confirmed": confirmed}
            if confirmed:
                latest = self._latest_checkpoint()
                progress = read_progress(trainer.paths.progress_file) or {}
                fields |= {
                    "checkpoint_step": latest.get("step") if latest else None,
                    "reached_step": progress.get("step"),
                }
            if self._notice_at is not None:
                fields["notice_to_exit_s"] = round(time.monotonic() - self._notice_at, 2)
            self.log.event(
                "stop",
                "trainer stopped" if confirmed else "trainer stopped WITHOUT a checkpoint",
                reason=stop_reason,
                **fields,
            )
            return _STOP_OUTCOMES[stop_reason]
        if code == EXIT_COMPLETED:
            return "completed"
        if code == EXIT_STOPPED:
            # Nobody here asked: the OS sent the stop (shutdown), so this instance is going away.
            self.log.event("stop", "trainer stopped by the system", exit_code=code)
            return "preempted"
        self.log.event("failed", "trainer exited with a failure", exit_code=code)
        return "failed"

    def _latest_checkpoint(self) -> dict[str, Any] | None:
        key = f"{self.config.prefixes.checkpoints}latest.json"
        try:
            body = self.clients.s3.get_object(Bucket=self.config.bucket, Key=key)["Body"].read()
        except Exception:
            return None
        value = json.loads(body)
        return value if isinstance(value, dict) else None

    def _upload_progress(self, trainer: TrainerProcess) -> None:
        progress = read_progress(trainer.paths.progress_file)
        if progress is None or self.identity is None:
            return
        progress |= {
            "instance_id": self.identity.instance_id,
            "instance_type": self.identity.instance_type,
            "az": self.identity.az,
        }
        try:
            self.state.write(PROGRESS, progress)
        except Exception as exc:
            self.log.event("state", "progress upload failed; will retry", error=str(exc))

    # -- outcomes -----------------------------------------------------------------------------------

    def _finish(self, outcome: str, trainer: TrainerProcess) -> LifeResult:
        if outcome == "completed":
            return self._completed()
        if outcome == "preempted":
            self.ledger.end_life("preempted", utc_now())
            self._save_ledger()
            self.log.event(
                "end",
                "preempted: the group's replacement resumes from the confirmed checkpoint",
                interruptions=self.ledger.interruptions,
            )
            return LifeResult("preempted")
        if outcome == "stopped":
            return self._stopped_by_user()
        if outcome == "cost_cap":
            return self._cost_cap_reached()
        lines = list(trainer.tail)[-25:] or list(self.log.tail)
        return self._failed(outcome, f"trainer {outcome}", lines)

    def _completed(self) -> LifeResult:
        results = self.config.prefixes.results
        missing = []
        for name in ("model.pt", "metrics.json"):
            try:
                self.clients.s3.head_object(Bucket=self.config.bucket, Key=results + name)
            except Exception:
                missing.append(f"s3://{self.config.bucket}/{results}{name}")
        if missing:
            return self._failed(
                "failed", f"trainer exited 0 but {', '.join(missing)} is missing", list(self.log.tail)
            )
        metrics = self._metrics()
        self.ledger.end_life("completed", utc_now())
        self.ledger.set_status("completed")
        self._save_ledger()
        started = self.ledger.lives[0]["started_at"] if self.ledger.lives else iso(utc_now())
        duration = (utc_now() - datetime.fromisoformat(started.replace("Z", "+00:00"))).total_seconds()
        lines = [
            "Training completed.",
            f"  duration: {format_duration(duration)} over {len(self.ledger.lives)} instance life/lives",
            f"  spot interruptions survived: {self.ledger.interruptions}",
            f"  estimated cost: ${self.ledger.total_cost_usd:.4f}",
            "Final metrics:",
            *format_metrics(metrics),
            f"Artifacts: s3://{self.config.bucket}/{results}",
            "Fetch them with: trainstack results pull",
            f"The group {self.config.group_name} has been scaled to zero; nothing bills any more.",
        ]
        self._notify_and_scale_to_zero("training completed", lines)
        self.log.event(
            "end", "completed; scaled to zero", cost_usd=self.ledger.total_cost_usd, metrics=metrics
        )
        return LifeResult("completed")

    def _metrics(self) -> dict[str, Any] | None:
        key = f"{self.config.prefixes.results}metrics.json"
        try:
            value = json.loads(self.clients.s3.get_object(Bucket=self.config.bucket, Key=key)["Body"].read())
        except Exception:
            return None
        return value if isinstance(value, dict) else None

    def _failed(self, outcome: str, reason: str, last_lines: list[str]) -> LifeResult:
        life = self.ledger.current_life()
        if life is not None and life["outcome"] == "running":
            self.ledger.end_life(outcome, utc_now())
        failures = self.ledger.consecutive_failures
        limit = self.config.max_consecutive_failures
        if failures < limit:
            self._save_ledger()
            self.log.event(
                "end",
                "life failed; systemd starts the next life",
                reason=reason,
                consecutive_failures=failures,
                limit=limit,
            )
            return LifeResult(outcome)
        self.ledger.set_status("failed")
        self._save_ledger()
        self._notify_and_scale_to_zero(
            f"training failed {failures} times in a row; group scaled to zero",
            [
                f"The job failed {failures} times in a row "
                f"(limit trainstack:maxConsecutiveFailures = {limit}).",
                f"Last failure on {self.identity.instance_id if self.identity else '?'}: {reason}",
                "The group has been scaled to zero so that nothing bills. Last log lines:",
                *[f"  {line}" for line in last_lines[-25:]],
                "Fix the cause, then scale the group up again (trainstack resume).",
            ],
        )
        self.log.event("end", "crash-loop guard tripped; scaled to zero", consecutive_failures=failures)
        return LifeResult("gave_up")

    def _wait_for_dataset(self, dataset: DataSync) -> bool:
        """True once `data/` holds a dataset; False after `data_wait_minutes` without one."""
        if dataset.present():
            return True
        source = f"s3://{self.config.bucket}/{self.config.prefixes.data}"
        minutes = self.config.data_wait_minutes
        # Not "running": `trainstack data push` must not take this wait for a training run to protect.
        self.ledger.set_status("waiting_for_data")
        self._save_ledger()
        self.log.event(
            "data", "no dataset yet: waiting for `trainstack data push`", source=source, minutes=minutes
        )
        deadline = time.monotonic() + minutes * 60
        while time.monotonic() < deadline and not self._shutdown.is_set():
            time.sleep(max(0.0, min(self._state_poll_seconds, deadline - time.monotonic())))
            if dataset.present():
                self.ledger.set_status("running")
                self._save_ledger()
                self.log.event("data", "dataset arrived", source=source)
                return True
        return False

    def _no_dataset(self) -> LifeResult:
        source = f"s3://{self.config.bucket}/{self.config.prefixes.data}"
        self.ledger.end_life("no_data", utc_now())
        self.ledger.set_status("no_data")
        self._save_ledger()
        self._notify_and_scale_to_zero(
            "no dataset; group scaled to zero",
            [
                f"{source} stayed empty for {self.config.data_wait_minutes:g} minutes, so this instance "
                "stopped billing.",
                "Upload the dataset: trainstack data push ./dataset   (train/<class>/…, val/<class>/…)",
                "Then start training: trainstack resume",
            ],
        )
        return LifeResult("no_data")

    def _stopped_by_user(self) -> LifeResult:
        self.ledger.end_life("stopped", utc_now())
        self.ledger.set_status("stopped")
        self._save_ledger()
        self._notify_and_scale_to_zero(
            "stopped on request; group scaled to zero",
            [
                "Training stopped on `trainstack stop` with a confirmed checkpoint.",
                f"Checkpoints: s3://{self.config.bucket}/{self.config.prefixes.checkpoints}",
                "Resume with: trainstack resume",
            ],
        )
        return LifeResult("stopped")

    def _cost_cap_reached(self) -> LifeResult:
        self.ledger.end_life("cost_cap", utc_now())
        self.ledger.set_status("cost_cap")
        self._save_ledger()
        self._notify_and_scale_to_zero(
            "cost cap reached; group scaled to zero",
            [
                f"The job's estimated cost ${self.ledger.total_cost_usd:.4f} reached the cap "
                f"trainstack:maxCostUsd = ${self.config.max_cost_usd}.",
                f"The latest checkpoint is kept in s3://{self.config.bucket}/{self.config.prefixes.checkpoints}.",
                "Raise trainstack:maxCostUsd and run pulumi up to continue from it.",
            ],
        )
        self.log.event("end", "cost cap reached; scaled to zero", cost_usd=self.ledger.total_cost_usd)
        return LifeResult("cost_cap")

    def _replace_unhealthy_instance(self) -> LifeResult:
        assert self.identity is not None
        result = self._failed("failed", "GPU preflight failed after the driver repair", list(self.log.tail))
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
        self.notifier.publish(subject, lines)
        try:
            self.fleet.scale_to_zero()
        except Exception as exc:
            self.log.event(
                "fleet",
                "scale to zero FAILED: set the group's desired capacity to 0 by hand",
                group=self.config.group_name,
                error=str(exc),
            )
            raise
        self.log.event("fleet", "group desired capacity set to 0", group=self.config.group_name)
