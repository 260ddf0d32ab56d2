"""The stop request of one life: a spot notice, a scale-in, SIGTERM, `trainstack stop` or the cost cap.

The promise kept here (docs/internals.md, "Agent lives"): a stop is acted on the moment it is seen, in
every phase, without waiting on any network call. `request` only takes a lock, sets an Event and asks the
running trainer to stop itself (it touches the stop file and signals the job); every S3, SNS and CloudWatch
call runs on other threads or after the checkpoint is persisted. Nothing in this module may call the network.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from bootstrap.eventlog import EventLog
from bootstrap.outcomes import LifeEnd
from bootstrap.trainer import TrainerProcess
from bootstrap.watcher import RebalanceRecommendation, TerminationNotice

# Why the agent asked the job to stop → how the life ends once it has.
STOP_OUTCOMES = {
    "spot": LifeEnd.PREEMPTED,
    "scale-in": LifeEnd.PREEMPTED,
    "shutdown": LifeEnd.PREEMPTED,
    "control": LifeEnd.STOPPED,
    "cost_cap": LifeEnd.COST_CAP,
    # One writer per job (bootstrap/standby.py): a ready standby continues, or a newer holder took over.
    "handover": LifeEnd.HANDED_OVER,
    "lease_lost": LifeEnd.SUPERSEDED,
    # The holder could not renew its lease: it stops on its own clock before the lease ends.
    "lease_expiring": LifeEnd.LEASE_EXPIRED,
    # A multi-node node whose generation the others declared lost (bootstrap/generation_fence.py).
    "generation_superseded": LifeEnd.SUPERSEDED,
    # The job queue (bootstrap/jobbinding.py): `trainstack cancel`, or a `--now` job asking for the instance.
    "cancel": LifeEnd.CANCELLED,
    "yield": LifeEnd.YIELDED,
}


class StopRequests:
    """The stop: the first reason wins; set from the watcher, the state poller or the SIGTERM sentinel.

    Also the trainer to signal (the one running now) and the life's phase, which every stop report names.
    """

    def __init__(self, log: EventLog, deadline_seconds: float) -> None:
        self.log = log
        self._deadline_seconds = deadline_seconds
        self.phase = "boot"
        self._lock = threading.RLock()
        self._reason: str | None = None
        self._seen_at: float | None = None
        self._stopping = threading.Event()
        self._trainer: TrainerProcess | None = None
        # time.monotonic() by which the trainer must be gone whatever the stop (the lease's end by this
        # instance's own clock); None: only the stop deadline applies.
        self._kill_at: float | None = None
        # SIGTERM only flips this flag (a signal handler must not take locks); the sentinel acts on it.
        self._shutdown_flag = False

    # -- the request --------------------------------------------------------------------------------

    def request(self, reason: str, **fields: Any) -> None:
        with self._lock:
            if self._reason is not None:
                return
            self._reason = reason
            self._seen_at = time.monotonic()
            trainer = self._trainer
        self._stopping.set()
        if trainer is not None:
            trainer.request_stop()
        self.log.event(
            "stop",
            "stop requested" + (" from the trainer" if trainer is not None else ""),
            reason=reason,
            phase=self.phase,
            deadline_s=self._deadline_seconds,
            **fields,
        )

    def state(self) -> tuple[str | None, float | None]:
        """The stop's reason and when it was seen (time.monotonic), both None while nobody asked."""
        with self._lock:
            return self._reason, self._seen_at

    @property
    def reason(self) -> str | None:
        return self.state()[0]

    def kill_by(self, deadline: float) -> None:
        """The trainer must be gone by `deadline` (time.monotonic()), whatever the stop's own deadline."""
        with self._lock:
            self._kill_at = deadline

    @property
    def kill_at(self) -> float | None:
        with self._lock:
            return self._kill_at

    def is_set(self) -> bool:
        """Whether a stop was requested: the `should_abort` of the data sync, the restore and installs."""
        return self._stopping.is_set()

    def wait(self, timeout: float) -> bool:
        """Sleep up to `timeout`, waking at once on a stop; True when stopping."""
        return self._stopping.wait(timeout)

    def stopped_before_training(self) -> LifeEnd:
        """A stop that came before the trainer started: the life ends with the stop's outcome."""
        reason = self.reason
        assert reason is not None
        self.log.event(
            "stop", "stopped before training; nothing new to persist", reason=reason, phase=self.phase
        )
        return STOP_OUTCOMES[reason]

    # -- the trainer it signals ---------------------------------------------------------------------

    @property
    def trainer(self) -> TrainerProcess | None:
        return self._trainer

    def launch(self, start: Callable[[], TrainerProcess | None]) -> bool:
        """Run `start` (which starts the trainer, or returns None when it starts none) unless a stop came
        first; False then. Under the lock, so a stop is either seen before the start (nothing is started)
        or signals the trainer just started."""
        with self._lock:
            if self._reason is not None:
                return False
            trainer = start()
            if trainer is not None:
                self._trainer = trainer
            return True

    # -- where stops come from ----------------------------------------------------------------------

    def on_notice(self, notice: TerminationNotice) -> None:
        self.log.event(
            "interruption", f"{notice.source} termination notice", action=notice.action, at=notice.time
        )
        self.request(notice.source)

    def on_rebalance(self, recommendation: RebalanceRecommendation) -> None:
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

    def request_shutdown(self) -> None:
        """SIGTERM to the agent. Called from a signal handler, so it only sets a flag; `sentinel` acts."""
        self._shutdown_flag = True

    def sentinel(self, done: threading.Event) -> None:
        """Turns SIGTERM's flag into a stop request (`shutdown`), until `done` is set."""
        while not done.wait(0.1):
            if self._shutdown_flag:
                self.request("shutdown")
                return
