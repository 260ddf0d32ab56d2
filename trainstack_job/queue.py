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
from trainstack_job.text import clip

QUEUE_PREFIX = "queue/"
# The code `trainstack run` submits a job with, content-addressed (`job-code/<sha256>/bundle.tar.gz`): only
# ever the job's own code, unpacked by the agent and run as the job's user. The environment's code (the
# agent, under the stack's code prefix) is written by `pulumi up` alone (SECURITY.md, "A submitter").
JOB_CODE_PREFIX = "job-code/"
# Under a job's state/ prefix, written by `trainstack cancel ID`: the job checkpoints, stops, is `cancelled`
# (a queued job is skipped). {"requested_at": ISO, "by": "..."}.
CANCEL_REQUEST = "cancel.json"
# Who submitted a job (the record's `source`).
SOURCE_PULUMI = "pulumi"  # the stack's default job, from trainstack:job / trainingConfig
SOURCE_RUN = "run"  # `trainstack run`
# An entry is three short fields (~100 bytes); the bound keeps a stray upload from being read whole into the
# memory of every agent and CLI that lists the queue.
MAX_ENTRY_BYTES = 64 * 1024


class QueueError(RuntimeError):
    """A queue object that cannot be read as one; the message names the object and the fix."""


def queue_key(job_id: str) -> str:
    return f"{QUEUE_PREFIX}{check_job_id(job_id)}.json"


def cancel_key(job_id: str) -> str:
    return JobPrefixes.of(job_id).state + CANCEL_REQUEST


def queue_entry(
    job_id: str, submitted_at: str, *, now: bool = False, pool: str = "", priority: int = 0
) -> dict[str, Any]:
    """The queue entry's body. `now`: run on a live instance at once, after the running job checkpoints.
    `pool`: the pool whose instances take it ("" = the default pool: left out, as before pools). `priority`:
    higher runs first, FIFO within one (0, the default, left out)."""
    entry: dict[str, Any] = {"job_id": check_job_id(job_id), "submitted_at": submitted_at, "now": now}
    if pool:
        entry["pool"] = pool
    if priority:
        entry["priority"] = priority
    return entry


def job_record(
    *,
    job_id: str,
    name: str,
    agent: Mapping[str, Any],
    submitted_at: str,
    source: str,
    sweep: Mapping[str, Any] | None = None,
    dataset: Mapping[str, Any] | None = None,
    pool: str = "",
    resources: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A job's record: `agent` holds the agent-config fields that define the job (jobbinding.JOB_FIELDS:
    job_id, job_name, resume_from, job, user_job, bundle_key, bundle_sha256, …); the top-level copies are
    what `trainstack jobs` shows without reading `agent`. `pool`, `resources`: the pool it was matched to
    ("" = the default) and what it asked for (trainstack_job/resources.py)."""
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
        "pool": pool,
        "resources": dict(resources) if resources else None,
        "agent": dict(agent),
    }


@dataclass(frozen=True)
class QueueEntry:
    job_id: str
    submitted_at: str
    now: bool = False
    # When S3 stored the entry (its LastModified, UTC ISO); "" when not listed (then submitted_at decides).
    queued_at: str = ""
    # The pool whose instances take it; "" = the default pool (every entry from before pools).
    pool: str = ""
    # Higher runs first; FIFO within one priority.
    priority: int = 0

    @property
    def order(self) -> tuple[bool, int, str, str, str]:
        """`--now` entries first (oldest first), then by priority (higher first), then FIFO by S3's clock."""
        return (not self.now, -self.priority, self.queued_at, self.submitted_at, self.job_id)


def stored_at(item: Mapping[str, Any]) -> str:
    """A listed object's LastModified as UTC ISO text (sortable); "" when the listing has none."""
    moment = item.get("LastModified")
    if not isinstance(moment, datetime):
        return ""
    aware = moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)
    return aware.astimezone(timezone.utc).isoformat()


def _shown(key: str) -> str:
    """The key as the user can paste it into `aws s3 rm`; quoted when it holds a character (a newline) that
    would break the one-line message. S3 bounds keys to 1,024 bytes, so it is never cut."""
    return key if key.isprintable() else repr(key)


def _refused(key: str, why: str) -> QueueError:
    return QueueError(
        f"{_shown(key)} is not a queue entry ({{'job_id', 'submitted_at', 'now'}}): {why}; delete it "
        "(`trainstack cancel` never needs it) and submit the job again with `trainstack run`"
    )


