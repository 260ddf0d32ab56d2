"""`trainstack jobs`: every job of the stack — queued (with its place), running, ended — with its steps, cost
and age, and which is current; `--sweep NAME` compares a sweep's jobs by their final metric."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from rich.markup import escape
from rich.table import Table

from trainstack.aws import Clients
from trainstack.errors import CliError
from trainstack.output import console, format_duration, format_usd, parse_time, print_error, print_json
from trainstack.stack import Stack, StackOutputs
from trainstack.state import (
    current_job_id,
    free_lanes,
    job_exists,
    read_drought,
    read_group,
    read_json,
    read_ledger,
    read_pointer,
    read_progress,
    running_in_slots,
)
from trainstack.sweep import DEFAULT_METRIC, metric_value, rank
from trainstack_job.contract import JobStatus, StackOutput
from trainstack_job.jobs import (
    JOBS_PREFIX,
    LEGACY_JOB_ID,
    JobIdError,
    JobPrefixes,
    check_job_id,
)
from trainstack_job.launches import Drought
from trainstack_job.queue import CANCEL_REQUEST, QueueEntry, QueueError, list_entries, scan_queue
from trainstack_job.records import ENDED_STATUSES, Ledger
from trainstack_job.text import clip

NOT_STARTED = "not started"
# Also what the CLI calls a job no instance has taken yet: waiting in the queue, or withdrawn from it.
QUEUED = JobStatus.QUEUED.value
CANCELLED = JobStatus.CANCELLED.value
# A job in one of these is over: it will not train again (a queued job withdrawn included).
ENDED = frozenset(status.value for status in ENDED_STATUSES)
METRICS = "metrics.json"


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


def read_queue(clients: Clients, bucket: str) -> list[QueueEntry]:
    """The queue's entries in the order the agent takes them; CliError for the first object under queue/
    that is not an entry (collect and describe read past it with scan_queue)."""
    try:
        return list_entries(clients.s3(), bucket)
    except QueueError as error:
        raise CliError(f"s3://{bucket}: {error}") from None


def job_status(ledger: Ledger | None, cancel: Mapping[str, Any] | None, queued: bool) -> str:
    """What a job is (trainstack_job/queue.py): its ledger's status once an instance took it; before that
    cancelled (a cancel request), queued (an entry), or not started. A job that yielded to a `--now` job is
    `queued` in its ledger: a cancel request withdraws it too."""
    status = ledger.status if ledger is not None else None
    if cancel is not None and status in (None, QUEUED):
        return CANCELLED
    if status:
        return status
    return QUEUED if queued else NOT_STARTED


def _row(
    clients: Clients, bucket: str, job: JobPrefixes, *, current: str, queued: bool, now: datetime
) -> dict[str, Any]:
    record = read_json(clients, bucket, job.record) if job.record else None
    ledger = read_ledger(clients, bucket, job)
    progress = read_progress(clients, bucket, job)
    cancel = read_json(clients, bucket, job.state + CANCEL_REQUEST) if job.record else None
    lives = ledger.lives if ledger is not None else []
    # The record says when the job was submitted; the legacy job has none, its first life does.
    created = (record or {}).get("created_at") or (lives[0].started_at if lives else None)
    moment = parse_time(created)
    sweep = (record or {}).get("sweep")
    return {
        "job_id": job.job_id,
        "name": (record or {}).get("name") or (job.job_id if job.job_id == LEGACY_JOB_ID else None),
        "status": job_status(ledger, cancel, queued),
        "started": ledger is not None,
        "queue_position": None,
        "step": progress.step if progress is not None else None,
        "total_steps": progress.total_steps if progress is not None else None,
        "cost_usd": ledger.total_cost_usd if ledger is not None else None,
        "created_at": created,
        "age_s": None if moment is None else max(0.0, (now - moment).total_seconds()),
        "resume_from": (record or {}).get("resume_from"),
        "sweep": sweep if isinstance(sweep, dict) else None,
        "cancel_requested": cancel is not None,
        "current": job.job_id == current,
        # Why it waits (a queued job in `trainstack jobs`): its pool's lanes busy, its group starting...
        "waiting": None,
    }


def collect(clients: Clients, outputs: StackOutputs, now: datetime | None = None) -> dict[str, Any]:
    """Every job under jobs/ or in the queue, the legacy job if the bucket holds one, and the stack's defined
    job even before an instance has started it. Waiting jobs carry their place in the queue (1 = next)."""
    now = now or datetime.now(timezone.utc)
    bucket = outputs.bucket
    # The agent leaves out an object under queue/ that is not an entry and runs the rest; so does the
    # listing, which names each such object (`bad_entries`) instead of refusing to list anything.
    scan = scan_queue(clients.s3(), bucket)
    entries = scan.entries
    ids = job_ids(clients, bucket)
    ids += [entry.job_id for entry in entries if entry.job_id not in ids]
    if job_exists(clients, outputs, JobPrefixes.of(LEGACY_JOB_ID)):
        ids.append(LEGACY_JOB_ID)
    defined = outputs.values.get(StackOutput.JOB_ID.value)
    if defined and defined not in ids:
        ids.append(str(defined))
    current = current_job_id(clients, outputs)
    in_queue = {entry.job_id for entry in entries}
    rows = {
        i: _row(clients, bucket, JobPrefixes.of(i), current=current, queued=i in in_queue, now=now)
        for i in ids
    }
    for row in rows.values():
        row["pool"] = None
    # Each pool has its own queue: a waiting job's place is in its pool's, with why it waits.
    by_pool: dict[str, list[str]] = {}
    for entry in entries:
        if rows[entry.job_id]["status"] == QUEUED:
            by_pool.setdefault(entry.pool, []).append(entry.job_id)
    running = running_in_slots(clients, outputs, now) if by_pool else None
    for pool, waiting in by_pool.items():
        reasons = WaitingReasons.of(clients, outputs, pool, now, running)
        for position, job_id in enumerate(waiting, start=1):
            rows[job_id] |= {
                "queue_position": position,
                "pool": reasons.name,
                "waiting": reasons.why(position),
            }
    # Oldest first, so the newest job (usually the last queued) is the last line above the prompt.
    ordered = sorted(
        rows.values(),
        key=lambda row: (row["created_at"] is None, str(row["created_at"] or ""), row["job_id"]),
    )
    bad = [{"key": key, "error": f"s3://{bucket}/{error}"} for key, error in scan.bad]
    return {"bucket": bucket, "current": current, "defined": defined, "jobs": ordered, "bad_entries": bad}


@dataclass(frozen=True)
class WaitingReasons:
    """Why the queued jobs of one pool wait: how many of its lanes run a job, and its group's instances."""

    name: str
    lanes: int
    busy: int
    desired: int
    in_service: int
    # Launches failing now (no capacity for the pool's types, a quota): read only while an instance is wanted.
    drought: Drought | None = None
    now: datetime | None = None
    # The stack's maxConcurrentJobs and how many of its run slots hold a job now (None: no limit, or unread).
    limit: int = 0
    running: int | None = None

    @classmethod
    def of(
        cls, clients: Clients, outputs: StackOutputs, pool: str, now: datetime, running: int | None = None
    ) -> WaitingReasons:
        """`pool`: as a queue entry names it ("" = the default pool); `running`: the stack's run slots that
        hold a job (`running_in_slots`, read once for every pool)."""
        pools = outputs.pools
        name = pool or next((n for n, v in pools.items() if v.get("default")), next(iter(pools), "default"))
        info = pools.get(name) or {}
        lanes = int(info.get("max_jobs") or 1)
        if lanes > 1:
            busy = lanes - free_lanes(clients, outputs, pool, lanes)
        else:
            pointer = read_pointer(clients, outputs, pool)
            serving = pointer.job_id if pointer is not None else ""
            ledger = read_ledger(clients, outputs.bucket, JobPrefixes.of(serving)) if serving else None
            busy = int(ledger is not None and not ledger.ended)
        group_name = str(info.get("group_name") or outputs.group_name)
        group = read_group(clients, group_name, lifecycles=False)
        wanting = group.in_service < group.desired
        drought = read_drought(clients, group_name, now) if wanting else None
        limit = outputs.max_concurrent_jobs
        return cls(name, lanes, busy, group.desired, group.in_service, drought, now, limit, running)

    def why(self, position: int) -> str:
        """The reason for the job at `position` (1 = next) in the pool's queue."""
        free = self.lanes - self.busy
        if position > free:
            jobs = "job" if self.lanes == 1 else "jobs at once"
            return f"pool {self.name}: {self.busy} of {self.lanes} {jobs} running"
        if self.limit and self.running is not None and self.running >= self.limit:
            runs = "job runs" if self.running == 1 else "jobs run"
            return f"maxConcurrentJobs {self.limit} reached: {self.running} {runs} across the stack"
        if self.desired == 0:
            return f"pool {self.name}: no instance (the group is at zero; `trainstack resume` wakes it)"
        if self.in_service < self.desired and self.drought is not None and self.now is not None:
            # What Auto Scaling says, so the user can tell a spot drought from a quota or a bad type; the
            # capacity function falls back to on-demand after `spotFallbackMinutes` of this.
            minutes = max(0, round((self.now - self.drought.since).total_seconds() / 60))
            failed = "launch" if self.drought.failed == 1 else "launches"
            return (
                f"pool {self.name}: no instance for {minutes} min ({self.drought.failed} {failed} failed: "
                f"{clip(self.drought.message or 'no reason given', 120)})"
            )
        if self.in_service < self.desired:
            return f"pool {self.name}: an instance is starting ({self.in_service} of {self.desired} up)"
        return f"pool {self.name}: the next free instance takes it"


