"""The stack's run slots: at most `trainstack:maxConcurrentJobs` jobs run at once, across every pool.

An instance takes a slot for a job before it starts it (before its lane's claim and its pointer's move).
Slot k is `state/slots/slot-<k>.json`, written only conditionally: created once (If-None-Match), or replaced
against the ETag read when it is free. So two jobs never hold one slot, and no more than the limit start,
whichever pools and instances race. Nothing has to release a slot, so a crash leaks none:
- a slot is free again once its job has ended (its ledger says so);
- a slot whose job never started within the staleness window is free too (the instance that took it died
  before the job's first life).

Stdlib only: the agent, the scheduler function and the CLI read the slots through this module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from trainstack_job.records import ENDED_STATUSES, RunSlot, S3Record

SLOTS_FOLDER = "slots/"
# A job's ledger status before its first life: it holds its slot only within the staleness window.
NOT_STARTED = (None, "queued")
# Conditional writes lost in a row before `take` says "no room now" (the next look tries again).
_ATTEMPTS = 5


def slot_key(state_prefix: str, index: int) -> str:
    """Slot `index`'s object under the stack's state prefix."""
    return f"{state_prefix}{SLOTS_FOLDER}slot-{index}.json"


def _iso(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _age_seconds(since: str | None, now: datetime) -> float | None:
    try:
        moment = datetime.fromisoformat(str(since).replace("Z", "+00:00"))
    except ValueError:
        return None
    if moment.tzinfo is None:
        return None
    return (now - moment).total_seconds()


@dataclass
class Slots:
    """The stack's `limit` run slots. `status_of(job_id)`: the job's ledger status, None without a ledger."""

    s3: Any
    bucket: str
    state_prefix: str
    limit: int
    status_of: Callable[[str], str | None]
    stale_seconds: float = 60.0

    def _records(self) -> list[S3Record]:
        return [S3Record(self.s3, self.bucket, slot_key(self.state_prefix, k)) for k in range(self.limit)]

    def _read(self) -> list[tuple[S3Record, RunSlot | None, str | None]]:
        """Every slot with its ETag. A job named by two slots (two instances took one for it at once) holds
        only the first: the second reads as free."""
        found: list[tuple[S3Record, RunSlot | None, str | None]] = []
        named: set[str] = set()
        for record in self._records():
            value, etag = record.get()
            slot = RunSlot.from_json(value)
            if slot is not None and slot.job_id in named:
                slot = None
            elif slot is not None:
                named.add(slot.job_id)
            found.append((record, slot, etag))
        return found

    def _holds(self, slot: RunSlot | None, now: datetime) -> bool:
        """Whether the slot's job holds it now: it has not ended, and it started or was given it lately."""
        if slot is None:
            return False
        status = self.status_of(slot.job_id)
        if status in ENDED_STATUSES:
            return False
        if status in NOT_STARTED:
            age = _age_seconds(slot.since, now)
            return age is not None and age < self.stale_seconds
        return True

    def running(self, now: datetime) -> list[str]:
        """The jobs that hold a slot now, in slot order (what `trainstack jobs` and the scheduler count)."""
        return [slot.job_id for _, slot, _ in self._read() if slot is not None and self._holds(slot, now)]

    def room_for(self, job_id: str, now: datetime) -> bool:
        """Whether the job could start now, writing nothing: it holds a slot, or one is free."""
        return any(
            (slot is not None and slot.job_id == job_id) or not self._holds(slot, now)
            for _, slot, _ in self._read()
        )

    def take(self, job_id: str, now: datetime) -> int | None:
        """The slot this job holds, taking a free one (or renewing its own, when it has not started yet);
        None when every slot holds another job that runs (the job waits: the limit is reached)."""
        mine = RunSlot(job_id, _iso(now)).to_json()
        for _ in range(_ATTEMPTS):
            found = self._read()
            lost = False
            for index, (record, slot, etag) in enumerate(found):
                if slot is not None and slot.job_id == job_id:
                    if self.status_of(job_id) not in NOT_STARTED:
                        return index
                    # Not started yet: its `since` is renewed, so the window counts from this start.
                    if record.put(mine, etag):
                        return index
                    lost = True
                    break
            if lost:
                continue
            for index, (record, slot, etag) in enumerate(found):
                if self._holds(slot, now):
                    continue
                if record.put(mine, etag):
                    return index
                lost = True  # another instance took this one a moment ago: try the next
            if not lost:
                return None
        return None
