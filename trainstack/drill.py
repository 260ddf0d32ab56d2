"""`trainstack drill`: one real spot interruption of the job's instance (AWS Fault Injection Service),
then the job's own account of it: notice → checkpoint confirmed → replacement (or standby) → resumed, the
steps lost and what the drill cost. All of it from the job's state in S3 and the agent's events."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from botocore.exceptions import ClientError
from rich.table import Table

from trainstack.aws import Clients, error_code
from trainstack.errors import CliError
from trainstack.logs import LogEvent, LogReader, stream_prefix
from trainstack.output import console, format_duration, format_usd, parse_time, print_json
from trainstack.stack import Stack
from trainstack.state import read_group, read_job, read_ledger, resolve_job, training_runs
from trainstack_job.contract import JobStatus, StackOutput
from trainstack_job.records import Life

ENABLE_COMMAND = "pulumi config set trainstack:drill true && pulumi up"
# A real reclaim: two minutes' notice, then the group's replacement boots the Deep Learning AMI and restores
# the checkpoint (typically 5 to 10 minutes). 30 minutes leaves room for a slow spot launch.
DEFAULT_TIMEOUT_MINUTES = 30.0
# Each poll reads the experiment, the ledger and the new log events: well under every API's rate limit.
POLL_SECONDS = 10.0
# The notice the template gives (infra/drill.py: DURATION_BEFORE_INTERRUPTION): the checkpoint must be
# confirmed in S3 within it.
NOTICE_SECONDS = 120.0
# The instance's clock and this machine's may differ by a few seconds: events read from a little earlier.
CLOCK_SLACK = timedelta(seconds=30)
# The agent ships its events every 5 s and flushes them when it exits: a job seen ended is given this long
# for its last events (the replacement's resume among them) to arrive before the drill calls it ended, and
# a resume seen before the interrupted instance's stop (a warm standby can take over within a second, while
# the old holder's stop is still in its next batch) this long for that stop to arrive.
LOG_GRACE_SECONDS = 15.0
_EXPERIMENT_FAILED = {"failed", "stopped", "cancelled"}
_RESUMED = {"trainer starting": False, "start gate opened: the standby trains": True}


@dataclass(frozen=True)
class AgentEvent:
    """One of the agent's JSON events (bootstrap/eventlog.py), with the instance whose stream carried it."""

    at: datetime
    instance: str
    stage: str
    message: str
    fields: dict[str, Any]


def agent_events(log_events: Iterable[LogEvent]) -> list[AgentEvent]:
    """The agent's events among a job's log events (its streams end in `/agent`; the trainer's are text)."""
    found = []
    for event in log_events:
        parts = event.stream.split("/")
        if len(parts) < 2 or parts[-1] != "agent":
            continue
        try:
            record = json.loads(event.message)
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict) or "stage" not in record:
            continue
        at = parse_time(record.get("time")) or datetime.fromtimestamp(event.timestamp_ms / 1000, timezone.utc)
        fields = {k: v for k, v in record.items() if k not in ("time", "stage", "message")}
        found.append(AgentEvent(at, parts[-2], str(record["stage"]), str(record.get("message", "")), fields))
    found.sort(key=lambda e: e.at)
    return found


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str


