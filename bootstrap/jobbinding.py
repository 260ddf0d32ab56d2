"""Which job this instance life serves: the stack's current job while it runs, else the head of the queue
(docs/internals.md, "Jobs, the lease and the standby" and "The job queue").

The stack keeps one pointer, `state/current-job.json`, moved only by conditional writes, so racing lives
agree on one job. A life serves the current job while it runs, with the code it started with (bootstrap/
pinned.py), so a `pulumi up` or a `trainstack run` mid-job never boots new code onto an old job's
checkpoint. Once it ended, the oldest queued job (trainstack_job/queue.py) that has not ended and was not
cancelled becomes current and runs from its record. An agent config that still defines a job submits it to
the queue first, exactly once.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from enum import Enum
from functools import partial
from pathlib import Path
from typing import Any

from botocore.exceptions import ClientError

from bootstrap.agent_config import AgentConfig, AgentConfigError
from bootstrap.eventlog import EventLog, iso
from bootstrap.lease import DRIFT_SECONDS
from bootstrap.ledger import JobLedger, LedgerStore
from bootstrap.safefiles import remove_entry
from trainstack_job.contract import CONTROL, LEDGER, JobStatus
from trainstack_job.jobs import (
    LANE_CLAIM,
    LEASE,
    LEGACY_JOB_ID,
    STANDBY,
    JobIdError,
    JobPrefixes,
    check_job_id,
    pointer_name,
)
from trainstack_job.queue import (
    JOB_CODE_PREFIX,
    QUEUE_PREFIX,
    SOURCE_PULUMI,
    QueueEntry,
    QueueError,
    cancel_key,
    job_record,
    parse_entry,
    queue_entry,
    queue_key,
    stored_at,
)
from trainstack_job.records import (
    ENDED_STATUSES,
    RESUMABLE_STATUSES,
    JobPointer,
    LeaseState,
    StandbyState,
    is_conflict,
    is_missing,
    write_condition,
)
from trainstack_job.slots import Slots
from trainstack_job.text import clip

# The job-record fields that define a job; a job's life takes them over the stack's agent config.
JOB_FIELDS = (
    "job_id",
    "job_name",
    "resume_from",
    "job",
    "user_job",
    "bundle_key",
    "bundle_sha256",
    "dataset",
    "dataset_version",
    "allow_data_change",
)
# What a job's fields are when its record leaves them out (never the previous job's).
_FIELD_DEFAULTS: dict[str, Any] = {
    "job_name": "",
    "resume_from": None,
    "job": {},
    "user_job": None,
    "bundle_key": "",
    "bundle_sha256": "",
    "dataset": "",
    "dataset_version": "",
    "allow_data_change": False,
}
# Stack settings a record may set for its own job (`trainstack run`): its cost cap and instance count.
OVERRIDE_FIELDS = ("max_cost_usd", "instance_count")
_ATTEMPTS = 10
# The most a job record, ledger or the pointer may weigh before the agent refuses to read it.
MAX_OBJECT_BYTES = 1024 * 1024
# In the instance's scratch folder: the job whose checkpoints/, output/ and control/ files are there.
SCRATCH_OWNER = ".trainstack-job"
# What a job leaves on the instance's scratch disk besides the dataset (bootstrap/trainer.py TrainerPaths):
# its checkpoints, results and signal files, and what its user wrote to run at all: its home (`home/`:
# pip.conf, ~/.cache, ~/.local's site-packages), its venvs and pip's cache and HOME while it installs
# (`python/`, bootstrap/job.py prepare_python), and its credentials off an instance (`job-credentials/`).
# The next job runs as the same user: any of these kept would be read, or run, as that job's own.
_JOB_LOCAL = (
    "checkpoints",
    "output",
    "control",
    "job.yaml",
    "home",
    "python",
    "job-credentials",
    "shard-cache",
)


class JobBindingError(RuntimeError):
    """The current job cannot be resolved; the message names the object and the fix."""


class Staffing(str, Enum):
    """What a running job of a lane still needs from an instance that is looking for work."""

    HOLDER = "holder"  # nobody holds its lease: the next instance trains it
    STANDBY = "standby"  # held, without a live standby
    FULL = "full"  # held, with its standby


@dataclass(frozen=True)
class JobBinding:
    """The job this life serves; `pinned` is that job's record when its code is another environment's (an
    earlier `pulumi up`: the agent re-executes from it), `job_code` its record when it was submitted with its
    own code (`trainstack run`: this agent runs it, unpacked, as the job's user), `config` the agent config
    it runs with (the stack's with the job's record over it)."""

    job_id: str
    prefixes: JobPrefixes
    pinned: dict[str, Any] | None = None
    switched_from: str | None = None
    config: AgentConfig | None = None
    job_code: dict[str, Any] | None = None
    # The pool's lane whose pointer names the job (0 in a pool that runs one job at a time).
    lane: int = 0
    # The job had ended and is served again on purpose (`trainstack resume`, the legacy job): its ledger may
    # be restarted. False: it ran (or waited) when bound, and must not be run again if it ends meanwhile.
    resuming: bool = False


def _is_job_id(value: str) -> bool:
    try:
        check_job_id(value)
    except JobIdError:
        return value == LEGACY_JOB_ID
    return True


def record_fields(config: AgentConfig, record: dict[str, Any]) -> dict[str, Any]:
    """The agent config as a mapping with the job's record over it: every job field from the record (its
    default where the record has none) and the stack settings the record overrides."""
    merged = asdict(config)
    agent = record.get("agent") if isinstance(record.get("agent"), dict) else {}
    assert isinstance(agent, dict)
    for name in JOB_FIELDS:
        merged[name] = agent.get(name, _FIELD_DEFAULTS.get(name, merged[name]))
    for name in OVERRIDE_FIELDS:
        if agent.get(name) is not None:
            merged[name] = agent[name]
    # "" (no parent job) and null mean the same in a record; the agent config only knows null.
    merged["resume_from"] = merged["resume_from"] or None
    return merged


def same_code(config: AgentConfig, record: dict[str, Any]) -> bool:
    """Whether the record's code bundle is the one this agent runs (then the job runs in this process)."""
    key, sha = str(record.get("bundle_key") or ""), str(record.get("bundle_sha256") or "")
    if not key and not sha:
        return True  # a record that names no bundle runs with whatever code the agent has
    if sha and config.bundle_sha256:
        return sha == config.bundle_sha256
    return (key, sha) == (config.bundle_key, config.bundle_sha256)