def describe(
    clients: Clients, outputs: StackOutputs, job_id: str, now: datetime | None = None
) -> dict[str, Any]:
    """One job's row as `trainstack jobs` shows it, its queue position included when it waits (the queue is
    read only then: following a running job costs no listing)."""
    now = now or datetime.now(timezone.utc)
    bucket = outputs.bucket
    job = JobPrefixes.of(job_id)
    row = _row(clients, bucket, job, current="", queued=job_id != LEGACY_JOB_ID, now=now)
    if row["status"] != QUEUED:
        return row
    # Positions count entries alone, as the agent takes them; `trainstack jobs` names the other objects.
    ids = [entry.job_id for entry in scan_queue(clients.s3(), bucket).entries]
    if job_id not in ids:
        row["status"] = row["status"] if row["started"] else NOT_STARTED
        return row
    ahead = [i for i in ids[: ids.index(job_id)] if still_waiting(clients, bucket, i)]
    row["queue_position"] = len(ahead) + 1
    return row


def still_waiting(clients: Clients, bucket: str, job_id: str) -> bool:
    """A queued job no instance has taken and nobody cancelled."""
    job = JobPrefixes.of(job_id)
    ledger = read_ledger(clients, bucket, job)
    cancel = read_json(clients, bucket, job.state + CANCEL_REQUEST)
    return job_status(ledger, cancel, True) == QUEUED