@dataclass
class DrillTimeline:
    """What the job did from the drill's start on, as its own events tell it."""

    started_at: datetime
    start_step: int | None = None
    total_steps: int | None = None
    notice: AgentEvent | None = None
    stopped: AgentEvent | None = None
    replacement: AgentEvent | None = None
    resumed: AgentEvent | None = None
    by_standby: bool = False
    lives: list[Life] = field(default_factory=list)
    ended_at: datetime | None = None

    @property
    def checkpoint_step(self) -> int | None:
        return _int(self.stopped.fields.get("checkpoint_step")) if self.stopped else None

    @property
    def reached_step(self) -> int | None:
        """The newest step the interrupted instance had trained when its trainer stopped."""
        if self.stopped is None:
            return None
        steps = [_int(self.stopped.fields.get(k)) for k in ("reached_step", "newest_local_step")]
        known = [s for s in steps if s is not None]
        return max(known) if known else None

    @property
    def resumed_step(self) -> int | None:
        return _int(self.resumed.fields.get("restored_step")) if self.resumed else None

    @property
    def steps_lost(self) -> int | None:
        """Steps trained before the stop that the job must train again: the newest step reached minus the
        step training resumed from (or, until it resumes, the step the confirmed checkpoint holds)."""
        reached = self.reached_step
        restart = self.resumed_step if self.resumed is not None else self.checkpoint_step
        if reached is None or restart is None:
            return None
        return max(0, reached - restart)

    def seconds(self, event: AgentEvent | None, since: AgentEvent | None = None) -> float | None:
        if event is None:
            return None
        origin = since.at if since is not None else self.started_at
        return (event.at - origin).total_seconds()

    def cost_usd(self) -> float | None:
        """The lives' cost during the drill window, each life's recorded cost pro rata over its time."""
        end = self.ended_at or datetime.now(timezone.utc)
        total, known = 0.0, False
        for life in self.lives:
            start = parse_time(life.started_at)
            stop = parse_time(life.ended_at) or parse_time(life.heartbeat_at)
            if start is None or stop is None:
                continue
            length = (stop - start).total_seconds()
            overlap = (min(stop, end) - max(start, self.started_at)).total_seconds()
            if length > 0 and overlap > 0:
                total += life.cost_usd * overlap / length
                known = True
        return total if known else None

    def checks(self) -> list[Check]:
        stop = self.stopped
        confirmed = bool(stop and stop.fields.get("checkpoint_confirmed"))
        to_confirmed = self.seconds(stop, self.notice) if self.notice else None
        lost = self.steps_lost
        return [
            Check(
                "the interrupted instance stopped with a confirmed checkpoint",
                confirmed,
                f"checkpoint step {self.checkpoint_step}, trainer exit {stop.fields.get('exit_code')}"
                if stop
                else "no stop seen",
            ),
            Check("steps lost = 0", lost == 0, str(lost)),
            Check(
                f"checkpoint confirmed within the {NOTICE_SECONDS:.0f} s notice",
                to_confirmed is not None and to_confirmed < NOTICE_SECONDS,
                format_duration(to_confirmed) if to_confirmed is not None else "never",
            ),
            Check(
                "training resumed at the checkpoint step",
                self.resumed_step is not None and self.resumed_step == self.checkpoint_step,
                f"resumed at {self.resumed_step}, checkpoint {self.checkpoint_step}",
            ),
        ]


def build_timeline(
    started_at: datetime,
    events: Iterable[AgentEvent],
    *,
    start_step: int | None = None,
    total_steps: int | None = None,
    lives: list[Life] | None = None,
    ended_at: datetime | None = None,
) -> DrillTimeline:
    """Find the drill's milestones in the job's events: the first notice after the start, that instance's
    stop, then the first other instance that starts a life and the first that trains again."""
    timeline = DrillTimeline(started_at, start_step, total_steps, lives=list(lives or []), ended_at=ended_at)
    for event in sorted(events, key=lambda e: e.at):
        if event.at < started_at - CLOCK_SLACK:
            continue
        notice = timeline.notice
        if notice is None:
            if event.stage == "interruption":
                timeline.notice = event
            continue
        if event.instance == notice.instance:
            if timeline.stopped is None and event.stage == "stop" and "checkpoint_confirmed" in event.fields:
                timeline.stopped = event
            continue
        if (
            timeline.replacement is None
            and event.stage == "start"
            and event.message == "instance life starting"
        ):
            timeline.replacement = event
        if timeline.resumed is None and event.stage == "train" and event.message in _RESUMED:
            timeline.resumed = event
            timeline.by_standby = _RESUMED[event.message]
    return timeline


