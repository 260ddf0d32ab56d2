"""The job ledger (`state/ledger.json`): instance lives, interruptions, crash counter, cost so far.

Every change is a read-modify-write under an S3 conditional write (`LedgerStore.update`), so two writers —
this life's state poller and its main thread, or an old life still draining and its replacement — never
lose each other's updates.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, TypeVar

from botocore.exceptions import ClientError

from bootstrap.eventlog import iso
from bootstrap.imds import InstanceIdentity
from bootstrap.pricing import LifeQuote
from trainstack_job.contract import JobStatus, LifeOutcome
from trainstack_job.records import ENDED_STATUSES, Ledger, Life, Progress, is_conflict, write_condition
from trainstack_job.throughput import ThroughputStore

# The ledger is plain JSON: statuses and outcomes are stored as their string values, and these sets (of
# str enums) match those strings.
TERMINAL_STATUSES = ENDED_STATUSES
FAILED_OUTCOMES = frozenset({LifeOutcome.FAILED, LifeOutcome.STALLED})
# A life that ended because the instance went away: counted as an interruption, never as a failure.
INTERRUPTED_OUTCOMES = frozenset({LifeOutcome.PREEMPTED, LifeOutcome.INTERRUPTED})
# One writer per job (docs/internals.md, "Jobs, the lease and the standby"): lives that end without saying
# anything about the job's health leave the crash counter as it is, neither a failure nor a reset. A surplus
# life and a standby whose wait ended never trained; a superseded life trained, but its lease went to a newer
# holder, and it is that holder's lives that tell whether the job works: resetting here would hide a crash
# loop of the new holder behind the old one's late report. HANDED_OVER is not here: the holder trained up to
# a confirmed checkpoint and passed it on, which is progress, and resets the counter like any good end.
NEUTRAL_OUTCOMES = frozenset(
    {LifeOutcome.SUPERSEDED, LifeOutcome.LEASE_EXPIRED, LifeOutcome.SURPLUS, LifeOutcome.STANDBY_ENDED}
)
# Lives that never trained the job: not "the life before" when a failure is compared with the previous one.
UNTRAINED_OUTCOMES = frozenset({LifeOutcome.SURPLUS, LifeOutcome.STANDBY_ENDED})
_T = TypeVar("_T")


def _parse(moment: str) -> datetime:
    return datetime.fromisoformat(moment.replace("Z", "+00:00"))


def _hours(start: str, end: str) -> float:
    return max(0.0, (_parse(end) - _parse(start)).total_seconds() / 3600)


def _fold_mean(life: dict[str, Any], keys: tuple[str, str, str], value: float, progress: Progress) -> bool:
    """Fold one report's `value` into the life's running mean, kept to 3 decimals under `keys` (the mean, how
    many reports it holds, the step of the last): a report of a step already counted (seen at an earlier
    heartbeat, or a restarted trainer's older one) counts once. True when it counted."""
    mean_key, count_key, step_key = keys
    last_step = life.get(step_key)
    if isinstance(last_step, int) and progress.step <= last_step:
        return False
    reports = life.get(count_key)
    count = reports if isinstance(reports, int) and reports > 0 else 0
    mean = float(life.get(mean_key) or 0.0)
    life[mean_key] = round((mean * count + value) / (count + 1), 3)
    life[count_key] = count + 1
    life[step_key] = progress.step
    return True


class JobLedger:
    """In-memory view of the ledger; `LedgerStore.update` applies each change to the latest copy in S3."""

    def __init__(self, raw: dict[str, Any] | None = None, life_id: str | None = None) -> None:
        self.data: dict[str, Any] = copy.deepcopy(raw) if raw else {}
        # A new ledger starts as trainstack_job.records.Ledger's defaults (its one definition).
        for key, value in Ledger().to_json().items():
            self.data.setdefault(key, value)
        self._current: dict[str, Any] | None = None
        if life_id is not None:
            self._current = next((x for x in self.data["lives"] if x.get("life_id") == life_id), None)

    @property
    def status(self) -> str:
        return str(self.data["status"])

    @property
    def consecutive_failures(self) -> int:
        return int(self.data["consecutive_failures"])

    @property
    def interruptions(self) -> int:
        return int(self.data["interruptions"])

    @property
    def total_cost_usd(self) -> float:
        return float(self.data["total_cost_usd"])

    @property
    def standby_cost_usd(self) -> float:
        """What the job paid for lives waiting as warm standby (0.0 for a ledger before standbys)."""
        return float(self.data.get("standby_cost_usd") or 0.0)

    @property
    def handovers(self) -> int:
        """Lives that ended handing the job over to a warm standby."""
        return int(self.data.get("handovers") or 0)

    @property
    def lives(self) -> list[dict[str, Any]]:
        return list(self.data["lives"])

    def spot_interruptions(self) -> tuple[int, float]:
        """Spot lives that ended interrupted, and the job's spot instance-hours so far (a running life to
        its last heartbeat): the observed interruption rate. On-demand lives are never interrupted."""
        spot = [x for x in self.data["lives"] if x.get("lifecycle") == "spot"]
        count = sum(1 for x in spot if x["outcome"] in INTERRUPTED_OUTCOMES)
        hours = sum(_hours(x["started_at"], x.get("ended_at") or x["heartbeat_at"]) for x in spot)
        return count, hours

    def previous_life(self) -> dict[str, Any] | None:
        """The life before this one (None for the first). In a multi-node job, lives of the same generation
        as this one ran beside it, not before it, and are skipped: one crash seen by every node is one
        failure, not a repeat."""
        lives = self.data["lives"]
        if self._current is None:
            return lives[-1] if lives else None
        index = next(i for i, x in enumerate(lives) if x is self._current)
        generation = self._current.get("generation")
        earlier = [
            x
            for x in lives[:index]
            if (generation is None or x.get("generation") != generation)
            and x.get("outcome") not in UNTRAINED_OUTCOMES
        ]
        return earlier[-1] if earlier else None

    def begin_life(
        self,
        identity: InstanceIdentity,
        price: LifeQuote | float | None,
        now: datetime,
        stale_after_seconds: float | None = None,
        restart: bool = True,
    ) -> str:
        """Open this life and close the ones left `running`; returns the new life's id.

        A life of this same instance still marked running is one the agent died in: it counts as a failure,
        so that a systemd restart loop trips the crash-loop guard. A life of another instance still marked
        running is one whose instance died without a word (killed mid-sync, no notice): it is closed as
        interrupted, billed up to its last heartbeat. With `stale_after_seconds` only those whose heartbeat
        is older are closed: in a multi-node job the other nodes' lives run beside this one, and in a
        single-node job the lease's holder (and a warm standby) still beat while a replacement boots.
        Without it (None) every other instance's running life is taken for dead, as before leases.
        """
        for earlier in self.data["lives"]:
            if earlier["outcome"] != LifeOutcome.RUNNING:
                continue
            beating = earlier.get("heartbeat_at") or earlier["started_at"]
            if (
                stale_after_seconds is not None
                and earlier["instance_id"] != identity.instance_id
                and (now - _parse(beating)).total_seconds() < stale_after_seconds
            ):
                continue
            if earlier["instance_id"] == identity.instance_id:
                earlier["outcome"] = LifeOutcome.FAILED.value
                earlier["ended_at"] = earlier.get("heartbeat_at") or iso(now)
                self.data["consecutive_failures"] += 1
                self._price_life(earlier, earlier["ended_at"])
                self._close_standby(earlier, earlier["ended_at"])
            else:
                self._close_vanished(earlier, identity.instance_id)
        if self.status in TERMINAL_STATUSES and not restart:
            # The job ended while this instance bound it (it was running then): never a second run of it.
            raise JobEndedError(
                f"job {self.data.get('job_id', '?')} ended ({self.status}) before this life began"
            )
        if self.status in TERMINAL_STATUSES:
            # Someone scaled the group up again after the job ended: a new run with a fresh crash counter.
            if self.status == JobStatus.FAILED:
                self.data["consecutive_failures"] = 0
            self.data["status"] = JobStatus.RUNNING.value
        elif self.status == JobStatus.QUEUED:
            # A job that yielded to a `--now` job runs again.
            self.data["status"] = JobStatus.RUNNING.value
        life = Life.opened(
            instance_id=identity.instance_id,
            instance_type=identity.instance_type,
            az=identity.az,
            lifecycle=identity.lifecycle,
            started_at=iso(now),
            price_usd_per_hour=price if isinstance(price, int | float) else None,
        ).to_json()
        self.data["lives"].append(life)
        self._current = life
        self.update_cost(now, price if isinstance(price, LifeQuote) else None)
        return str(life["life_id"])

    def _close_vanished(self, life: dict[str, Any], closed_by: str) -> None:
        """Another instance's life whose instance died without a word: interrupted at its last heartbeat."""
        life["outcome"] = LifeOutcome.INTERRUPTED.value
        life["ended_at"] = life.get("heartbeat_at") or life["started_at"]
        life["closed_by"] = closed_by
        self.data["interruptions"] += 1
        self._price_life(life, life["ended_at"])
        self._close_standby(life, life["ended_at"])

    def close_silent_node(self, instance_id: str, closed_by: str) -> bool:
        """Another node of a multi-node job stopped beating in the rendezvous (bootstrap/generations.py): its
        running life is closed as interrupted at its last heartbeat, by the survivor that saw it; True when
        one was. If it was only frozen and speaks again, its own end replaces this one (counted once)."""
        closed = False
        for life in self.data["lives"]:
            if life["instance_id"] == instance_id and life["outcome"] == LifeOutcome.RUNNING:
                self._close_vanished(life, closed_by)
                closed = True
        return closed

    def close_silent_lives(self, now: datetime, silent_after_seconds: float, closed_by: str) -> list[str]:
        """When a multi-node job completes: every other instance's life still running whose heartbeat is
        older than `silent_after_seconds` is closed as interrupted at that heartbeat (a live node's follower
        beats every poll and ends its own life). Returns their instance ids."""
        closed = []
        for life in self.data["lives"]:
            if life["outcome"] != LifeOutcome.RUNNING or life["instance_id"] == closed_by:
                continue
            beating = life.get("heartbeat_at") or life["started_at"]
            if (now - _parse(beating)).total_seconds() >= silent_after_seconds:
                self._close_vanished(life, closed_by)
                closed.append(str(life["instance_id"]))
        return closed

    def close_dead_holder(self, life_id: str, closed_by: str) -> bool:
        """The lease's holder whose lease expired (it never released it): its instance is gone. Its life,
        if still running, is closed as interrupted at its last heartbeat; True when it was."""
        for life in self.data["lives"]:
            if life.get("life_id") == life_id and life["outcome"] == LifeOutcome.RUNNING:
                self._close_vanished(life, closed_by)
                return True
        return False

    @staticmethod
    def _price_life(life: dict[str, Any], end: str, quote: LifeQuote | None = None) -> None:
        """Bring the life's cost up to `end`: storage and instance accrue at their hourly prices since
        `priced_at`; a quote then replaces the instance cost with the meter's exact figure (a spot life's
        integral over its price history) and sets the prices from here on."""
        if "priced_at" not in life:
            # A life written before per-option pricing: time × its one price, as it was billed then.
            if life.get("price_usd_per_hour") is not None:
                life["cost_usd"] = round(
                    _hours(life["started_at"], end) * float(life["price_usd_per_hour"]), 6
                )
            return
        hours = _hours(life["priced_at"], end)
        if life.get("price_usd_per_hour") is not None:
            life["instance_cost_usd"] = float(life["instance_cost_usd"]) + hours * float(
                life["price_usd_per_hour"]
            )
        life["storage_cost_usd"] = float(life["storage_cost_usd"]) + hours * float(
            life["storage_usd_per_hour"]
        )
        life["priced_at"] = max(end, life["priced_at"])
        if quote is not None:
            if quote.price_usd_per_hour is not None:
                life["price_usd_per_hour"] = quote.price_usd_per_hour
                life["price_source"] = quote.price_source
            if quote.instance_cost_usd is not None:
                life["instance_cost_usd"] = quote.instance_cost_usd
            life["storage_usd_per_hour"] = quote.storage_usd_per_hour
            if quote.price_note:
                life["price_note"] = quote.price_note
            else:
                life.pop("price_note", None)
        life["instance_cost_usd"] = round(float(life["instance_cost_usd"]), 9)
        life["storage_cost_usd"] = round(float(life["storage_cost_usd"]), 9)
        life["cost_usd"] = round(life["instance_cost_usd"] + life["storage_cost_usd"], 6)

    def update_cost(self, now: datetime, quote: LifeQuote | None = None) -> float:
        """Heartbeat: this life's cost so far (instance + storage, at the quote's prices when there is one)
        and the job's total, which it returns (the figure the cost cap acts on)."""
        life = self._current
        if life is not None and life["outcome"] == LifeOutcome.RUNNING:
            life["heartbeat_at"] = iso(now)
            self._price_life(life, iso(now), quote)
        self.data["total_cost_usd"] = round(
            sum(float(x.get("cost_usd") or 0.0) for x in self.data["lives"]), 6
        )
        self._standby_totals()
        self.data["updated_at"] = iso(now)
        return self.total_cost_usd

    # -- warm standby -------------------------------------------------------------------------------

    def mark_standby(self, now: datetime) -> None:
        """This life starts waiting as the job's warm standby (it holds no lease and does not train).

        Its cost is brought up to `now` and remembered, so that what the wait cost is the life's own cost
        accrued between here and `end_standby`, at whatever prices the heartbeats quote meanwhile.
        """
        life = self._current
        if life is None:
            raise RuntimeError("mark_standby() before begin_life()")
        if life["outcome"] != LifeOutcome.RUNNING or "standby_since" in life:
            return  # already waiting (or ended): the first mark counts
        self.update_cost(now)
        life["standby_since"] = iso(now)
        life["standby_cost_from_usd"] = float(life.get("cost_usd") or 0.0)
        self._standby_totals()

    def end_standby(self, now: datetime) -> None:
        """This life stops waiting (it took the lease, or leaves): its standby seconds and cost are final."""
        life = self._current
        if life is None:
            raise RuntimeError("end_standby() before begin_life()")
        if life["outcome"] == LifeOutcome.RUNNING:
            self.update_cost(now)
        self._close_standby(life, iso(now))
        self._standby_totals()

    @staticmethod
    def _close_standby(life: dict[str, Any], end: str) -> None:
        """Settle an open standby wait at `end` (the life's cost must already be brought up to `end`)."""
        if "standby_cost_from_usd" not in life:
            return
        start = float(life.pop("standby_cost_from_usd"))
        seconds = max(0.0, (_parse(end) - _parse(life["standby_since"])).total_seconds())
        life["standby_seconds"] = round(float(life.get("standby_seconds") or 0.0) + seconds, 3)
        cost = max(0.0, float(life.get("cost_usd") or 0.0) - start)
        life["standby_cost_usd"] = round(float(life.get("standby_cost_usd") or 0.0) + cost, 6)

    def _standby_totals(self) -> None:
        """The ledger's sums, derived from the lives (a re-applied change never counts twice): standby cost
        (a wait still open counts what it cost so far) and hand-overs."""
        total = 0.0
        for life in self.data["lives"]:
            total += float(life.get("standby_cost_usd") or 0.0)
            if "standby_cost_from_usd" in life:
                total += max(0.0, float(life.get("cost_usd") or 0.0) - float(life["standby_cost_from_usd"]))
        self.data["standby_cost_usd"] = round(total, 6)
        self.data["handovers"] = sum(
            1 for x in self.data["lives"] if x.get("outcome") == LifeOutcome.HANDED_OVER
        )

    def end_life(self, outcome: LifeOutcome, now: datetime, **details: Any) -> None:
        """Close this life with its outcome. If a successor already closed it (this instance was thought
        dead), the truthful outcome replaces the guess but the counters are not moved twice."""
        life = self._current
        if life is None:
            raise RuntimeError("end_life() before begin_life()")
        already_closed = life["outcome"] != LifeOutcome.RUNNING
        life["outcome"] = LifeOutcome(outcome).value
        life["ended_at"] = iso(now)
        life.update(details)
        self._price_life(life, life["ended_at"])
        self._close_standby(life, life["ended_at"])
        self.update_cost(now)
        if already_closed:
            return
        if outcome in INTERRUPTED_OUTCOMES:
            self.data["interruptions"] += 1
        if outcome in NEUTRAL_OUTCOMES:
            return
        if outcome in FAILED_OUTCOMES:
            # One crash of a multi-node generation fails every node's life: the job failed once.
            generation = life.get("generation")
            seen = generation is not None and any(
                x is not life and x.get("generation") == generation and x["outcome"] in FAILED_OUTCOMES
                for x in self.data["lives"]
            )
            if not seen:
                self.data["consecutive_failures"] += 1
        else:
            self.data["consecutive_failures"] = 0

    def record_throughput(self, progress: Progress | None) -> bool:
        """Fold the trainer's latest report into this life: its measured samples/s (a running mean over its
        reports; a report seen at an earlier heartbeat counts once), with its precision and model, its mean
        data wait (counted the same way) and its time to first step (once). True when the life took any of
        it. Only a running life measures: an ended one's figures are final."""
        life = self._current
        if life is None or life["outcome"] != LifeOutcome.RUNNING or progress is None:
            return False
        first_step = self._record_first_step(life, progress)
        data_wait = self._record_data_wait(life, progress)
        return self._record_speed(life, progress) or data_wait or first_step

    @staticmethod
    def _record_speed(life: dict[str, Any], progress: Progress) -> bool:
        speed = progress.samples_per_s
        if speed is None or speed <= 0:
            return False
        keys = ("samples_per_second", "throughput_reports", "throughput_step")
        if not _fold_mean(life, keys, speed, progress):
            return False
        if progress.precision:
            life["precision"] = progress.precision
        if progress.model:
            life["model_family"] = progress.model
        return True

    @staticmethod
    def _record_data_wait(life: dict[str, Any], progress: Progress) -> bool:
        """The life's mean share of step time spent waiting on the loader, over its reports: its own step
        marker, since a report with no speed (a stall: 0 samples/s) still says how long it waited."""
        wait = progress.data_wait_fraction
        # A share outside 0..1 is not one (a user's job reporting a percentage): no measurement.
        if wait is None or not 0.0 <= wait <= 1.0:
            return False
        return _fold_mean(life, ("data_wait_fraction", "data_wait_reports", "data_wait_step"), wait, progress)

    @staticmethod
    def _record_first_step(life: dict[str, Any], progress: Progress) -> bool:
        """Seconds from the life's start to its trainer's first step, kept once: a trainer restarted within
        the life (a multi-node regroup) reports a later first step of its own, but the life's came first.
        A warm standby's life counts from its hand-over (the end of its standby wait): what it promises is a
        fast first step once it holds the job; its boot and its wait were not the job waiting for it."""
        if life.get("first_step_seconds") is not None or progress.first_step_at is None:
            return False
        waited = life.get("standby_seconds")
        try:
            began = _parse(life["started_at"])
            if "standby_since" in life and isinstance(waited, (int, float)) and not isinstance(waited, bool):
                began = _parse(life["standby_since"]) + timedelta(seconds=float(waited))
            seconds = (_parse(progress.first_step_at) - began).total_seconds()
        except (TypeError, ValueError):  # not a time (a user's job wrote something else): no measurement
            return False
        if seconds < 0:
            # A first step before the life began is not this life's: a progress file an earlier trainer left,
            # or a clock stepped back (NTP at boot). Left unknown rather than clamped to a 0 s that never
            # happened; a later report of this life's own trainer can still give it.
            return False
        life["first_step_seconds"] = round(seconds, 3)
        return True

    def set_generation(self, generation: int) -> None:
        """The multi-node generation this life is training in (bootstrap/rendezvous.py)."""
        if self._current is not None:
            self._current["generation"] = generation

    def set_status(self, status: JobStatus, reason: str | None = None) -> None:
        """The job's status; `reason` says in one line why a job ended without a life of its own."""
        self.data["status"] = JobStatus(status).value
        if reason is not None:
            self.data["reason"] = reason

    @property
    def dataset(self) -> dict[str, Any] | None:
        """The dataset version the job trains on (bootstrap/datasync.py): {"name", "version", ...}."""
        return Ledger.from_json(self.data).dataset

    def set_dataset(self, entry: dict[str, Any]) -> None:
        self.data["dataset"] = entry

    def current_life(self) -> dict[str, Any] | None:
        return self._current


class JobEndedError(RuntimeError):
    """The job ended between the binding that chose it and the life that would have begun it."""


class LedgerStore:
    """`state/ledger.json` with optimistic concurrency: read with its ETag, change, write If-Match."""

    def __init__(self, s3: Any, bucket: str, key: str, attempts: int = 10) -> None:
        self._s3 = s3
        self.bucket = bucket
        self.key = key
        self._attempts = attempts
        self.life_id: str | None = None
        # The last copy this process wrote or read: what the agent reports from when S3 is unreachable.
        self.last = JobLedger()
        # Throughput (`measure_throughput`): where the trainer's progress is read, the stack's table, the job.
        self._progress: Callable[[], Progress | None] | None = None
        self._throughput: ThroughputStore | None = None
        self._job_id = ""
        # Why the last merge into the stack's throughput table failed (None: it did not): the table is advice,
        # so a failure never fails the ledger's write; the next life end merges every ended life again.
        self.throughput_error: str | None = None

    def measure_throughput(
        self, progress: Callable[[], Progress | None], table: ThroughputStore, job_id: str
    ) -> None:
        """From now on every update folds the trainer's latest progress into this life first
        (JobLedger.record_throughput), and an update that ends this life merges the job's ended lives into
        the stack's throughput table."""
        self._progress, self._throughput, self._job_id = progress, table, job_id

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    def read(self) -> tuple[dict[str, Any] | None, str | None]:
        try:
            response = self._s3.get_object(Bucket=self.bucket, Key=self.key)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in {"NoSuchKey", "404"}:
                return None, None
            raise
        value = json.loads(response["Body"].read())
        return (value if isinstance(value, dict) else None), str(response["ETag"])

    def load(self) -> JobLedger:
        raw, _ = self.read()
        self.last = JobLedger(raw, self.life_id)
        return self.last

    def update(self, change: Callable[[JobLedger], _T]) -> _T:
        """Apply `change` to the newest ledger and write it back unless someone wrote in between (retry)."""
        progress = self._read_progress()
        for attempt in range(self._attempts):
            raw, etag = self.read()
            ledger = JobLedger(raw, self.life_id)
            current = ledger.current_life()
            was_running = current is not None and current["outcome"] == LifeOutcome.RUNNING
            ledger.record_throughput(progress)
            result = change(ledger)
            try:
                self._s3.put_object(
                    Bucket=self.bucket,
                    Key=self.key,
                    Body=json.dumps(ledger.data, indent=2, default=str).encode(),
                    ContentType="application/json",
                    **write_condition(etag),
                )
            except ClientError as exc:
                if is_conflict(exc):
                    time.sleep(0.05 * (attempt + 1))
                    continue
                raise
            self.last = ledger
            if was_running and current is not None and current["outcome"] != LifeOutcome.RUNNING:
                self._merge_throughput(ledger)
            return result
        raise RuntimeError(f"{self.uri}: {self._attempts} concurrent writers in a row; will retry")

    def _read_progress(self) -> Progress | None:
        if self._progress is None:
            return None
        try:
            return self._progress()
        except Exception:  # progress is the trainer's file: unreadable now is simply no report this time
            return None

    def _merge_throughput(self, ledger: JobLedger) -> None:
        if self._throughput is None:
            return
        lives = [life for life in map(Life.from_json, ledger.lives) if life is not None]
        try:
            self._throughput.merge(self._job_id, lives)
            self.throughput_error = None
        except Exception as exc:
            self.throughput_error = f"{self._throughput.uri}: {type(exc).__name__}: {exc}"

    def begin_life(
        self,
        identity: InstanceIdentity,
        price: LifeQuote | float | None,
        now: datetime,
        stale_after_seconds: float | None = None,
        restart: bool = True,
    ) -> JobLedger:
        """Open this life (JobLedger.begin_life). `restart` False: the life was bound to a job that was
        running, and one that has ended since (its holder completed it a moment ago) raises JobEndedError,
        writing nothing: checked in the same conditional write that opens the life, so no second run of a
        completed job ever starts. True: a job resumed on purpose (`trainstack resume`, the legacy job)."""
        self.life_id = None
        self.life_id = self.update(
            lambda ledger: ledger.begin_life(identity, price, now, stale_after_seconds, restart)
        )
        return self.last
