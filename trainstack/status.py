"""`trainstack status`: the group, the training progress, the latest checkpoint and what it costs."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from rich.markup import escape
from rich.progress_bar import ProgressBar
from rich.table import Table

from trainstack.aws import Clients
from trainstack.jobs import queue_note
from trainstack.output import console, format_duration, format_usd, parse_time, print_json
from trainstack.stack import Stack
from trainstack.state import JobState, read_group, read_job, resolve_job
from trainstack_job.contract import RESUME_COMMAND, JobStatus, StackOutput
from trainstack_job.records import Ledger


@dataclass(frozen=True)
class Cost:
    """Spend so far and the estimate to finish, from the ledger's per-life prices."""

    so_far_usd: float | None
    rate_usd_per_hour: float | None
    remaining_s: float | None

    @property
    def to_finish_usd(self) -> float | None:
        if self.remaining_s == 0:
            return 0.0
        if self.rate_usd_per_hour is None or self.remaining_s is None:
            return None
        return self.rate_usd_per_hour * self.remaining_s / 3600

    @property
    def estimate_total_usd(self) -> float | None:
        if self.so_far_usd is None or self.to_finish_usd is None:
            return None
        return self.so_far_usd + self.to_finish_usd


def _seconds_since(value: Any, now: datetime) -> float | None:
    moment = parse_time(value)
    return None if moment is None else max(0.0, (now - moment).total_seconds())


def remaining_seconds(job: JobState, now: datetime) -> float | None:
    """The trainer's ETA, less the time since it wrote it; zero once the job is over."""
    if job.status == JobStatus.COMPLETED:
        return 0.0
    progress = job.progress
    if progress is None or progress.eta_s is None:
        return None
    return max(0.0, float(progress.eta_s) - (_seconds_since(progress.updated_at, now) or 0.0))


def estimate_cost(job: JobState, now: datetime) -> Cost:
    ledger = job.ledger
    lives = ledger.lives if ledger is not None else []
    running = [life for life in lives if life.running and not life.ended_at]
    # The agent records None when it could not learn its price: unknown, not free. The hourly price is the
    # instance's (by its purchase option) plus its share of storage (root volume, bucket).
    prices = [
        life.price_usd_per_hour + life.storage_usd_per_hour
        for life in running
        if life.price_usd_per_hour is not None
    ]
    rate = sum(prices) if prices else None
    newest_price = lives[-1].price_usd_per_hour if lives else None
    if not running and newest_price is not None and job.status == JobStatus.RUNNING:
        # Between lives (a replacement is launching) the last price is the best guess of the next.
        rate = newest_price
    so_far_usd = None
    if ledger is not None:
        so_far_usd = ledger.total_cost_usd
        if running:
            # The ledger is as of its last write; running lives have kept billing since.
            since = _seconds_since(ledger.updated_at, now) or 0.0
            so_far_usd += (rate or 0.0) * since / 3600
    return Cost(so_far_usd=so_far_usd, rate_usd_per_hour=rate, remaining_s=remaining_seconds(job, now))


def collect(
    clients: Clients, stack: Stack, now: datetime | None = None, *, job_id: str | None = None
) -> dict[str, Any]:
    """Everything `status` shows of one job (default: the current one), as one JSON-ready document (the
    human view renders this)."""
    now = now or datetime.now(timezone.utc)
    outputs = stack.outputs
    group = read_group(clients, outputs.group_name)
    job = read_job(clients, outputs, resolve_job(clients, outputs, job_id))
    cost = estimate_cost(job, now)
    checkpoint = dict(job.checkpoint) if job.checkpoint else None
    if checkpoint is not None:
        checkpoint["age_s"] = _seconds_since(checkpoint.get("written_at"), now)
    progress = None
    if job.progress is not None:
        progress = job.progress.to_json() | {
            "age_s": _seconds_since(job.progress.updated_at, now),
            "remaining_s": cost.remaining_s,
        }
    ledger = job.ledger
    # A job no instance has taken yet (no ledger) or one that yielded to a `--now` job: the queue says whether
    # it waits, and where, or was withdrawn.
    untaken = job.status in ("not started", JobStatus.QUEUED)
    waiting = queue_note(clients, outputs, job.job_id) if untaken else None
    return {
        "stack": stack.name,
        "region": clients.region,
        "job": job.job_id,
        "group": group.to_json(),
        "status": waiting[0] if waiting else job.status,
        "next_step": waiting[1] if waiting else NEXT_STEP.get(job.status),
        "stop_requested": job.control is not None,
        "dashboard_url": outputs.values.get(StackOutput.DASHBOARD_URL.value),
        "progress": progress,
        "checkpoint": checkpoint,
        "interruptions": ledger.interruptions if ledger is not None else 0,
        "consecutive_failures": ledger.consecutive_failures if ledger is not None else 0,
        "cost": {
            "so_far_usd": cost.so_far_usd,
            **_cost_split(ledger),
            "rate_usd_per_hour": cost.rate_usd_per_hour,
            "to_finish_usd": cost.to_finish_usd,
            "estimate_total_usd": cost.estimate_total_usd,
        },
    }