def rows(timeline: DrillTimeline, *, experiment_id: str, target: str) -> list[tuple[float, str]]:
    """(seconds since the drill started, what happened), in time order."""
    total = f"/{timeline.total_steps}" if timeline.total_steps else ""
    step = f"{timeline.start_step}{total}"
    found = [(0.0, f"FIS experiment {experiment_id} started; the job is at step {step} on {target}")]
    if timeline.notice:
        notice = timeline.notice
        found.append((_secs(timeline, notice), f"spot interruption notice reaches {notice.instance}"))
    if timeline.stopped:
        stop = timeline.stopped
        checkpoint = f"checkpoint step {timeline.checkpoint_step}"
        what = (
            f"{checkpoint} confirmed in S3"
            if stop.fields.get("checkpoint_confirmed")
            else f"WITHOUT its newest checkpoint in S3 ({checkpoint}, confirmed, is kept)"
        )
        exit_code = stop.fields.get("exit_code")
        text = f"{stop.instance}'s trainer stops at step {timeline.reached_step} (exit {exit_code}); {what}"
        found.append((_secs(timeline, stop), text))
    if timeline.replacement:
        event = timeline.replacement
        kind = "the next standby" if timeline.by_standby else "the replacement"
        where = ", ".join(str(event.fields.get(key, "?")) for key in ("instance_type", "az", "lifecycle"))
        found.append((_secs(timeline, event), f"{kind} {event.instance} ({where}) boots"))
    if timeline.resumed:
        event = timeline.resumed
        who = (
            f"the standby {event.instance} takes over" if timeline.by_standby else f"{event.instance} resumes"
        )
        found.append((_secs(timeline, event), f"{who}: training from step {timeline.resumed_step}{total}"))
    return sorted(found, key=lambda row: row[0])


def summary(timeline: DrillTimeline) -> dict[str, Any]:
    """The figures under the timeline (also the JSON's)."""
    return {
        "steps_lost": timeline.steps_lost,
        "notice_to_checkpoint_confirmed_s": _round(timeline.seconds(timeline.stopped, timeline.notice)),
        "notice_to_training_resumed_s": _round(timeline.seconds(timeline.resumed, timeline.notice)),
        "replacement_boot_to_resumed_s": _round(timeline.seconds(timeline.resumed, timeline.replacement)),
        "resumed_by": _resumed_by(timeline),
        "cost_usd": _round(timeline.cost_usd(), 4),
        "window_s": _round(
            ((timeline.ended_at or timeline.started_at) - timeline.started_at).total_seconds()
        ),
    }


# -- the command ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Started:
    experiment_id: str
    template_id: str
    job_id: str
    started_at: datetime
    target: str  # the job's instance(s) FIS may pick, for the first line
    start_step: int | None
    total_steps: int | None


def start(clients: Clients, stack: Stack, *, client_token: str | None = None) -> Started:
    """Check that a job is running on spot, then start the experiment; one-line errors for each refusal."""
    outputs = stack.outputs
    template_id = outputs.values.get(StackOutput.DRILL_TEMPLATE_ID.value)
    if not template_id:
        raise CliError(
            f"the drill is not enabled on stack '{stack.name}' (no stack output "
            f"'{StackOutput.DRILL_TEMPLATE_ID.value}'): `{ENABLE_COMMAND}`, then retry"
        )
    job = resolve_job(clients, outputs)
    state = read_job(clients, outputs, job)
    group = read_group(clients, outputs.group_name)
    if not training_runs(group, state):
        raise CliError(
            f"no running job to interrupt: job {job.job_id} is {state.status} and the group has "
            f"{group.in_service} instance(s) in service; start one (`trainstack resume`, or `pulumi up` for "
            "a new job) and retry once `trainstack status` shows it training"
        )
    spot = [i for i in group.instances if i.state == "InService" and i.lifecycle == "spot"]
    if not spot:
        raise CliError(
            f"no spot instance to interrupt in {group.name}: FIS interrupts spot instances only, and the job "
            "runs on on-demand capacity now (capacity fallback or onDemandBaseCapacity); retry once it is "
            "back on spot"
        )
    progress = state.progress
    started_at = datetime.now(timezone.utc)
    try:
        answer = clients.client("fis").start_experiment(
            experimentTemplateId=str(template_id), clientToken=client_token or str(uuid.uuid4())
        )
    except ClientError as error:
        raise _start_refused(error, str(template_id)) from None
    experiment = answer["experiment"]
    _raise_if_failed(experiment)
    return Started(
        experiment_id=str(experiment["id"]),
        template_id=str(template_id),
        job_id=job.job_id,
        started_at=started_at,
        target=", ".join(f"{i.instance_id} ({i.instance_type}, {i.az}, spot)" for i in spot),
        start_step=progress.step if progress is not None else None,
        total_steps=progress.total_steps if progress is not None else None,
    )