def _too_big(key: str, size: int | None = None) -> QueueError:
    held = f"{size} bytes, " if size is not None else ""
    return _refused(key, f"{held}more than the {MAX_ENTRY_BYTES} bytes a queue entry may hold")


def _described(value: Any) -> str:
    """What a JSON value is, with the value itself (clipped) when it is a string or a number: a list or an
    object is not echoed, as its repr would recurse as deep as the JSON did."""
    kind = _kind(value)
    return f"{kind} ({clip(value)})" if isinstance(value, str | int | float) else kind


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    names = {dict: "an object", list: "a list", str: "a string", type(None): "null"}
    return names.get(type(value), type(value).__name__)


# An entry's fields and their JSON types; `now` may be left out (False).
_FIELDS: tuple[tuple[str, type, bool], ...] = (
    ("job_id", str, True),
    ("submitted_at", str, True),
    ("now", bool, False),
    ("pool", str, False),
    ("priority", int, False),
)


def parse_entry(key: str, body: bytes, queued_at: str = "") -> QueueEntry:
    """One queue object; a body that is not an entry raises QueueError, one line naming the key and the fix
    (never KeyError, TypeError, RecursionError or UnicodeDecodeError: the agent and `trainstack jobs` catch
    QueueError alone, and any other error would stop them at someone's stray upload)."""
    if len(body) > MAX_ENTRY_BYTES:
        raise _too_big(key)
    try:
        text = body.decode("utf-8")  # what submitters write; json.loads(bytes) would also take UTF-16/32
    except UnicodeDecodeError as exc:
        raise _refused(key, f"not UTF-8 (byte {exc.start}: {exc.reason})") from None
    try:
        value = json.loads(text)
    except RecursionError:
        raise _refused(key, "JSON nested too deep to read") from None
    except ValueError as exc:
        raise _refused(key, f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise _refused(key, f"{_described(value)}, not an object")
    for field, kind, required in _FIELDS:
        if field not in value:
            if required:
                raise _refused(key, f"no {field!r}")
            continue
        if not isinstance(value[field], kind):
            raise _refused(key, f"{field!r} is {_described(value[field])}, not {_kind(kind())}")
    try:
        job_id = check_job_id(value["job_id"])
    except JobIdError:
        # check_job_id's own wording points at `trainstack jobs`, no help for an object to delete.
        why = f"'job_id' is {clip(value['job_id'])}, not a job id (lowercase letters, digits and dashes)"
        raise _refused(key, why) from None
    if key != queue_key(job_id):
        raise _refused(key, f"it names job {job_id}, whose entry's key is {queue_key(job_id)}")
    now, pool, priority = value.get("now", False), value.get("pool", ""), value.get("priority", 0)
    if isinstance(priority, bool):
        raise _refused(key, f"'priority' is {_described(priority)}, not a number")
    return QueueEntry(job_id, value["submitted_at"], now, queued_at, pool, priority)


@dataclass(frozen=True)
class QueueScan:
    """The queue as read: its entries in queue order, and the objects under queue/ that are not entries
    (key, why) in key order, for a caller that lists what it can and names the rest."""

    entries: list[QueueEntry]
    bad: list[tuple[str, QueueError]]


def scan_queue(s3: Any, bucket: str) -> QueueScan:
    """Every queue object (a boto3 S3 client): the entries, and each object that is not one with its
    QueueError; one bad object stops nothing."""
    entries: list[QueueEntry] = []
    bad: list[tuple[str, QueueError]] = []
    paginator = s3.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=bucket, Prefix=QUEUE_PREFIX):
        for item in page.get("Contents", []):
            key = str(item["Key"])
            if not key.endswith(".json"):
                continue
            size = item.get("Size")
            if isinstance(size, int) and size > MAX_ENTRY_BYTES:
                bad.append((key, _too_big(key, size)))
                continue
            # Bounded even when the listing has no size (or the object grew since): one byte over is enough
            # for parse_entry to refuse it.
            body = s3.get_object(Bucket=bucket, Key=key)["Body"].read(MAX_ENTRY_BYTES + 1)
            try:
                entries.append(parse_entry(key, body, stored_at(item)))
            except QueueError as error:
                bad.append((key, error))
    entries.sort(key=lambda entry: entry.order)
    return QueueScan(entries, bad)


def list_entries(s3: Any, bucket: str) -> list[QueueEntry]:
    """Every queue entry in queue order (a boto3 S3 client); QueueError for the first object (by key) that
    is not one. scan_queue reads past it."""
    scan = scan_queue(s3, bucket)
    if scan.bad:
        raise scan.bad[0][1]
    return scan.entries