class JobDirectory:
    """The stack's jobs in S3: the current-job pointer, the queue, each job's record and ledger status.

    One per life: queue entries are written once, so each is read once and kept (by ETag); a job's ended
    status is kept too. Problems with one job (a corrupt entry or record, too many instances) are one
    logged line and never block the others."""

    def __init__(
        self,
        s3: Any,
        config: AgentConfig,
        log: EventLog | None = None,
        *,
        group_max: int | None = None,
        reported: set[str] | None = None,
        lane: int = 0,
        shared: JobDirectory | None = None,
    ) -> None:
        self._s3 = s3
        self.config = config
        # Which of the pool's lanes this directory moves (a pool running several jobs at once has one pointer
        # per lane; lane 0's is the pool's own, so a pool of one lane is as before lanes).
        self.lane = lane
        # The most instances the stack's group may hold (its MaxSize, what `trainstack run` checks too);
        # unknown: the stack's instance count.
        self.group_max = group_max or config.instance_count
        self.bucket = config.bucket
        # Each pool keeps its own pointer and takes only its own entries (trainstack_job/resources.py).
        self.pointer_key = config.prefixes.state + pointer_name(config.pool, lane)
        self.log = log or EventLog()
        # A pool's lanes share what they read once (`shared`: lane 0's directory): each queue entry and each
        # ended status is read once per decision, not once per lane (bench/scheduling/ measured the cost).
        self._entries: dict[str, tuple[str, QueueEntry | None]] = shared._entries if shared else {}
        # Jobs whose end is final (not resumable): their status never changes again.
        self._ended: dict[str, str] = shared._ended if shared else {}
        # Bad objects already reported, shared by the life's directories: one line per object per life.
        self._reported = reported if reported is not None else set()

    def _report_once(self, what: str, message: str, **fields: Any) -> None:
        if what in self._reported:
            return
        self._reported.add(what)
        self.log.event("queue", message, level="error", **fields)

    # -- objects ------------------------------------------------------------------------------------

    def _get_json(self, key: str) -> tuple[dict[str, Any] | None, str | None]:
        try:
            response = self._s3.get_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if is_missing(exc):
                return None, None
            raise
        etag = str(response["ETag"])
        if int(response.get("ContentLength") or 0) > MAX_OBJECT_BYTES:
            # Read no further: a record or pointer is a few KiB, and a huge one must not cost the memory.
            response["Body"].close()
            self._report_once(
                key,
                f"s3://{self.bucket}/{key} is over {MAX_OBJECT_BYTES} bytes: not read; delete it",
                key=key,
            )
            return None, etag
        try:
            value = json.loads(response["Body"].read())
        except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested deeper than the parser goes
            value = None
        return (value if isinstance(value, dict) else None), etag

    def _put_once(self, key: str, value: dict[str, Any]) -> bool:
        """Write `key` unless it exists (If-None-Match); False when it did."""
        try:
            self._s3.put_object(
                Bucket=self.bucket,
                Key=key,
                Body=json.dumps(value, indent=2, default=str).encode(),
                ContentType="application/json",
                IfNoneMatch="*",
            )
        except ClientError as exc:
            if is_conflict(exc):
                return False
            raise
        return True

    def current(self) -> tuple[str | None, str | None]:
        """(job id, ETag) of the pointer; (None, None) when the stack has none yet."""
        value, etag = self._get_json(self.pointer_key)
        pointer = JobPointer.from_json(value)
        job_id = pointer.job_id if pointer is not None else None
        if etag is not None and (job_id is None or not _is_job_id(job_id)):
            # Replaced by the next conditional move against this ETag: a damaged pointer must not stop the
            # stack (its queue still says what runs next).
            self._report_once(
                self.pointer_key,
                f's3://{self.bucket}/{self.pointer_key} is not a job pointer ({{"job_id": ...}}): '
                "pointing it at the oldest queued job",
            )
            return None, etag
        return job_id, etag

    def status(self, job_id: str) -> str | None:
        """The job's ledger status; None when the job has no ledger (it never started a life)."""
        if job_id in self._ended:
            return self._ended[job_id]
        value, _ = self._get_json(JobPrefixes.of(job_id).state + LEDGER)
        status = str(value.get("status")) if value else None
        if status is not None and status in ENDED_STATUSES and status not in RESUMABLE_STATUSES:
            self._ended[job_id] = status
        return status

    def record(self, job_id: str) -> dict[str, Any] | None:
        key = JobPrefixes.of(job_id).record
        return self._get_json(key)[0] if key else None

    def cancel_requested(self, job_id: str) -> bool:
        """`trainstack cancel ID` wrote the job's cancel request (its content does not matter)."""
        return self._get_json(cancel_key(job_id))[1] is not None

    def stop_requested(self, job_id: str) -> bool:
        value, _ = self._get_json(JobPrefixes.of(job_id).state + CONTROL)
        return value is not None and value.get("action") == "stop"

    def queued(self, job_id: str) -> bool:
        """The job's queue entry is there (whatever it holds: an unreadable one is the queue's to name)."""
        return self._get_json(queue_key(job_id))[1] is not None

    def point_at(self, job_id: str, etag: str | None, previous: str | None, now: datetime) -> bool:
        """Move the pointer to `job_id` unless someone moved it since `etag` was read (then False)."""
        body = json.dumps(JobPointer(job_id, iso(now), previous).to_json()).encode()
        try:
            self._s3.put_object(
                Bucket=self.bucket,
                Key=self.pointer_key,
                Body=body,
                ContentType="application/json",
                **write_condition(etag),
            )
        except ClientError as exc:
            if is_conflict(exc):
                return False
            raise
        return True

    def submit(self, config: AgentConfig, now: datetime) -> bool:
        """Queue the job an agent config defines (the stack's default job): its record, then its entry, each
        written once, so however many lives boot with this config the job is queued exactly once. True when
        this call queued it.

        A job that already started is never queued again: it was queued once, and an entry gone since was
        taken away on purpose (`pulumi up` deletes a default job's entry when a new definition replaces it).
        The agent re-executed for a job's pinned code defines that job, and must not bring it back: a stopped
        job that is queued again would be resumed instead of the new default job (`serving`)."""
        prefixes = JobPrefixes.of(config.job_id)
        agent = {name: getattr(config, name) for name in JOB_FIELDS}
        record = job_record(
            job_id=config.job_id,
            name=config.job_name or config.job_id,
            agent=agent,
            submitted_at=iso(now),
            source=SOURCE_PULUMI,
        )
        if not self._put_once(prefixes.record, record) and self.status(config.job_id) is not None:
            return False
        return self._put_once(
            queue_key(config.job_id), queue_entry(config.job_id, iso(now), pool=self.config.pool)
        )

    # -- the job's ledger, for jobs that never start a life here ------------------------------------

    def _end_unstarted(self, job_id: str, status: JobStatus, reason: str) -> None:
        """Mark a job that will not run (cancelled before it ran, refused): `trainstack jobs` shows why."""

        def end(ledger: JobLedger) -> None:
            if ledger.status not in ENDED_STATUSES or ledger.status in RESUMABLE_STATUSES:
                ledger.set_status(status, reason)

        store = LedgerStore(self._s3, self.bucket, JobPrefixes.of(job_id).state + LEDGER)
        try:
            store.update(end)
        except ValueError as exc:  # a ledger that is not JSON: this life still skips the job
            self.log.event("queue", f"{store.uri} is not JSON ({exc}); job {job_id} skipped", level="error")
        self._ended[job_id] = status.value

    def refuse(self, job_id: str, reason: str) -> None:
        """A job that cannot run on this stack fails with a one-line reason; the queue moves on."""
        self._report_once(f"job:{job_id}", f"job {job_id} refused: {reason}", job_id=job_id)
        self._end_unstarted(job_id, JobStatus.FAILED, reason)

    # -- the queue ----------------------------------------------------------------------------------

    def entries(self) -> list[QueueEntry]:
        """Every readable queue entry of this instance's pool in queue order (--now first, then FIFO); an
        unreadable one is logged once, naming its key, and left out."""
        found: list[QueueEntry] = []
        paginator = self._s3.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=QUEUE_PREFIX):
            for item in page.get("Contents", []):
                key, etag = str(item["Key"]), str(item.get("ETag", ""))
                if not key.endswith(".json"):
                    continue
                cached = self._entries.get(key)
                if cached is None or cached[0] != etag:
                    there, entry = self._read_entry(key)
                    if not there:
                        continue  # deleted since the listing
                    cached = self._entries[key] = (etag, entry)
                if cached[1] is not None and cached[1].pool == self.config.pool:
                    found.append(replace(cached[1], queued_at=stored_at(item)))
        found.sort(key=lambda entry: entry.order)
        return found

    def _read_entry(self, key: str) -> tuple[bool, QueueEntry | None]:
        """(whether the object is there, the entry or None when it is not one)."""
        try:
            body = self._s3.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except ClientError as exc:
            if is_missing(exc):
                return False, None
            raise
        try:
            return True, parse_entry(key, body)
        except (QueueError, ValueError, RecursionError) as exc:
            self._report_once(key, f"s3://{self.bucket}/{str(exc)[:300]}", key=key[:200])
            return True, None

    def _runnable(self, job_id: str) -> bool:
        """Not ended; a cancel request on a job that is not running (queued, yielded, stopped) marks it
        `cancelled` and skips it."""
        status = self.status(job_id)
        if status in ENDED_STATUSES and status not in RESUMABLE_STATUSES:
            return False
        if self.cancel_requested(job_id):
            self.log.event("queue", f"job {job_id} was cancelled before it ran: skipped", job_id=job_id)
            self._end_unstarted(job_id, JobStatus.CANCELLED, "cancelled while it waited in the queue")
            return False
        return status not in ENDED_STATUSES

    def head(self, held_back: Callable[[dict[str, Any]], bool] | None = None) -> JobBinding | None:
        """The oldest queued job that may run now (--now entries first), checked: its record readable and
        its instance count within the stack's; a job that fails the check is refused and skipped."""
        for entry in self.entries():
            if not self._runnable(entry.job_id):
                continue
            if self.config.lanes > 1 and self.claimed_elsewhere(entry.job_id):
                continue  # another lane of the pool took it (it runs there, or waits there to resume)
            if held_back is not None and held_back(self.record(entry.job_id) or {}):
                continue  # its sweep runs as many points at once as it asked (`--parallel`)
            binding = self.binding(entry.job_id)
            if binding is not None:
                return binding
        return None

    # -- the stack's maxConcurrentJobs (trainstack_job/slots.py) ----------------------------------------

    def room(self, job_id: str, now: datetime, stale_seconds: float, *, take: bool) -> bool:
        """Whether the job may start under the stack's `maxConcurrentJobs` (always, without a limit). With
        `take`, its run slot is taken first (a conditional write); without, only looked at. A job that may
        not start is said once per life: it waits in the queue until a running job ends."""
        limit = self.config.max_concurrent_jobs
        if not limit:
            return True
        slots = Slots(self._s3, self.bucket, self.config.prefixes.state, limit, self.status, stale_seconds)
        allowed = slots.take(job_id, now) is not None if take else slots.room_for(job_id, now)
        if not allowed and f"slots:{job_id}" not in self._reported:
            self._reported.add(f"slots:{job_id}")
            self.log.event(
                "queue",
                f"maxConcurrentJobs {limit} reached: {job_id} waits until a running job ends",
                job_id=job_id,
            )
        return allowed

    # -- lanes: several jobs at once in one pool --------------------------------------------------------

    def _claim_key(self, job_id: str) -> str:
        return JobPrefixes.of(job_id).state + LANE_CLAIM

    def claimed_elsewhere(self, job_id: str) -> bool:
        """Whether another lane of this pool took the job (its claim names another lane)."""
        value, _ = self._get_json(self._claim_key(job_id))
        return value is not None and value.get("lane") != self.lane

    def claim(self, job_id: str, now: datetime) -> bool:
        """Take the job for this lane, once (If-None-Match): False when another lane took it first."""
        body = {"pool": self.config.pool, "lane": self.lane, "since": iso(now)}
        if self._put_once(self._claim_key(job_id), body):
            return True
        return not self.claimed_elsewhere(job_id)

    def staffing(self, job_id: str, now: float, stale_seconds: float) -> Staffing:
        """What a running single-node job still needs: a holder (its lease is free, expired or released),
        a standby (held, and no live standby), or nothing. Read as `take_role` (bootstrap/phases/writer.py)
        will judge it, so an instance goes where it is needed; a race between two lives is still settled by
        the lease itself."""
        state = JobPrefixes.of(job_id).state
        lease = LeaseState.from_record(self._get_json(state + LEASE)[0])
        if lease is None and self._starting(job_id, now, stale_seconds):
            pass  # a lane took it a moment ago: its instance is on its way to the lease
        elif lease is None or not lease.live(now, stale_seconds, DRIFT_SECONDS):
            return Staffing.HOLDER
        standby = StandbyState.from_record(self._get_json(state + STANDBY)[0])
        if standby is None or not standby.live(now, stale_seconds):
            return Staffing.STANDBY
        return Staffing.FULL

    def _starting(self, job_id: str, now: float, stale_seconds: float) -> bool:
        """The job's lane claimed it less than `stale_seconds` ago and nobody took its lease yet."""
        value, _ = self._get_json(self._claim_key(job_id))
        try:
            since = datetime.fromisoformat(str((value or {}).get("since", "")).replace("Z", "+00:00"))
        except ValueError:
            return False
        return now - since.timestamp() < stale_seconds

    def next_job(self) -> str | None:
        """The job the queue gives this instance next (what a job's end asks before scaling to zero)."""
        following = self.head()
        return following.job_id if following is not None else None

    def yield_to(self, running: str) -> str | None:
        """A `--now` job waiting while `running` runs: the running job checkpoints and yields to it."""
        for entry in self.entries():
            if not entry.now:
                return None  # --now entries come first: none is waiting
            if entry.job_id == running or not self._runnable(entry.job_id):
                continue
            if self.binding(entry.job_id) is not None:
                return entry.job_id
        return None

    # -- one job, ready to run ----------------------------------------------------------------------

    def binding(self, job_id: str, switched_from: str | None = None) -> JobBinding | None:
        """How this agent runs `job_id` from its record: here, or with its own pinned code. None (the job
        refused, logged) when its record is missing or unreadable or it asks for more instances than the
        stack's group holds."""
        if job_id == LEGACY_JOB_ID:
            return JobBinding(job_id, JobPrefixes.of(job_id), switched_from=switched_from)
        key = JobPrefixes.of(job_id).record
        record = self.record(job_id)
        if record is None or not isinstance(record.get("agent"), dict):
            self.refuse(
                job_id,
                f"s3://{self.bucket}/{key} is missing or not a job record: submit the job again with "
                "`trainstack run`",
            )
            return None
        try:
            config = AgentConfig.from_mapping(
                record_fields(self.config, record), source=f"s3://{self.bucket}/{key}"
            )
        except AgentConfigError as exc:
            self.refuse(job_id, f"{exc}; submit the job again with `trainstack run`")
            return None
        if config.job_id != job_id:
            self.refuse(job_id, f"s3://{self.bucket}/{key} names job {config.job_id}; submit the job again")
            return None
        if config.instance_count > self.group_max:
            self.refuse(
                job_id,
                f"it asks for {config.instance_count} instances and the group allows at most "
                f"{self.group_max}: submit it with fewer, or raise trainstack:instanceCount and run "
                "pulumi up",
            )
            return None
        bundle = str(record.get("bundle_key") or "")
        if bundle.startswith(JOB_CODE_PREFIX):
            # A submitter's code: never the agent's, never re-executed as root (SECURITY.md, "A submitter").
            return JobBinding(job_id, JobPrefixes.of(job_id), None, switched_from, config, job_code=record)
        pinned = None if same_code(self.config, record) else record
        if pinned is not None and not bundle.startswith(self.config.prefixes.code):
            self.refuse(
                job_id,
                f"s3://{self.bucket}/{key}: its bundle_key {clip(bundle, 120)} is neither the "
                f"environment's code ({self.config.prefixes.code}, written by `pulumi up` only) nor job code "
                f"({JOB_CODE_PREFIX}); the agent runs only the environment's code as root: submit the job "
                "again with `trainstack run`",
            )
            return None
        return JobBinding(job_id, JobPrefixes.of(job_id), pinned, switched_from, config)

    def serving(self, current: str, *, fresh: bool) -> JobBinding | None:
        """The current job, if it goes on: it has not ended, or (`fresh`: a new boot, `trainstack resume`)
        it ended in a resumable way with no stop or cancel request in force and is still queued. None: move
        on to the queue.

        Still queued: a default job whose definition a `pulumi up` replaced has lost its entry
        (infra/defaultjob.py). Resuming it would restore the previous job's checkpoint when the user asked
        for a new job; the new default job starts instead, at step 0 or from its own `resume_from`."""
        status = self.status(current)
        if current == LEGACY_JOB_ID:
            if status is None:
                # No ledger yet: another life of a config from before jobs pointed at it a moment ago and
                # has not begun (two nodes boot together); such a config serves it too. Any other config
                # has nothing to continue there.
                return self.binding(current) if self.config.job_id == LEGACY_JOB_ID else None
            if status not in ENDED_STATUSES or (fresh and self.config.job_id == LEGACY_JOB_ID):
                # A config from before jobs runs the legacy job as it always did (resume included).
                found = self.binding(current)
                return replace(found, resuming=status in ENDED_STATUSES) if found is not None else None
            return None
        if status in ENDED_STATUSES:
            resumed = (
                fresh
                and status in RESUMABLE_STATUSES
                and not self.stop_requested(current)
                and not self.cancel_requested(current)
                and self.queued(current)
            )
            if not resumed:
                return None
        if self.record(current) is None:
            return None  # gone (deleted by hand): the queue moves on
        found = self.binding(current)
        return replace(found, resuming=status in ENDED_STATUSES) if found is not None else None