def _start_refused(error: ClientError, template_id: str) -> CliError:
    code = error_code(error)
    message = error.response.get("Error", {}).get("Message", "") or code
    if code in {"AccessDeniedException", "AccessDenied", "UnauthorizedOperation"}:
        return CliError(
            f"FIS refused to start the drill ({message}): your identity needs fis:StartExperiment on "
            f"experiment-template/{template_id} and on experiment/*"
        )
    if code == "ResourceNotFoundException":
        return CliError(
            f"experiment template {template_id} not found ({message}): the stack's outputs may be stale; "
            f"`{ENABLE_COMMAND}`, then retry"
        )
    return CliError(f"FIS StartExperiment failed: {code}: {message}")


def _raise_if_failed(experiment: dict[str, Any]) -> None:
    state = experiment.get("state") or {}
    status = str(state.get("status", ""))
    if status in _EXPERIMENT_FAILED:
        reason = state.get("reason") or "no reason given"
        error = state.get("error") or {}
        detail = f" ({error.get('code')}: {error.get('location', '')})" if error.get("code") else ""
        raise CliError(
            f"the drill's FIS experiment {experiment.get('id')} {status}: {reason}{detail}; see it with "
            f"`aws fis get-experiment --id {experiment.get('id')}`"
        )


def watch(
    clients: Clients,
    stack: Stack,
    started: Started,
    *,
    timeout_s: float,
    poll_seconds: float = POLL_SECONDS,
    sleep: Callable[[float], None] = time.sleep,
    announce: Callable[[str], None] | None = None,
) -> tuple[DrillTimeline, str]:
    """Poll the experiment, the ledger and the job's events until training resumes, the job ends, or the
    timeout; (the timeline, how it ended: resumed / job_ended / timed_out). A failed experiment raises."""
    outputs = stack.outputs
    job = resolve_job(clients, outputs, started.job_id)
    reader = LogReader(
        clients,
        outputs.text(StackOutput.LOG_GROUP_NAME),
        started.started_at - CLOCK_SLACK,
        stream_prefix(job, None),
    )
    fis = clients.client("fis")
    events: list[AgentEvent] = []
    said: set[str] = set()
    deadline = time.monotonic() + timeout_s
    ended_at: float | None = None
    resumed_at: float | None = None
    while True:
        _raise_if_failed(fis.get_experiment(id=started.experiment_id)["experiment"])
        events.extend(agent_events(reader.read()))
        ledger = read_ledger(clients, outputs.bucket, job)
        timeline = build_timeline(
            started.started_at,
            events,
            start_step=started.start_step,
            total_steps=started.total_steps,
            lives=ledger.lives if ledger is not None else [],
            ended_at=datetime.now(timezone.utc),
        )
        if announce is not None:
            found = rows(timeline, experiment_id=started.experiment_id, target=started.target)
            for moment, text in found[1:]:
                if text not in said:
                    said.add(text)
                    announce(f"{moment:7.1f}s  {text}")
        if timeline.resumed is not None:
            # Without the stop the checks would fail the drill for an event that is only still in flight.
            resumed_at = time.monotonic() if resumed_at is None else resumed_at
            if timeline.stopped is not None or time.monotonic() - resumed_at >= LOG_GRACE_SECONDS:
                return timeline, "resumed"
        else:
            status = ledger.status if ledger is not None else ""
            if timeline.notice is not None and status and status != JobStatus.RUNNING.value:
                ended_at = time.monotonic() if ended_at is None else ended_at
                if time.monotonic() - ended_at >= LOG_GRACE_SECONDS:
                    return timeline, "job_ended"
        if time.monotonic() >= deadline:
            return timeline, "resumed" if timeline.resumed is not None else "timed_out"
        sleep(poll_seconds)


