"""The stack's job queue in S3 (docs/internals.md, "The job queue"); stdlib only, shared by the agent, the CLI
and the Pulumi program so the three can never disagree about a key or a field.

A job is submitted by writing two objects, in this order:
- its record, `jobs/<job-id>/job.json` (trainstack_job/jobs.py JOB_RECORD): what the job is and the code it
  runs, written once (`IfNoneMatch: *`); the agent runs a job from its record alone;
- its queue entry, `queue/<job-id>.json`: that it waits for an instance. FIFO order is the time S3
  stored the entry (its LastModified: the service's clock, not the submitter's, so a laptop whose clock runs
  ahead cannot jump the queue), then `submitted_at` (entries stored within S3's one-second resolution keep
  the order they were submitted in, as a sweep writes them), then the job id; `pulumi up` (the
  stack's default job) and `trainstack run` queue alike.

The entry stays after the job ran: a job's state is read from its own objects (queued = an entry and no
ledger; running, completed, failed… = its ledger's status; cancelled = a cancel request before it ran or its
ledger's `cancelled`). Nothing here deletes; `trainstack jobs --prune` (or a lifecycle rule) may.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from trainstack_job.jobs import JobIdError, JobPrefixes, check_job_id

QUEUE_PREFIX = "queue/"
# Under a job's state/ prefix, written by `trainstack cancel ID`: the job checkpoints, stops, is `cancelled`
# (a queued job is skipped). {"requested_at": ISO, "by": "..."}.
CANCEL_REQUEST = "cancel.json"
# Who submitted a job (the record's `source`).
SOURCE_PULUMI = "pulumi"  # the stack's default job, from trainstack:job / trainingConfig
SOURCE_RUN = "run"  # `trainstack run`


class QueueError(RuntimeError):
    """A queue object that cannot be read as one; the message names the object and the fix."""


def queue_key(job_id: str) -> str:
    return f"{QUEUE_PREFIX}{check_job_id(job_id)}.json"


def cancel_key(job_id: str) -> str:
    return JobPrefixes.of(job_id).state + CANCEL_REQUEST


def queue_entry(job_id: str, submitted_at: str, *, now: bool = False) -> dict[str, Any]:
    """The queue entry's body. `now`: run on a live instance at once, after the running job checkpoints."""
    return {"job_id": check_job_id(job_id), "submitted_at": submitted_at, "now": now}


def job_record(
    *,
    job_id: str,
    name: str,
    agent: Mapping[str, Any],
    submitted_at: str,
    source: str,
    sweep: Mapping[str, Any] | None = None,
    dataset: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A job's record: `agent` holds the agent-config fields that define the job (jobbinding.JOB_FIELDS:
    job_id, job_name, resume_from, job, user_job, bundle_key, bundle_sha256, …); the top-level copies are
    what `trainstack jobs` shows without reading `agent`."""
    check_job_id(job_id)
    return {
        "job_id": job_id,
        "name": name,
        "created_at": submitted_at,
        "submitted_at": submitted_at,
        "source": source,
        "bundle_key": agent.get("bundle_key", ""),
        "bundle_sha256": agent.get("bundle_sha256", ""),
        "resume_from": agent.get("resume_from"),
        "sweep": dict(sweep) if sweep else None,
        "dataset": dict(dataset) if dataset else None,
        "agent": dict(agent),
    }


@dataclass(frozen=True)
class QueueEntry:
    job_id: str
    submitted_at: str
    now: bool = False
    # When S3 stored the entry (its LastModified, UTC ISO); "" when not listed (then submitted_at decides).
    queued_at: str = ""

    @property
    def order(self) -> tuple[bool, str, str, str]:
        """FIFO by S3's clock, except that `--now` entries go first (oldest `--now` first)."""
        return (not self.now, self.queued_at, self.submitted_at, self.job_id)


def stored_at(item: Mapping[str, Any]) -> str:
    """A listed object's LastModified as UTC ISO text (sortable); "" when the listing has none."""
    moment = item.get("LastModified")
    if not isinstance(moment, datetime):
        return ""
    aware = moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)
    return aware.astimezone(timezone.utc).isoformat()


def parse_entry(key: str, body: bytes, queued_at: str = "") -> QueueEntry:
    """One queue object; a body that is not an entry raises QueueError naming the key."""
    try:
        value = json.loads(body)
        job_id = check_job_id(str(value["job_id"]))
        submitted_at = str(value["submitted_at"])
    except (ValueError, KeyError, TypeError, JobIdError) as exc:
        raise QueueError(
            f"{key} is not a queue entry ({{'job_id', 'submitted_at'}}): {exc}; delete it "
            "(`trainstack cancel` never needs it) and submit the job again with `trainstack run`"
        ) from exc
    if key != queue_key(job_id):
        raise QueueError(f"{key} names job {job_id}: a queue entry's key is {queue_key(job_id)}; delete it")
    return QueueEntry(job_id, submitted_at, bool(value.get("now", False)), queued_at)


def list_entries(s3: Any, bucket: str) -> list[QueueEntry]:
    """Every queue entry in queue order (a boto3 S3 client). Entries that cannot be read are skipped only
    by the caller's choice: this raises QueueError for the first one."""
    entries: list[QueueEntry] = []
    paginator = s3.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=bucket, Prefix=QUEUE_PREFIX):
        for item in page.get("Contents", []):
            key = str(item["Key"])
            if not key.endswith(".json"):
                continue
            body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
            entries.append(parse_entry(key, body, stored_at(item)))
    entries.sort(key=lambda entry: entry.order)
    return entries