def claim_scratch(scratch: Path, job_id: str, log: EventLog) -> None:
    """Make this instance's scratch folder `job_id`'s: another job's local checkpoints, results and signal
    files go (they would be restored, and uploaded, as this job's), and so do its home, venvs and pip's
    cache and configuration (the next job's user would read them, or run them, as its own); the synced
    dataset stays. A folder without an owner (an agent from before the queue) is kept as it is."""
    owner_file = scratch / SCRATCH_OWNER
    try:
        owner = owner_file.read_text().strip()
    except OSError:
        owner = ""
    if owner and owner != job_id:
        for name in _JOB_LOCAL:
            # The job owned these folders: a link it left inside is removed, never followed.
            remove_entry(scratch / name)
        log.event(
            "job",
            "scratch cleared of the previous job's local files, home and venvs; the dataset stays",
            previous=owner,
        )
    owner_file.write_text(job_id + "\n")


def bind_job(
    s3: Any,
    config: AgentConfig,
    now: datetime,
    *,
    after: str | None = None,
    log: EventLog | None = None,
    group_max: int | None = None,
    reported: set[str] | None = None,
    stale_seconds: float = 60.0,
) -> JobBinding | None:
    """Resolve the job this life serves, moving the stack's pointer to the queue's head when the current job
    has ended; None when no job runs and none is queued. `after`: the job this instance's previous life
    just ended (or yielded), so that this life goes on to the next one instead of resuming it. A pool that
    runs several jobs at once (`config.lanes` > 1) is resolved by `_bind_lanes`; `stale_seconds` is how long
    a silent lease or standby counts as live there."""
    if config.lanes > 1:
        return _bind_lanes(
            s3,
            config,
            now,
            after=after,
            log=log,
            group_max=group_max,
            reported=reported,
            stale_seconds=stale_seconds,
        )
    jobs = JobDirectory(s3, config, log, group_max=group_max, reported=reported)
    mine = config.job_id
    # The record and entry first: a job the pointer names always has a record, so a racing life never
    # mistakes a job that is starting for one that is gone.
    if mine not in ("", LEGACY_JOB_ID):
        jobs.submit(config, now)
    for _ in range(_ATTEMPTS):
        current, etag = jobs.current()
        if current is None:
            # A stack from before jobs: its objects are the legacy job's, which goes on until it ends.
            legacy = jobs.status(LEGACY_JOB_ID)
            if (legacy is not None and legacy not in ENDED_STATUSES) or (
                mine == LEGACY_JOB_ID and after is None
            ):
                if jobs.point_at(LEGACY_JOB_ID, None, None, now):
                    legacy_binding = jobs.binding(LEGACY_JOB_ID)
                    if legacy_binding is not None and legacy is not None and legacy in ENDED_STATUSES:
                        legacy_binding = replace(legacy_binding, resuming=True)  # a config from before jobs
                    return legacy_binding
                continue
        elif current != after:
            going_on = jobs.serving(current, fresh=after is None)
            if going_on is not None:
                return going_on
        target = jobs.head()
        if target is None:
            return None
        if not jobs.room(target.job_id, now, stale_seconds, take=True):
            return None  # the stack runs maxConcurrentJobs jobs: this pool's next waits for one to end
        if target.job_id == current or jobs.point_at(target.job_id, etag, current, now):
            return replace(target, switched_from=current if current != target.job_id else None)
    raise JobBindingError(
        f"s3://{jobs.bucket}/{jobs.pointer_key}: moved by another instance {_ATTEMPTS} times in a row; "
        "the next life tries again"
    )