def run(
    clients: Clients,
    stack: Stack,
    *,
    wait: bool,
    as_json: bool,
    timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES,
    poll_seconds: float | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    if timeout_minutes <= 0:
        raise CliError(f"--timeout {timeout_minutes:g}: the minutes to wait must be more than 0 (e.g. 30)")
    out = console()
    started = start(clients, stack)
    head = {
        "experiment_id": started.experiment_id,
        "template_id": started.template_id,
        "job_id": started.job_id,
        "started_at": started.started_at.isoformat(timespec="seconds"),
        "target": started.target,
        "step": started.start_step,
    }
    if not as_json:
        out.print(
            f"drill started: FIS experiment {started.experiment_id} sends a spot interruption notice "
            f"({NOTICE_SECONDS:.0f} s) to one of {started.target}, then interrupts it; job {started.job_id} "
            f"is at step {started.start_step}"
        )
    if not wait:
        if as_json:
            print_json({**head, "waited": False})
        else:
            out.print("not waiting: follow it with `trainstack status` and `trainstack logs -f`")
        return 0
    if not as_json:
        limit = format_duration(timeout_minutes * 60)
        out.print(f"waiting up to {limit} for the notice, the checkpoint and the resume…")
    timeline, ending = watch(
        clients,
        stack,
        started,
        timeout_s=timeout_minutes * 60,
        poll_seconds=POLL_SECONDS if poll_seconds is None else poll_seconds,
        sleep=sleep,
        announce=None if as_json else out.print,
    )
    checks = timeline.checks()
    found = rows(timeline, experiment_id=started.experiment_id, target=started.target)
    passed = ending == "resumed" and all(check.passed for check in checks)
    figures = summary(timeline)
    if as_json:
        print_json(
            {
                **head,
                "waited": True,
                "ending": ending,
                "timeline": [{"t_s": round(moment, 1), "what": text} for moment, text in found],
                **figures,
                "checks": [vars(check) for check in checks],
                "passed": passed,
            }
        )
        return 0 if passed else 1
    table = Table(title=f"Spot interruption drill, job {started.job_id}")
    table.add_column("t (s)", justify="right")
    table.add_column("what happened", overflow="fold")
    for moment, text in found:
        table.add_row(f"{moment:.1f}", text)
    out.print(table)
    lines = Table(show_header=False, box=None)
    lines.add_column("what")
    lines.add_column("value", overflow="fold")
    lines.add_row("steps lost", str(figures["steps_lost"]))
    label = "standby" if timeline.by_standby else "replacement"
    for name, key in (
        ("notice → checkpoint confirmed", "notice_to_checkpoint_confirmed_s"),
        (f"{label} boot → training resumed", "replacement_boot_to_resumed_s"),
        ("notice → training resumed", "notice_to_training_resumed_s"),
    ):
        lines.add_row(name, format_duration(figures[key]))
    lines.add_row(
        "drill cost",
        f"{format_usd(figures['cost_usd'], 4)} (the job's lives over the drill's "
        f"{format_duration(figures['window_s'])}, pro rata of their recorded cost)",
    )
    for check in checks:
        lines.add_row(("PASS " if check.passed else "FAIL ") + check.name, check.detail)
    out.print(lines)
    if ending == "timed_out":
        out.print(
            f"timed out after {format_duration(timeout_minutes * 60)} before training resumed; the drill "
            "goes on: `trainstack status`, `trainstack logs -f` (or wait longer with --timeout MINUTES)"
        )
    elif ending == "job_ended":
        out.print("the job left the running state before training resumed: `trainstack status` says why")
    return 0 if passed else 1


def _resumed_by(timeline: DrillTimeline) -> str | None:
    if timeline.resumed is None:
        return None
    return "standby" if timeline.by_standby else "replacement"


def _secs(timeline: DrillTimeline, event: AgentEvent) -> float:
    return (event.at - timeline.started_at).total_seconds()


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)
