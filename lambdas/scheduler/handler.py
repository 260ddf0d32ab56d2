"""The scheduler: a small function that gives each pool the instances its waiting jobs need, and nothing
bills when nothing runs (docs/internals.md, "The scheduler").

The agents schedule themselves: an instance looking for work takes a job (bootstrap/jobbinding.py), one
whose job ends takes the next, and one with nothing to do leaves the group. What they cannot do is start
an instance for a job that waits while its pool has a free lane and no idle instance: `trainstack run`
does that when it submits, and this function does it whenever a queue entry appears (EventBridge, from S3),
an instance of a pool ends, and every five minutes, whoever submitted (a `pulumi up`'s default job, a
submitter whose wake-up call failed, a job resumed later).

It only ever raises a pool's desired capacity, and only to what its waiting jobs need: it compares against
the group's current desired capacity before it sets one, so concurrent invocations agree (each sets the same
number, or finds it set) and none ever lowers a group: instances leave by themselves, idle ones first
(a training one is protected from scale-in). Its package holds this file and the stdlib-only contract
modules of `trainstack_job/` (the queue entry's parser, the pointer names, the ended statuses).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import boto3
from botocore.exceptions import ClientError

from trainstack_job.contract import LEDGER, BucketPrefix
from trainstack_job.jobs import JobPrefixes, pointer_name
from trainstack_job.queue import CANCEL_REQUEST, QUEUE_PREFIX, QueueEntry, QueueError, parse_entry, stored_at
from trainstack_job.records import ENDED_STATUSES
from trainstack_job.slots import Slots
from trainstack_job.throughput import capacity_units

LOG = logging.getLogger("trainstack.scheduler")
LOG.setLevel(logging.INFO)
# The stack's state prefix (bootstrap/agent_config.py Prefixes: the program never moves it).
STATE_PREFIX = BucketPrefix.STATE.value
# A record, ledger or pointer is a few KiB: a bigger object is not read (someone's stray upload).
MAX_OBJECT_BYTES = 1024 * 1024


@dataclass(frozen=True)
class PoolSettings:
    """One pool as the program configured it (the function's POOLS variable)."""

    pool: str  # as queue entries name it: "" = the default pool
    group: str
    lanes: int
    max_instances: int

    @classmethod
    def many_from_env(cls, env: Mapping[str, str]) -> list[PoolSettings]:
        return [
            cls(str(p["pool"]), str(p["group"]), int(p["lanes"]), int(p["max_instances"]))
            for p in json.loads(env["POOLS"])
        ]


@dataclass(frozen=True)
class Decision:
    pool: str
    group: str
    waiting: int
    busy: int
    desired: int
    wanted: int
    action: str  # "raised" or "none"

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class StackState:
    """The stack's queue and jobs as S3 holds them, read once per invocation."""

    def __init__(self, s3: Any, bucket: str, state_prefix: str) -> None:
        self._s3 = s3
        self.bucket = bucket
        self.state_prefix = state_prefix
        self._entries: list[QueueEntry] | None = None

    def _json(self, key: str) -> dict[str, Any] | None:
        try:
            response = self._s3.get_object(Bucket=self.bucket, Key=key)
        except ClientError as error:
            if error.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                return None
            raise
        if int(response.get("ContentLength") or 0) > MAX_OBJECT_BYTES:
            response["Body"].close()
            return None
        try:
            value = json.loads(response["Body"].read())
        except (ValueError, RecursionError):
            return None
        return value if isinstance(value, dict) else None

    def entries(self) -> list[QueueEntry]:
        """Every readable queue entry in queue order; one that is not an entry is left out (the agents and
        `trainstack jobs` name it)."""
        if self._entries is not None:
            return self._entries
        found: list[QueueEntry] = []
        for page in self._s3.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=QUEUE_PREFIX
        ):
            for item in page.get("Contents", []):
                key = str(item["Key"])
                if not key.endswith(".json") or int(item.get("Size") or 0) > MAX_OBJECT_BYTES:
                    continue
                try:
                    body = self._s3.get_object(Bucket=self.bucket, Key=key)["Body"].read()
                    found.append(parse_entry(key, body, stored_at(item)))
                except (QueueError, ClientError):
                    continue
        self._entries = sorted(found, key=lambda entry: entry.order)
        return self._entries

    def status(self, job_id: str) -> str | None:
        ledger = self._json(JobPrefixes.of(job_id).state + LEDGER)
        return str(ledger.get("status")) if ledger and ledger.get("status") else None

    def waiting(self, pool: str) -> list[str]:
        """The pool's jobs no instance has taken: an entry, no ledger (or `queued`), no cancel request."""
        return [
            entry.job_id
            for entry in self.entries()
            if entry.pool == pool
            and self.status(entry.job_id) in (None, "queued")
            and self._json(JobPrefixes.of(entry.job_id).state + CANCEL_REQUEST) is None
        ]

    def busy_lanes(self, settings: PoolSettings) -> int:
        """The pool's lanes whose job is not over (starting, waiting for data, training, yielding)."""
        busy = 0
        for lane in range(settings.lanes):
            pointer = self._json(self.state_prefix + pointer_name(settings.pool, lane)) or {}
            job_id = pointer.get("job_id")
            if isinstance(job_id, str) and job_id and self.status(job_id) not in ENDED_STATUSES:
                busy += 1
        return busy

    def instances_for(self, job_id: str, settings: PoolSettings) -> int:
        """What the job trains on: its record's instance count, else the pool's (never more than that)."""
        record = self._json(JobPrefixes.of(job_id).record) or {}
        agent = record.get("agent") if isinstance(record.get("agent"), dict) else {}
        count = (agent or {}).get("instance_count")
        if isinstance(count, int) and not isinstance(count, bool) and count >= 1:
            return min(count, settings.max_instances)
        return settings.max_instances