def queue_note(clients: Clients, outputs: StackOutputs, job_id: str) -> tuple[str, str] | None:
    """(status, line) that `status` and `logs` show for a job no instance has taken yet: queued with its
    place, or cancelled before it ran. None for any other job."""
    if job_id == LEGACY_JOB_ID:
        return None
    row = describe(clients, outputs, job_id)
    if row["status"] == CANCELLED and row["step"] is None:
        return CANCELLED, f"job {job_id} was cancelled before an instance took it: it never ran"
    if row["status"] != QUEUED:
        return None
    return QUEUED, (
        f"job {job_id} is queued, position {row['queue_position']}: it starts when the jobs ahead of it end "
        f"(`trainstack jobs` lists the queue; `trainstack cancel {job_id}` withdraws it)"
    )


def sweep_report(
    clients: Clients, outputs: StackOutputs, name: str, *, metric: str, higher_is_better: bool
) -> dict[str, Any]:
    """The jobs of sweep `name` side by side with `metric` from their results/metrics.json, best first."""
    report = collect(clients, outputs)
    rows = [row for row in report["jobs"] if (row["sweep"] or {}).get("name") == name]
    if not rows:
        names = sorted({str(row["sweep"]["name"]) for row in report["jobs"] if row["sweep"]})
        known = f"sweeps in this stack: {', '.join(names)}" if names else "this stack has no sweep yet"
        raise CliError(f"--sweep {name}: no job of that sweep ({known}); `trainstack run --sweep` starts one")
    for row in rows:
        metrics = read_json(clients, outputs.bucket, JobPrefixes.of(row["job_id"]).results + METRICS)
        row["point"] = dict((row["sweep"] or {}).get("point") or {})
        row["metric"] = metric_value(metrics, metric)
    return {
        "sweep": name,
        "metric": metric,
        "higher_is_better": higher_is_better,
        "jobs": rank(rows, higher_is_better=higher_is_better),
    }


