"""`trainstack jobs`: every job in the stack's bucket, its status, progress and cost, and which is current."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from rich.table import Table

from trainstack.aws import Clients
from trainstack.output import console, format_duration, format_usd, parse_time, print_json
from trainstack.stack import Stack, StackOutputs
from trainstack.state import current_job_id, job_exists, read_json
from trainstack_job.contract import LEDGER, PROGRESS, StackOutput
from trainstack_job.jobs import JOBS_PREFIX, LEGACY_JOB_ID, JobIdError, JobPrefixes, check_job_id

NOT_STARTED = "not started"


def job_ids(clients: Clients, bucket: str) -> list[str]:
    """The ids with a folder under jobs/ (anything else there is not a job and is left out)."""
    found: list[str] = []
    paginator = clients.s3().get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=bucket, Prefix=JOBS_PREFIX, Delimiter="/"):
        for common in page.get("CommonPrefixes", []):
            name = common["Prefix"][len(JOBS_PREFIX) :].rstrip("/")
            try:
                found.append(check_job_id(name))
            except JobIdError:
                continue
    return found


def _row(clients: Clients, bucket: str, job: JobPrefixes, *, current: str, now: datetime) -> dict[str, Any]:
    record = read_json(clients, bucket, job.record) if job.record else None
    ledger = read_json(clients, bucket, job.state + LEDGER) or {}
    progress = read_json(clients, bucket, job.state + PROGRESS) or {}
    lives = [life for life in ledger.get("lives", []) if isinstance(life, dict)]
    # The record says when the job was defined on an instance; the legacy job has none, its first life does.
    created = (record or {}).get("created_at") or (lives[0].get("started_at") if lives else None)
    moment = parse_time(created)
    cost = ledger.get("total_cost_usd")
    return {
        "job_id": job.job_id,
        "name": (record or {}).get("name") or (job.job_id if job.job_id == LEGACY_JOB_ID else None),
        "status": str(ledger.get("status") or NOT_STARTED),
        "step": progress.get("step"),
        "total_steps": progress.get("total_steps"),
        "cost_usd": float(cost) if isinstance(cost, int | float) else None,
        "created_at": created,
        "age_s": None if moment is None else max(0.0, (now - moment).total_seconds()),
        "resume_from": (record or {}).get("resume_from"),
        "current": job.job_id == current,
    }


def collect(clients: Clients, outputs: StackOutputs, now: datetime | None = None) -> dict[str, Any]:
    """Every job under jobs/, the legacy job if the bucket holds one, and the stack's defined job even
    before an instance has started it."""
    now = now or datetime.now(timezone.utc)
    bucket = outputs.bucket
    ids = job_ids(clients, bucket)
    if job_exists(clients, outputs, JobPrefixes.of(LEGACY_JOB_ID)):
        ids.append(LEGACY_JOB_ID)
    defined = outputs.values.get(StackOutput.JOB_ID.value)
    if defined and defined not in ids:
        ids.append(str(defined))
    current = current_job_id(clients, outputs)
    rows = [_row(clients, bucket, JobPrefixes.of(i), current=current, now=now) for i in ids]
    # Oldest first, so the newest job (usually the current one) is the last line above the prompt.
    rows.sort(key=lambda row: (row["created_at"] is None, str(row["created_at"] or ""), row["job_id"]))
    return {"bucket": bucket, "current": current, "defined": defined, "jobs": rows}


def run(clients: Clients, stack: Stack, *, as_json: bool) -> int:
    report = collect(clients, stack.outputs)
    if as_json:
        print_json(report)
        return 0
    out = console()
    if not report["jobs"]:
        out.print(
            f"no jobs yet in s3://{report['bucket']}/{JOBS_PREFIX}: `pulumi up` defines one", markup=False
        )
        return 0
    table = Table("", "job", "status", "step", "cost", "age")
    for row in report["jobs"]:
        step, total = row["step"], row["total_steps"]
        progress = "-" if step is None else (f"{step}/{total}" if total else str(step))
        table.add_row(
            "*" if row["current"] else "",
            row["job_id"],
            row["status"],
            progress,
            format_usd(row["cost_usd"]),
            format_duration(row["age_s"]),
        )
    out.print(table)
    out.print(f"* current job; the stack defines {report['defined'] or '-'}", markup=False)
    return 0