def plan(state: StackState, settings: PoolSettings, room: int | None = None) -> tuple[int, int, int, int]:
    """(waiting jobs, busy lanes, instances the pool needs now, jobs it starts). A pool of one lane needs
    instances only while its lane is free and a job waits (the instance up takes the next job itself); one
    of several lanes needs one per busy lane plus one per waiting job its free lanes can start. `room`: how
    many more jobs the stack's maxConcurrentJobs lets start (None: no limit)."""
    waiting = state.waiting(settings.pool)
    busy = state.busy_lanes(settings)
    free = 1 - min(busy, 1) if settings.lanes == 1 else settings.lanes - busy
    starts = min(len(waiting), free, len(waiting) if room is None else room)
    if settings.lanes == 1:
        needed = state.instances_for(waiting[0], settings) if starts else 0
        return len(waiting), busy, needed, starts
    return len(waiting), busy, busy + starts, starts


def run(
    autoscaling: Any,
    s3: Any,
    bucket: str,
    state_prefix: str,
    pools: Sequence[PoolSettings],
    max_concurrent_jobs: int = 0,
    now: datetime | None = None,
) -> list[Decision]:
    """One pass over every pool: raise the desired capacity of each that needs more; never lower one. With
    a stack-wide `max_concurrent_jobs`, the pools (in their declared order) start no more jobs than the
    free run slots (trainstack_job/slots.py)."""
    state = StackState(s3, bucket, state_prefix)
    room: int | None = None
    if max_concurrent_jobs:
        slots = Slots(s3, bucket, state_prefix, max_concurrent_jobs, state.status)
        room = max(0, max_concurrent_jobs - len(slots.running(now or datetime.now(timezone.utc))))
    decisions: list[Decision] = []
    for settings in pools:
        waiting, busy, needed, starts = plan(state, settings, room)
        if room is not None:
            room -= starts
        found = autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[settings.group])
        groups = found.get("AutoScalingGroups", [])
        if not groups:
            continue  # not there yet (created after this function) or gone: nothing to raise
        # Both in the group's units: a weighted pool (infra/fleet.py pool_weights) runs one instance of one
        # job, and its unit is one instance of any of its types, so `needed` instances are that many units.
        desired, maximum = int(groups[0]["DesiredCapacity"]), int(groups[0]["MaxSize"])
        wanted = min(maximum, capacity_units(needed))
        action = "none"
        if wanted > desired:
            # Compared against what the group wants now: a concurrent invocation sets the same number.
            autoscaling.set_desired_capacity(
                AutoScalingGroupName=settings.group, DesiredCapacity=wanted, HonorCooldown=False
            )
            action = "raised"
        decisions.append(Decision(settings.pool, settings.group, waiting, busy, desired, wanted, action))
    return decisions


# EventBridge stamps an event to the second (`time`), and the two clocks may differ by a little: a pass
# covers an event only if it began at least this long after the event's stamp.
COVER_MARGIN = timedelta(seconds=2)


@dataclass
class Passes:
    """When the last pass of this function's container began. A pass reads the queue and the jobs whole, and
    S3 is strongly consistent, so a pass that began after an event was sent saw everything the event
    announced: a burst of 50 submissions is 50 events, invoked one after another (reserved concurrency 1),
    and each one a pass already covered returns at once instead of reading the whole queue again. A cold
    container knows no pass: it runs one."""

    last_started: datetime | None = None

    def covered(self, event_time: datetime | None) -> bool:
        return (
            event_time is not None
            and self.last_started is not None
            and event_time + COVER_MARGIN <= self.last_started
        )


PASSES = Passes()


def event_time(event: Mapping[str, Any]) -> datetime | None:
    """The EventBridge event's `time` (ISO 8601, UTC); None for an event without one (a test invocation)."""
    try:
        moment = datetime.fromisoformat(str(event.get("time", "")).replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo is not None else None


def handler(event: Mapping[str, Any], context: object) -> dict[str, Any]:
    """Lambda entry point: a queue entry created, an instance of a pool ended, or the 5-minute schedule."""
    env = os.environ
    if PASSES.covered(event_time(event)):
        skipped = {"decisions": [], "skipped": "a pass that began after this event already read its state"}
        LOG.info(json.dumps(skipped))
        return skipped
    started = datetime.now(timezone.utc)
    decisions = run(
        boto3.client("autoscaling"),
        boto3.client("s3"),
        env["BUCKET"],
        STATE_PREFIX,
        PoolSettings.many_from_env(env),
        int(env.get("MAX_CONCURRENT_JOBS") or 0),
    )
    PASSES.last_started = started
    result = {"decisions": [decision.to_json() for decision in decisions]}
    LOG.info(json.dumps(result))
    return result