def _sweep_of(record: dict[str, Any]) -> tuple[str | None, int | None]:
    """(sweep name, its `parallel`) of a job's record; (None, None) for a job of no sweep."""
    sweep = record.get("sweep")
    if not isinstance(sweep, dict) or not isinstance(sweep.get("name"), str):
        return None, None
    parallel = sweep.get("parallel")
    return sweep["name"], parallel if isinstance(parallel, int) and not isinstance(parallel, bool) else None


def _held_back(running: Counter[str], record: dict[str, Any]) -> bool:
    """Whether a queued job's sweep already runs as many points at once as it asked."""
    name, parallel = _sweep_of(record)
    return bool(name and parallel and running[name] >= parallel)


def work_in_lanes(
    s3: Any,
    config: AgentConfig,
    now: datetime,
    *,
    after: str | None,
    log: EventLog | None = None,
    group_max: int | None = None,
    reported: set[str] | None = None,
    stale_seconds: float = 60.0,
) -> str | None:
    """The job a look for work would give this instance in a pool of several lanes, writing nothing; None:
    nothing here needs it (it leaves the group)."""
    found = _bind_lanes(
        s3,
        config,
        now,
        after=after,
        log=log,
        group_max=group_max,
        reported=reported,
        stale_seconds=stale_seconds,
        look_only=True,
    )
    return found.job_id if found is not None else None


