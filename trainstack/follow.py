"""Follow one job until it ends: a status line (queue position, or step, speed and cost so far) kept up to
date in place, and the job's log lines above it. Ctrl-C leaves the job as it is: following only watches."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.text import Text

from trainstack.aws import Clients
from trainstack.jobs import CANCELLED, ENDED, QUEUED, describe
from trainstack.logs import LogReader, print_events, stream_prefix
from trainstack.output import console, format_duration, format_usd, parse_time
from trainstack.stack import StackOutputs
from trainstack.state import JobState, read_ledger, read_progress
from trainstack.status import NEXT_STEP, estimate_cost
from trainstack_job.contract import JobStatus, StackOutput
from trainstack_job.jobs import JobPrefixes
from trainstack_job.records import Progress

# One FilterLogEvents and a few S3 reads per poll: CloudWatch Logs allows 5 filter calls a second.
POLL_SECONDS = 2.0
# The agent writes the job's end to its ledger first and ships a life's last log lines (every 5 s, and a
# flush when it exits) after: a job seen ended is read this much longer, or its last lines would be lost.
LOG_GRACE_SECONDS = 15.0


def again(job_id: str) -> str:
    """How to pick a job up again after leaving it."""
    return f"`trainstack logs --job {job_id} -f` or `trainstack status --job {job_id}`"


@dataclass
class Speed:
    """Steps per second between the two newest progress reports the follower saw."""

    step: int | None = None
    at: datetime | None = None
    per_s: float | None = None

    def see(self, progress: Progress | None) -> None:
        if progress is None:
            return
        step, at = progress.step, parse_time(progress.updated_at)
        if at is None:
            return
        if self.step is not None and self.at is not None and step > self.step and at > self.at:
            self.per_s = (step - self.step) / (at - self.at).total_seconds()
        if self.step is None or step != self.step:
            self.step, self.at = step, at


def status_line(
    row: Mapping[str, Any], progress: Progress | None, cost_usd: float | None, speed: Speed
) -> str:
    """`<id>: queued, position 2` or `<id>: running, step 120/1000, 3.1 steps/s, $0.42 so far`."""
    job_id, status = row["job_id"], row["status"]
    if status == QUEUED:
        return f"{job_id}: queued, position {row['queue_position']} (Ctrl-C leaves it queued)"
    parts = [f"{job_id}: {status}"]
    if progress is not None:
        step, total = progress.step, progress.total_steps
        parts.append(f"step {step}/{total}" if total else f"step {step}")
    if speed.per_s is not None:
        parts.append(f"{speed.per_s:.2f} steps/s")
    elif progress is not None and progress.samples_per_s is not None:
        parts.append(f"{progress.samples_per_s:,.0f} samples/s")
    parts.append(f"{format_usd(cost_usd)} so far")
    return ", ".join(parts)


class StatusLine:
    """One line updated in place on a terminal (rich Live; printed output scrolls above it); elsewhere (a CI
    log, a pipe) the line is printed each time it changes."""

    def __init__(self, out: Console) -> None:
        self._out = out
        self._live = Live(console=out, auto_refresh=False, transient=True) if out.is_terminal else None
        self._last = ""

    def __enter__(self) -> StatusLine:
        if self._live is not None:
            self._live.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._live is not None:
            self._live.__exit__(kind, error, trace)

    def update(self, text: str) -> None:
        if text == self._last:
            return
        self._last = text
        if self._live is not None:
            self._live.update(Text(text), refresh=True)
        else:
            self._out.print(text, markup=False)


def summary(row: Mapping[str, Any], cost_usd: float | None) -> str:
    """The one line a followed job ends with: its outcome, steps, cost, age, and what to do next."""
    job_id, status = row["job_id"], row["status"]
    step, total = row.get("step"), row.get("total_steps")
    if status == CANCELLED and step is None:
        return f"job {job_id} {CANCELLED} before it ran"
    steps = "-" if step is None else (f"{step}/{total}" if total else str(step))
    age = format_duration(row["age_s"])
    line = f"job {job_id} {status}: step {steps}, cost {format_usd(cost_usd)}, {age} after it was submitted"
    hint = NEXT_STEP.get(status)
    if status == JobStatus.COMPLETED:
        hint = f"trainstack results pull --job {job_id}"
    return f"{line}; next: {hint}" if hint else line


def wait(seconds: float) -> None:
    """The pause between two polls (tests replace it)."""
    time.sleep(seconds)


def follow(clients: Clients, outputs: StackOutputs, job_id: str, *, since: datetime) -> int:
    """Watch `job_id` until it ends: 0 when it completed, 1 when it failed, stopped or was cancelled.
    Ctrl-C detaches (0) with a line saying how to follow again; it never cancels the job."""
    out = console()
    job = JobPrefixes.of(job_id)
    reader = LogReader(clients, outputs.text(StackOutput.LOG_GROUP_NAME), since, stream_prefix(job, None))
    speed = Speed()
    try:
        with StatusLine(out) as line:
            ended: set[str] = set()
            while True:
                row, progress, cost, last_instance = _observe(clients, outputs, job)
                speed.see(progress)
                ended |= _print_and_see_ends(reader)
                if row["status"] in ENDED:
                    break
                line.update(status_line(row, progress, cost, speed))
                wait(POLL_SECONDS)
            if last_instance is not None and last_instance not in ended:
                _last_lines(reader, line, row, last_instance)
    except KeyboardInterrupt:
        out.print(
            f"detached; job {job_id} goes on (Ctrl-C never cancels it): follow again with {again(job_id)}",
            markup=False,
        )
        return 0
    out.print(summary(row, cost), markup=False)
    return 0 if row["status"] == JobStatus.COMPLETED else 1


def _print_and_see_ends(reader: LogReader) -> set[str]:
    """Print what arrived; the instances whose agent said its life's last word (an `end` event) in it."""
    events = reader.read()
    print_events(events, as_json=False)
    ended = set()
    for event in events:
        parts = event.stream.split("/")
        if len(parts) < 2 or parts[-1] != "agent":
            continue
        with contextlib.suppress(ValueError):
            record = json.loads(event.message)
            if isinstance(record, dict) and record.get("stage") == "end":
                ended.add(parts[-2])
    return ended


def _last_lines(reader: LogReader, line: StatusLine, row: Mapping[str, Any], instance: str) -> None:
    """Print the log lines that arrive after the job's end until the last life's `end` event (the agent
    ships it last, with the lines before it), for at most LOG_GRACE_SECONDS. Ctrl-C skips the rest of the
    wait: the job is over, the summary still follows."""
    line.update(f"{row['job_id']}: {row['status']}; reading its last log lines (Ctrl-C skips)")
    deadline = time.monotonic() + LOG_GRACE_SECONDS
    with contextlib.suppress(KeyboardInterrupt):
        while time.monotonic() < deadline:
            wait(POLL_SECONDS)
            if instance in _print_and_see_ends(reader):
                return


def _observe(
    clients: Clients, outputs: StackOutputs, job: JobPrefixes
) -> tuple[dict[str, Any], Progress | None, float | None, str | None]:
    """The job's row, progress, cost so far, and the instance of its newest life (None: it never ran)."""
    now = datetime.now(timezone.utc)
    row = describe(clients, outputs, job.job_id, now)
    ledger = read_ledger(clients, outputs.bucket, job)
    progress = read_progress(clients, outputs.bucket, job)
    cost = estimate_cost(JobState(ledger, progress, None, None, job.job_id), now).so_far_usd
    lives = ledger.lives if ledger is not None else []
    return row, progress, cost, (lives[-1].instance_id if lives else None)