def _cost_split(ledger: Ledger | None) -> dict[str, Any]:
    """The ledger's total by kind, and how the newest life is priced (docs/internals.md → ledger)."""
    lives = ledger.lives if ledger is not None else []
    newest = lives[-1] if lives else None
    return {
        "instance_usd": round(sum(life.instance_cost_usd for life in lives), 6),
        "storage_usd": round(sum(life.storage_cost_usd for life in lives), 6),
        "purchase_option": (newest.purchase_option or newest.lifecycle) if newest is not None else None,
        "price_source": newest.price_source if newest is not None else None,
    }


# What the user can do next, by the agent's job status (docs/internals.md → ledger).
NEXT_STEP: dict[str, str] = {
    JobStatus.WAITING_FOR_DATA: "the instance waits for the dataset: trainstack data push ./dataset",
    JobStatus.NO_DATA: (
        f"no dataset arrived, group stopped: trainstack data push ./dataset, then {RESUME_COMMAND}"
    ),
    JobStatus.FAILED: (
        f"the job stopped after repeated failures: read trainstack logs, fix, then {RESUME_COMMAND}"
    ),
    JobStatus.STOPPED: f"stopped on request with a confirmed checkpoint: {RESUME_COMMAND} continues from it",
    JobStatus.COST_CAP: (
        f"the cost cap stopped the job: raise trainstack:maxCostUsd, pulumi up, then {RESUME_COMMAND}"
    ),
    JobStatus.COMPLETED: "done: trainstack results pull",
}


def run(clients: Clients, stack: Stack, *, as_json: bool, job_id: str | None = None) -> int:
    report = collect(clients, stack, job_id=job_id)
    if as_json:
        print_json(report)
    else:
        render(report)
    return 0


def render(report: dict[str, Any]) -> None:
    out = console()
    group = report["group"]
    stop = "  [yellow](stop requested)[/]" if report["stop_requested"] else ""
    out.print(
        f"[bold]{report['stack']}[/] in {report['region']}, job [bold]{escape(report['job'])}[/]: "
        f"training [bold]{report['status']}[/]{stop}"
    )
    if report["next_step"]:
        out.print(f"next: {report['next_step']}")
    out.print(
        f"group {group['name']}: desired {group['desired']} (max {group['max']}), "
        f"in service {group['in_service']}"
    )
    if group["instances"]:
        table = Table("instance", "type", "AZ", "lifecycle", "state", "health")
        for i in group["instances"]:
            table.add_row(
                i["instance_id"], i["instance_type"], i["az"], i["lifecycle"], i["state"], i["health"]
            )
        out.print(table)
    progress = report["progress"]
    if progress:
        _render_progress(progress)
    else:
        out.print("progress: none yet (the trainer writes it once the first steps run)")
    checkpoint = report["checkpoint"]
    if checkpoint:
        out.print(
            f"latest checkpoint: step {checkpoint.get('step')} (epoch {checkpoint.get('epoch')}), "
            f"{format_duration(checkpoint.get('age_s'))} ago"
        )
    else:
        out.print("latest checkpoint: none yet")
    cost = report["cost"]
    out.print(
        f"interruptions: {report['interruptions']}   cost so far: {format_usd(cost['so_far_usd'])} "
        f"(storage {format_usd(cost['storage_usd'])})   to finish: ≈{format_usd(cost['to_finish_usd'])} "
        f"(at {format_usd(cost['rate_usd_per_hour'], 3)}/h; total ≈{format_usd(cost['estimate_total_usd'])})"
    )
    if cost["price_source"]:
        out.print(f"priced as {cost['purchase_option']}: {cost['price_source']}", markup=False)
    if report["dashboard_url"]:
        out.print(f"dashboard: {report['dashboard_url']}", markup=False)


def _render_progress(progress: dict[str, Any]) -> None:
    out = console()
    step, total = progress.get("step"), progress.get("total_steps")
    table = Table.grid(padding=(0, 1))
    if isinstance(step, int | float) and isinstance(total, int | float) and total > 0:
        table.add_row(
            "progress:",
            ProgressBar(total=float(total), completed=float(step), width=30),
            f"{100 * step / total:.1f}%",
        )
    out.print(table)
    speed = progress.get("samples_per_s")
    wait = progress.get("data_wait_fraction")
    out.print(
        f"epoch {progress.get('epoch')}/{progress.get('epochs')}, step {step}/{total}, "
        f"{'-' if speed is None else f'{speed:,.0f}'} samples/s, "
        f"ETA {format_duration(progress.get('remaining_s'))}"
        + (f", data wait {100 * wait:.0f}%" if isinstance(wait, int | float) else "")
        + f" (updated {format_duration(progress.get('age_s'))} ago on {progress.get('instance_type', '?')})"
    )