def _steps(row: Mapping[str, Any]) -> str:
    step, total = row["step"], row["total_steps"]
    return "-" if step is None else (f"{step}/{total}" if total else str(step))


def _status(row: Mapping[str, Any]) -> str:
    if row["queue_position"] is not None:
        why = f" ({row['waiting']})" if row.get("waiting") else ""
        return f"{QUEUED} #{row['queue_position']}{why}"
    if row["cancel_requested"] and row["status"] not in ENDED:
        return f"{row['status']} (cancelling)"
    return str(row["status"])


def run(
    clients: Clients,
    stack: Stack,
    *,
    as_json: bool,
    sweep: str | None = None,
    metric: str = DEFAULT_METRIC,
    higher_is_better: bool = True,
) -> int:
    if sweep is not None:
        return _run_sweep(
            clients, stack, sweep, metric=metric, higher_is_better=higher_is_better, as_json=as_json
        )
    report = collect(clients, stack.outputs)
    if as_json:
        print_json(report)
        return _bad_entries(report)
    out = console()
    if not report["jobs"]:
        out.print(
            f"no jobs yet in s3://{report['bucket']}/{JOBS_PREFIX}: `trainstack run JOB.yaml` submits one",
            markup=False,
        )
        return _bad_entries(report)
    table = Table("", "job", "status", "step", "cost", "age")
    for row in report["jobs"]:
        table.add_row(
            "*" if row["current"] else "",
            escape(row["job_id"]),
            _status(row),
            _steps(row),
            format_usd(row["cost_usd"]),
            format_duration(row["age_s"]),
        )
    out.print(table)
    out.print(
        f"* current job; queued #1 runs next; the stack's default job is {report['defined'] or '-'}",
        markup=False,
    )
    return _bad_entries(report)


def _bad_entries(report: Mapping[str, Any]) -> int:
    """Each object under queue/ that is not an entry, one stderr line apiece (after the listing: the last
    lines above the prompt; off stdout, which stays the table or the JSON). The exit status: 0 when jobs
    were listed, whatever else the queue holds; 1 when the bad objects are all there was to show."""
    for bad in report["bad_entries"]:
        print_error(bad["error"])
    return 1 if report["bad_entries"] and not report["jobs"] else 0


def _run_sweep(
    clients: Clients, stack: Stack, name: str, *, metric: str, higher_is_better: bool, as_json: bool
) -> int:
    report = sweep_report(clients, stack.outputs, name, metric=metric, higher_is_better=higher_is_better)
    if as_json:
        print_json(report)
        return 0
    keys = list(dict.fromkeys(key for row in report["jobs"] for key in row["point"]))
    table = Table("#", "job", *keys, metric, "status", "step", "cost")
    for place, row in enumerate(report["jobs"], start=1):
        value = row["metric"]
        table.add_row(
            str(place) if value is not None else "-",
            escape(row["job_id"]),
            *(escape(str(row["point"].get(key, "-"))) for key in keys),
            "-" if value is None else f"{value:.4g}",
            _status(row),
            _steps(row),
            format_usd(row["cost_usd"]),
        )
    out = console()
    out.print(table)
    order = "higher" if higher_is_better else "lower"
    out.print(
        f"sweep {name}: best first by {metric} from each job's results/{METRICS} ({order} is better; "
        "jobs without it yet last)",
        markup=False,
    )
    return 0
