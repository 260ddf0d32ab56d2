"""The job's state in S3 as one life reads and writes it: the ledger (this life's record, its heartbeat and
cost), progress.json, control.json, cancel.json, and the stop every node of the job follows (`trainstack
stop`, `trainstack cancel`, the cost cap, a `--now` job the job yields to).

All of it runs off the stop path: on the state poller's thread with bounded AWS calls, before training or
after the checkpoint is persisted. An S3 outage delays these, never a spot stop.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bootstrap.agent_config import AgentConfig
from bootstrap.errors import one_line
from bootstrap.eventlog import EventLog, utc_now
from bootstrap.imds import InstanceIdentity
from bootstrap.ledger import JobLedger, LedgerStore
from bootstrap.pricing import LifeQuote
from bootstrap.statestore import StateStore
from bootstrap.watchdog import read_progress
from trainstack_job.contract import LEDGER, PROGRESS, BucketPrefix
from trainstack_job.queue import CANCEL_REQUEST
from trainstack_job.records import Progress
from trainstack_job.throughput import THROUGHPUT, ThroughputStore

PROGRESS_UPLOAD_SECONDS = 15.0


@dataclass(frozen=True)
class JobWideStop:
    """A stop every node of the job follows: `control` (`trainstack stop`), `cancel` (`trainstack cancel`),
    `cost_cap`, or `yield` (a `--now` job waits for this instance; fields name it)."""

    reason: str
    fields: dict[str, Any] = field(default_factory=dict)


class JobState:
    """The ledger store and the state store of one life, and what it writes and reads there."""

    def __init__(self, s3: Any, config: AgentConfig, log: EventLog) -> None:
        prefixes = config.prefixes
        self.log = log
        self.state = StateStore(s3, config.bucket, prefixes.state)
        self.ledger_store = LedgerStore(s3, config.bucket, prefixes.state + LEDGER)
        # Each life's measured samples/s (from the trainer's progress.json) goes into its ledger entry, and a
        # life that ends folds the job's lives into the stack's table of throughput per instance type, from
        # which the pools weigh their types (trainstack_job/throughput.py). Stack-wide: under state/, not the
        # job's prefix, so every job's measurements serve the next one of the same model family.
        self.ledger_store.measure_throughput(
            self._progress_now,
            ThroughputStore(s3, config.bucket, BucketPrefix.STATE.value + THROUGHPUT),
            config.job_id,
        )
        self._max_cost_usd = config.max_cost_usd
        # Where the trainer writes progress.json and who this instance is, once training starts.
        self.progress_file: Path | None = None
        self.identity: InstanceIdentity | None = None
        self._state_errors = 0
        # The `--now` job this job should yield to, if any (bootstrap/jobbinding.py JobDirectory.yield_to);
        # None: this job never yields (the legacy job, a multi-node job, tests without a queue).
        self.yield_to: Callable[[], str | None] | None = None

    def _progress_now(self) -> Progress | None:
        """The trainer's latest progress.json as a record; None before training starts or when unreadable."""
        if self.progress_file is None:
            return None
        return Progress.from_json(read_progress(self.progress_file))

    @property
    def ledger(self) -> JobLedger:
        """The newest copy of the ledger this life has read or written."""
        return self.ledger_store.last

    def record(self, change: Callable[[JobLedger], Any]) -> bool:
        """Apply a change to the ledger; False (logged) when S3 cannot take it now."""
        try:
            self.ledger_store.update(change)
        except Exception as exc:
            self.log.event(
                "state",
                "ledger not updated; the next life closes this one from its heartbeat",
                ledger=self.ledger_store.uri,
                error=one_line(exc),
            )
            return False
        if self.ledger_store.throughput_error is not None:
            # The ledger is written; only the stack's throughput table missed this life's figures (the next
            # life end merges them again: each life counts once, by its id).
            self.log.event("state", "throughput table not updated", error=self.ledger_store.throughput_error)
            self.ledger_store.throughput_error = None
        return True

    def heartbeat(self, quote: LifeQuote | None) -> float:
        """This life's heartbeat and cost in the ledger; returns the job's total (what the cost cap reads)."""
        return self.ledger_store.update(lambda ledger: ledger.update_cost(utc_now(), quote))

    def job_wide_stop(self, cost_usd: Callable[[], float]) -> JobWideStop | None:
        """The stop every node of the job follows, or None: `trainstack stop` (control.json), else
        `trainstack cancel` (cancel.json), else the cost cap reached by the job's total, which `cost_usd`
        gives (asked only when there is a cap and no control stop), else a `--now` job to yield to. Raises
        what S3 raises: each caller knows what a failed read means for it."""
        if self.state.stop_requested():
            return JobWideStop("control")
        if self._cancel_requested():
            return JobWideStop("cancel")
        cap = self._max_cost_usd
        if cap is not None:
            total = cost_usd()
            if total >= cap:
                return JobWideStop("cost_cap", {"cost_usd": total, "cap_usd": cap})
        if self.yield_to is not None:
            now_job = self.yield_to()
            if now_job is not None:
                return JobWideStop("yield", {"to": now_job})
        return None

    def _cancel_requested(self) -> bool:
        try:
            return self.state.read(CANCEL_REQUEST) is not None
        except ValueError:  # not JSON: whoever wrote the request still meant it
            return True

    def upload_progress(self) -> None:
        if self.progress_file is None or self.identity is None:
            return
        progress = read_progress(self.progress_file)
        if progress is None:
            return
        progress |= {
            "instance_id": self.identity.instance_id,
            "instance_type": self.identity.instance_type,
            "az": self.identity.az,
        }
        self.state.write(PROGRESS, progress)

    def upload_progress_quietly(self) -> None:
        try:
            self.upload_progress()
        except Exception as exc:
            self.log.event("state", "progress upload failed", error=one_line(exc))

    def poll(
        self,
        done: threading.Event,
        every_seconds: float,
        beat: Callable[[], float],
        stop: Callable[..., None],
    ) -> None:
        """`trainstack stop`, the cost cap, the heartbeats (`beat`: returns the job's total cost) and the
        progress, every `every_seconds` until `done`. A job-wide stop goes to `stop(reason, **fields)`.

        Runs on its own thread with bounded AWS calls: an S3 outage delays these, never a spot stop.
        """
        next_progress = 0.0
        while not done.wait(every_seconds):
            try:
                # The heartbeats run once per poll: within the check when it needs the job's total, after
                # it otherwise. control.json is read first: a `trainstack stop` waits on no write.
                beat_once = functools.cache(beat)
                wide = self.job_wide_stop(cost_usd=beat_once)
                if wide is not None:
                    stop(wide.reason, **wide.fields)
                beat_once()
                if time.monotonic() >= next_progress:
                    self.upload_progress()
                    next_progress = time.monotonic() + PROGRESS_UPLOAD_SECONDS
                if self._state_errors:
                    self.log.event(
                        "state", "job state in S3 reachable again", failed_polls=self._state_errors
                    )
                self._state_errors = 0
            except Exception as exc:  # S3 hiccups must not stop training; the next poll tries again
                self._state_errors += 1
                if self._state_errors == 1:
                    self.log.event("state", "cannot read or write job state; will retry", error=one_line(exc))
