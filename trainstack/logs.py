"""`trainstack logs [-f]`: the job's CloudWatch Logs streams, merged in time order, optionally followed."""

from __future__ import annotations

import contextlib
import json
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from botocore.exceptions import ClientError

from trainstack.aws import Clients, error_code
from trainstack.errors import CliError
from trainstack.jobs import queue_note
from trainstack.stack import Stack
from trainstack.state import resolve_job
from trainstack_job.contract import StackOutput
from trainstack_job.jobs import LEGACY_JOB_ID, JobPrefixes

_SINCE = re.compile(r"^(\d+)([smhd])$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}
# CloudWatch Logs allows 5 FilterLogEvents calls per second per account and region: stay well below.
POLL_SECONDS = 2.0
# Streams from before jobs are `<instance-id>/agent|trainer`; a job's are `<job-id>/<instance-id>/…`.
LEGACY_STREAM_PREFIX = "i-"


def stream_prefix(job: JobPrefixes, stream: str | None) -> str:
    """The log stream prefix of a job's streams, narrowed by `--stream` (an instance id, or more of it)."""
    if job.job_id == LEGACY_JOB_ID:
        return stream or LEGACY_STREAM_PREFIX
    # JobPrefixes.log_stream names them `<job-id>/<instance-id>/<source>`.
    return f"{job.job_id}/{stream or ''}"


@dataclass(frozen=True)
class LogEvent:
    timestamp_ms: int
    stream: str
    message: str
    event_id: str

    def to_json(self) -> dict[str, Any]:
        return {"timestamp": _iso(self.timestamp_ms), "stream": self.stream, "message": self.message}


def _iso(timestamp_ms: int) -> str:
    return datetime.fromtimestamp(timestamp_ms / 1000, timezone.utc).isoformat(timespec="milliseconds")


def parse_since(text: str) -> timedelta:
    """`30s`, `10m`, `2h`, `1d`."""
    match = _SINCE.match(text.strip())
    if match is None:
        raise CliError(f"--since {text!r}: use a number and a unit s, m, h or d, e.g. --since 30m")
    return timedelta(**{_UNITS[match.group(2)]: int(match.group(1))})


class LogReader:
    """Reads a log group from a start time on, never returning the same event twice.

    Each instance ships two streams (agent, trainer), each batched every few seconds (longer while CloudWatch
    refuses), and CloudWatch makes events searchable seconds after they are put: an event can arrive after
    a newer one from another stream was already read. So every read looks back LOOKBACK past the newest
    event seen and leaves out, by event id, what it already returned; a reader that only moved its start
    forward lost such events for good (a drill missed the replacement's "trainer starting")."""

    LOOKBACK = timedelta(seconds=90)

    def __init__(
        self, clients: Clients, group: str, start: datetime, stream_prefix: str | None = None
    ) -> None:
        self.clients = clients
        self.group = group
        self.first_ms = int(start.timestamp() * 1000)
        self.newest_ms = self.first_ms
        self.stream_prefix = stream_prefix
        # The ids returned within the look-back window, with their timestamps (older ones are forgotten).
        self._returned: dict[str, int] = {}

    @property
    def start_ms(self) -> int:
        """Where the next read starts: LOOKBACK before the newest event returned, never before the start."""
        return max(self.first_ms, self.newest_ms - int(self.LOOKBACK.total_seconds() * 1000))

    def read(self) -> list[LogEvent]:
        request: dict[str, Any] = {"logGroupName": self.group, "startTime": self.start_ms}
        if self.stream_prefix:
            request["logStreamNamePrefix"] = self.stream_prefix
        events = []
        try:
            for page in self.clients.logs().get_paginator("filter_log_events").paginate(**request):
                for raw in page["events"]:
                    event = LogEvent(
                        raw["timestamp"], raw["logStreamName"], raw["message"].rstrip("\n"), raw["eventId"]
                    )
                    # Also filtered here: the prefix is what CloudWatch is asked for, and this keeps a
                    # server that ignores it from mixing in another job's streams.
                    if self.stream_prefix and not event.stream.startswith(self.stream_prefix):
                        continue
                    if event.event_id not in self._returned:
                        events.append(event)
        except ClientError as error:
            if error_code(error) == "ResourceNotFoundException":
                raise CliError(
                    f"log group {self.group} not found in {self.clients.region}: the stack may be destroyed; "
                    "run `pulumi up`, or pass the right --stack"
                ) from None
            raise
        events.sort(key=lambda e: (e.timestamp_ms, e.event_id))
        for event in events:
            self._returned[event.event_id] = event.timestamp_ms
            self.newest_ms = max(self.newest_ms, event.timestamp_ms)
        horizon = self.start_ms
        self._returned = {key: at for key, at in self._returned.items() if at >= horizon}
        return events


def print_events(events: list[LogEvent], *, as_json: bool) -> None:
    for event in events:
        if as_json:
            sys.stdout.write(json.dumps(event.to_json()) + "\n")
        else:
            sys.stdout.write(f"{_iso(event.timestamp_ms)} {event.stream} {event.message}\n")
    sys.stdout.flush()


def follow(
    reader: LogReader,
    *,
    as_json: bool,
    poll_seconds: float = POLL_SECONDS,
    sleep: Callable[[float], None] = time.sleep,
    polls: int | None = None,
) -> None:
    """Print new events as they arrive; `polls` bounds the loop (None: until Ctrl-C)."""
    done = 0
    while polls is None or done < polls:
        print_events(reader.read(), as_json=as_json)
        done += 1
        if polls is None or done < polls:
            sleep(poll_seconds)


def run(
    clients: Clients,
    stack: Stack,
    *,
    since: str,
    stream: str | None,
    follow_: bool,
    as_json: bool,
    job_id: str | None = None,
) -> int:
    """Print one job's log events (default: the current job's), `--stream` naming an instance within it."""
    start = datetime.now(timezone.utc) - parse_since(since)
    outputs = stack.outputs
    job = resolve_job(clients, outputs, job_id)
    waiting = queue_note(clients, outputs, job.job_id)
    if waiting is not None:
        # On stderr: a queued job has no log lines yet, and stdout stays the events alone (`--json`, pipes).
        sys.stderr.write(f"trainstack: {waiting[1]}\n")
    reader = LogReader(clients, outputs.text(StackOutput.LOG_GROUP_NAME), start, stream_prefix(job, stream))
    if not follow_:
        print_events(reader.read(), as_json=as_json)
        return 0
    # Ctrl-C is how a user leaves `logs -f`: not an error.
    with contextlib.suppress(KeyboardInterrupt):
        follow(reader, as_json=as_json)
    return 0