def _bind_lanes(
    s3: Any,
    config: AgentConfig,
    now: datetime,
    *,
    after: str | None,
    log: EventLog | None,
    group_max: int | None,
    reported: set[str] | None,
    stale_seconds: float,
    look_only: bool = False,
) -> JobBinding | None:
    """The job this instance serves in a pool that runs `config.lanes` jobs at once, each lane with its own
    pointer (docs/internals.md, "Several jobs at once in one pool"). In order of need: a running job whose
    lease nobody holds (its holder died: this instance trains it); then a free lane's next queued job, which
    the lane claims (once, If-None-Match) before its pointer moves, so two lanes never start one job; then a
    running job without a live standby. None: nothing here needs this instance, which leaves the group.

    `look_only`: say which job it would be, writing nothing (what a job's end asks before it leaves).
    Single-node jobs only: a pool of several lanes has `maxInstances` 1 (infra/config/)."""
    shared: set[str] = reported if reported is not None else set()
    first = JobDirectory(s3, config, log, group_max=group_max, reported=shared)
    lanes = [first] + [
        JobDirectory(s3, config, log, group_max=group_max, reported=shared, lane=lane, shared=first)
        for lane in range(1, config.lanes)
    ]
    if config.job_id not in ("", LEGACY_JOB_ID) and not look_only:
        lanes[0].submit(config, now)
    clock = now.timestamp()
    for _ in range(_ATTEMPTS):
        running: list[tuple[JobDirectory, JobBinding]] = []
        free: list[tuple[JobDirectory, str | None, str | None]] = []
        for jobs in lanes:
            current, etag = jobs.current()
            going_on = jobs.serving(current, fresh=after is None) if current not in (None, after) else None
            if going_on is not None:
                running.append((jobs, going_on))
            else:
                free.append((jobs, current, etag))
        # A sweep runs at most `parallel` points at once (`trainstack run --sweep ... --parallel K`).
        sweeps = [_sweep_of(jobs.record(binding.job_id) or {}) for jobs, binding in running]
        held_back = partial(_held_back, Counter(name for name, _ in sweeps if name))
        needs = {
            binding.job_id: jobs.staffing(binding.job_id, clock, stale_seconds) for jobs, binding in running
        }
        for jobs, binding in running:
            if needs[binding.job_id] is Staffing.HOLDER:
                return replace(binding, lane=jobs.lane)
        moved = False
        for jobs, current, etag in free:
            target = jobs.head(held_back)
            if target is None:
                continue
            if not jobs.room(target.job_id, now, stale_seconds, take=not look_only):
                break  # the stack runs maxConcurrentJobs jobs: no free lane starts one until one ends
            if look_only:
                return replace(target, lane=jobs.lane)
            if not jobs.claim(target.job_id, now):
                moved = True  # another lane took it a moment ago: look again
                continue
            if target.job_id == current or jobs.point_at(target.job_id, etag, current, now):
                switched = current if current != target.job_id else None
                return replace(target, switched_from=switched, lane=jobs.lane)
            moved = True
        for jobs, binding in running:
            if needs[binding.job_id] is Staffing.STANDBY:
                return replace(binding, lane=jobs.lane)
        if not moved:
            return None
    raise JobBindingError(
        f"s3://{config.bucket}/{config.prefixes.state}: the pool's lanes moved {_ATTEMPTS} times in a row "
        "while this instance looked for work; the next life tries again"
    )
