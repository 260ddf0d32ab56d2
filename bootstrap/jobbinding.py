"""Which job this instance life serves (docs/internals.md, "Jobs, the lease and the standby").

The stack keeps one pointer, `state/current-job.json`, moved only by conditional writes. A life binds to
the job its agent config defines unless another job is still running: then that job goes on, with the code
it started with (bootstrap/pinned.py), so a `pulumi up` mid-job never boots new code onto an old job's
checkpoint. A job that ended makes way for the next definition, which starts at step 0 under its own prefix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from botocore.exceptions import ClientError

from bootstrap.agent_config import AgentConfig
from bootstrap.eventlog import iso
from trainstack_job.contract import LEDGER, JobStatus
from trainstack_job.jobs import CURRENT_JOB, LEGACY_JOB_ID, JobPrefixes

# A job in one of these states is over: the next definition may take the stack.
ENDED = frozenset(
    {JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.STOPPED, JobStatus.COST_CAP, JobStatus.NO_DATA}
)
# The job-record fields that define a job; a pinned life takes them over the stack's agent config.
JOB_FIELDS = ("job_id", "job_name", "resume_from", "job", "user_job", "bundle_key", "bundle_sha256")
_ATTEMPTS = 10


class JobBindingError(RuntimeError):
    """The current job cannot be resolved; the message names the object and the fix."""


@dataclass(frozen=True)
class JobBinding:
    """The job this life serves; `pinned` is that job's record when its code is not this agent's."""

    job_id: str
    prefixes: JobPrefixes
    pinned: dict[str, Any] | None = None
    switched_from: str | None = None


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _missing(exc: ClientError) -> bool:
    return _code(exc) in {"NoSuchKey", "404", "NotFound"}


def _conflict(exc: ClientError) -> bool:
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return _code(exc) in {"PreconditionFailed", "ConditionalRequestConflict"} or status in {409, 412}


class JobDirectory:
    """The stack's jobs in S3: the current-job pointer, each job's record and ledger status."""

    def __init__(self, s3: Any, config: AgentConfig) -> None:
        self._s3 = s3
        self.bucket = config.bucket
        self.pointer_key = config.prefixes.state + CURRENT_JOB

    def _get_json(self, key: str) -> tuple[dict[str, Any] | None, str | None]:
        try:
            response = self._s3.get_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if _missing(exc):
                return None, None
            raise
        try:
            value = json.loads(response["Body"].read())
        except ValueError:
            value = None
        return (value if isinstance(value, dict) else None), str(response["ETag"])

    def current(self) -> tuple[str | None, str | None]:
        """(job id, ETag) of the pointer; (None, None) when the stack has none yet."""
        value, etag = self._get_json(self.pointer_key)
        if etag is not None and (value is None or not isinstance(value.get("job_id"), str)):
            raise JobBindingError(
                f's3://{self.bucket}/{self.pointer_key} is not a job pointer ({{"job_id": ...}}): '
                "delete it and the next life points it at the stack's job"
            )
        return (str(value["job_id"]) if value else None), etag

    def status(self, job_id: str) -> str | None:
        """The job's ledger status; None when the job has no ledger (it never started a life)."""
        value, _ = self._get_json(JobPrefixes.of(job_id).state + LEDGER)
        return str(value.get("status")) if value else None

    def record(self, job_id: str) -> dict[str, Any] | None:
        key = JobPrefixes.of(job_id).record
        return self._get_json(key)[0] if key else None

    def point_at(self, job_id: str, etag: str | None, previous: str | None, now: datetime) -> bool:
        """Move the pointer to `job_id` unless someone moved it since `etag` was read (then False)."""
        body = json.dumps({"job_id": job_id, "since": iso(now), "previous": previous}).encode()
        condition = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}
        try:
            self._s3.put_object(
                Bucket=self.bucket,
                Key=self.pointer_key,
                Body=body,
                ContentType="application/json",
                **condition,
            )
        except ClientError as exc:
            if _conflict(exc):
                return False
            raise
        return True

    def write_record(self, config: AgentConfig, now: datetime) -> bool:
        """The job's record, written once by its first life: what the job is and the code it runs."""
        key = JobPrefixes.of(config.job_id).record
        if not key:
            return False
        agent = {name: getattr(config, name) for name in JOB_FIELDS}
        record = {
            "job_id": config.job_id,
            "name": config.job_name or config.job_id,
            "created_at": iso(now),
            "bundle_key": config.bundle_key,
            "bundle_sha256": config.bundle_sha256,
            "resume_from": config.resume_from,
            "agent": agent,
        }
        try:
            self._s3.put_object(
                Bucket=self.bucket,
                Key=key,
                Body=json.dumps(record, indent=2, default=str).encode(),
                ContentType="application/json",
                IfNoneMatch="*",
            )
        except ClientError as exc:
            if _conflict(exc):
                return False  # written by an earlier life: the first record stands
            raise
        return True


def bind_job(s3: Any, config: AgentConfig, now: datetime) -> JobBinding:
    """Resolve the job this life serves, moving the stack's pointer when the config's job may start."""
    jobs = JobDirectory(s3, config)
    mine = config.job_id
    # The record first: a job the pointer names always has one, so a racing life never mistakes a job
    # that is starting for one that is gone.
    if mine != LEGACY_JOB_ID:
        jobs.write_record(config, now)
    for _ in range(_ATTEMPTS):
        current, etag = jobs.current()
        if current is None:
            # A stack from before jobs: its objects are the legacy job's, which goes on until it ends.
            legacy = jobs.status(LEGACY_JOB_ID)
            target = LEGACY_JOB_ID if legacy is not None and legacy not in ENDED else mine
            if jobs.point_at(target, None, None, now):
                return JobBinding(target, JobPrefixes.of(target))
            continue
        if current == mine:
            return JobBinding(mine, JobPrefixes.of(mine))
        status = jobs.status(current)
        record = jobs.record(current) if current != LEGACY_JOB_ID else None
        gone = current != LEGACY_JOB_ID and record is None
        if status in ENDED or gone or (current == LEGACY_JOB_ID and status is None):
            if jobs.point_at(mine, etag, current, now):
                return JobBinding(mine, JobPrefixes.of(mine), switched_from=current)
            continue
        # Another job is running or starting: it goes on with its own code; this definition waits.
        if current == LEGACY_JOB_ID:
            return JobBinding(current, JobPrefixes.of(current))
        assert record is not None
        if not isinstance(record.get("agent"), dict):
            raise JobBindingError(
                f"job {current} is {status or 'starting'} but "
                f"s3://{jobs.bucket}/{JobPrefixes.of(current).record} is unreadable: "
                "stop it with `trainstack stop`, then `trainstack resume` "
                f"starts {mine}"
            )
        return JobBinding(current, JobPrefixes.of(current), pinned=record)
    raise JobBindingError(
        f"s3://{jobs.bucket}/{jobs.pointer_key}: moved by another instance {_ATTEMPTS} times in a row; "
        "the next life tries again"
    )
