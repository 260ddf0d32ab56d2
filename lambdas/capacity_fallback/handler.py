"""The capacity fallback's Lambda handler: spot → on-demand after a launch drought, back to spot after; and
the cost cap from outside the instance: at `maxCostUsd` the group goes to zero and the topic says why.

The cap is the agent's job on the instance (bootstrap/ledger.py); this is the second line, for an agent
that cannot act (wedged, or a job hostile enough to try): the function reads only what the agent alone
writes (the job's credentials cannot write `state/` or `jobs/<id>/state/`) and acts through the group."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import boto3

# The package is this file and trainstack_job's stdlib modules (infra/capacity.py function_code): the records
# the agent writes are read through their one definition.
from trainstack_job.contract import LEDGER
from trainstack_job.jobs import LEGACY_JOB_ID, JobIdError, JobPrefixes, check_job_id
from trainstack_job.launches import Launch, drought_start, read_launches
from trainstack_job.records import JobPointer, Ledger

LOG = logging.getLogger("trainstack.capacity_fallback")
LOG.setLevel(logging.INFO)

FALL_BACK = "fall_back_to_on_demand"
RETURN_TO_SPOT = "return_to_spot"
STAY = "none"

ON_DEMAND_ONLY = 100
# How far back the scaling activities are read: longer than any fallback delay a user would configure.
LOOKBACK = timedelta(hours=12)
_MAX_PAGES = 10
_ACTIVE_STATES = ("Pending", "Pending:Wait", "Pending:Proceed", "InService")
CAP_STOP = "stop_at_cost_cap"
CAP_UNREADABLE = "cost_cap_unreadable"


@dataclass(frozen=True)
class Settings:
    """What the program configured for this one group (the function's environment)."""

    group_name: str
    fallback_minutes: int
    spot_on_demand_percentage: int  # the group's configured OnDemandPercentageAboveBaseCapacity

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Settings:
        return cls(
            group_name=env["GROUP_NAME"],
            fallback_minutes=int(env["FALLBACK_MINUTES"]),
            spot_on_demand_percentage=int(env["SPOT_ON_DEMAND_PERCENTAGE"]),
        )


@dataclass(frozen=True)
class CostCap:
    """The cost cap's settings (MAX_COST_USD, BUCKET, TOPIC_ARN); absent when the stack sets no cap."""

    max_cost_usd: float
    bucket: str
    topic_arn: str
    state_prefix: str = "state/"
    # The current-job pointer of this group's pool (a pool other than the default keeps its own).
    pointer: str = "current-job.json"

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> CostCap | None:
        if not env.get("MAX_COST_USD"):
            return None
        return cls(
            max_cost_usd=float(env["MAX_COST_USD"]),
            bucket=env["BUCKET"],
            topic_arn=env["TOPIC_ARN"],
            pointer=env.get("CURRENT_JOB") or "current-job.json",
        )

    @property
    def current_job_key(self) -> str:
        return f"{self.state_prefix}{self.pointer}"

    @staticmethod
    def ledger_key(job_id: str) -> str:
        """The job's ledger; the legacy job (a stack from before jobs) keeps it at the stack's state/."""
        return JobPrefixes.of(job_id).state + LEDGER


@dataclass(frozen=True)
class Group:
    """The part of DescribeAutoScalingGroups the decision reads."""

    desired: int
    active: int  # instances pending or in service
    on_demand_percentage: int


@dataclass(frozen=True)
class Decision:
    action: str
    reason: str


def decide(group: Group, launches: Sequence[Launch], now: datetime, settings: Settings) -> Decision:
    """The whole policy, pure: what to do with the group now. State lives in the group itself.

    The group is "in fallback" when it is set to 100% on-demand while configured for spot. No other state is
    kept: how long the group has gone without a launch is read from its scaling activities.
    """
    if settings.fallback_minutes <= 0 or settings.spot_on_demand_percentage >= ON_DEMAND_ONLY:
        return Decision(STAY, "fallback disabled (spotFallbackMinutes 0, or the group is already on-demand)")
    newest_first = sorted(launches, key=lambda launch: launch.started_at, reverse=True)
    if group.on_demand_percentage >= ON_DEMAND_ONLY:
        return _in_fallback(group, newest_first)
    if group.active >= group.desired:
        return Decision(STAY, f"has what it wants ({group.active} of {group.desired})")
    since = drought_start(newest_first, now)
    if since is None:
        return Decision(STAY, "wants an instance; no unsuccessful launch yet")
    waited = now - since
    if waited < timedelta(minutes=settings.fallback_minutes):
        return Decision(
            STAY,
            f"no spot launch for {_minutes(waited)} of {settings.fallback_minutes} min while wanting "
            f"{group.desired - group.active}",
        )
    return Decision(
        FALL_BACK,
        f"no spot launch for {_minutes(waited)} (limit {settings.fallback_minutes} min) while wanting "
        f"{group.desired - group.active}: launching on-demand",
    )


def _in_fallback(group: Group, newest_first: Sequence[Launch]) -> Decision:
    # Back to spot at the next launch after the on-demand life: a running on-demand instance is never cut
    # short (its job would pay a checkpoint and a restore); once it is gone, spot is tried first again.
    if group.active > 0:
        return Decision(STAY, "on-demand instance running; spot is tried again at the next launch")
    if group.desired == 0:
        return Decision(RETURN_TO_SPOT, "group at zero: the next launch tries spot first")
    if newest_first and newest_first[0].succeeded:
        return Decision(RETURN_TO_SPOT, "the on-demand life ended and a launch is due: spot first")
    return Decision(STAY, "waiting for the on-demand launch")


def read_group(description: Mapping[str, Any]) -> Group:
    distribution = description.get("MixedInstancesPolicy", {}).get("InstancesDistribution", {})
    active = sum(1 for i in description.get("Instances", []) if i.get("LifecycleState") in _ACTIVE_STATES)
    return Group(
        desired=int(description["DesiredCapacity"]),
        active=active,
        on_demand_percentage=int(distribution.get("OnDemandPercentageAboveBaseCapacity", ON_DEMAND_ONLY)),
    )


def distribution_update(description: Mapping[str, Any], on_demand_percentage: int) -> dict[str, Any]:
    """The group's instances distribution with one field changed, as UpdateAutoScalingGroup takes it.

    Only the distribution is sent, never the launch template: AWS checks the caller for ec2:RunInstances,
    iam:PassRole on the instance profile's role and ec2:CreateTags only when a create or update names a
    launch template (EC2 Auto Scaling User Guide, "Control Amazon EC2 launch template usage in Auto Scaling
    groups"), and the template "is not required when updating the group" (API reference,
    MixedInstancesPolicy): what the request leaves out stays as it is. So the function's role needs
    autoscaling:UpdateAutoScalingGroup on its group and nothing that could launch an instance. The whole
    distribution is sent, not the one field: each of its fields keeps the group's value.
    """
    distribution = description["MixedInstancesPolicy"].get("InstancesDistribution", {})
    return {
        "InstancesDistribution": {**distribution, "OnDemandPercentageAboveBaseCapacity": on_demand_percentage}
    }


def estimated_cost(ledger: Ledger, now: datetime, in_group: Collection[str] | None = None) -> float:
    """The job's cost now: the ledger's total, plus each running life's hourly price since the agent last
    priced it. A ledger whose agent stopped updating it (wedged, or its instance's job hostile) still
    counts up, at the prices the agent recorded, for as long as the life is open — and its instance is
    still in the group (`in_group`): a life whose instance died without a word stays `running` in the
    ledger until the next life closes it, but bills nothing more, so it must not trip the cap."""
    total = ledger.total_cost_usd
    for life in ledger.lives:
        if not life.running or life.price_usd_per_hour is None:
            continue
        if in_group is not None and life.instance_id and life.instance_id not in in_group:
            continue
        since = life.priced_at or life.heartbeat_at or life.started_at
        hours = max(0.0, (now - datetime.fromisoformat(since.replace("Z", "+00:00"))).total_seconds() / 3600)
        total += hours * (life.price_usd_per_hour + life.storage_usd_per_hour)
    return total


def read_json(s3: Any, bucket: str, key: str) -> dict[str, Any] | None:
    """The object as JSON; None when it does not exist (no job yet, or a new job before its first instance
    wrote its ledger: nothing to cap). The role may list exactly the keys it reads, so S3 answers a missing
    one NoSuchKey, not AccessDenied (infra/iam/service_roles.py). Access denied is not "none": it is raised,
    so a real refusal fails the cap check loudly instead of disabling the cap."""
    try:
        body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    except s3.exceptions.NoSuchKey:
        return None
    value = json.loads(body)
    return value if isinstance(value, dict) else None


def _job_id(pointer: JobPointer | None) -> str | None:
    """The job a pointer names, when it names one (the legacy job included)."""
    if pointer is None:
        return None
    if pointer.job_id == LEGACY_JOB_ID:
        return LEGACY_JOB_ID
    try:
        return check_job_id(pointer.job_id)
    except JobIdError:
        return None


def enforce_cost_cap(
    cap: CostCap,
    description: Mapping[str, Any],
    s3: Any,
    autoscaling: Any,
    sns: Any,
    group_name: str,
    now: datetime,
) -> dict[str, str] | None:
    """At or over the cap with the group still wanting instances: desired capacity 0 and one line on the
    topic. Once the group is at zero nothing more is done (so the line is sent once, not every 5 minutes);
    the agent's own cap normally gets there first, and then this finds the group at zero and says nothing."""
    if int(description.get("DesiredCapacity", 0)) == 0:
        return None
    pointer = JobPointer.from_json(read_json(s3, cap.bucket, cap.current_job_key))
    job_id = _job_id(pointer)
    if job_id is None:
        return None
    raw = read_json(s3, cap.bucket, cap.ledger_key(job_id))
    ledger = Ledger.from_json(raw)
    if raw is None or ledger.idle:
        # Idle (trainstack_job/records.py IDLE_STATUSES): it ended, and the agent already acted on that
        # (notified and scaled the group to zero, or moved on to the next queued job on the same instance),
        # or it yielded to a `--now` job and waits in the queue. Any other status, one this function does
        # not know included, still bills: the cap is enforced.
        # An ended job (its own cost cap among them): a second notification, or the next queued job's
        # instance scaled away in the moment before the agent moves the pointer on.
        return None
    instances = {str(i.get("InstanceId")) for i in description.get("Instances", [])}
    cost = estimated_cost(ledger, now, instances)
    if cost < cap.max_cost_usd:
        return None
    autoscaling.set_desired_capacity(AutoScalingGroupName=group_name, DesiredCapacity=0, HonorCooldown=False)
    line = (
        f"trainstack {group_name}: job {job_id} reached {cost:.2f} USD of its {cap.max_cost_usd:g} USD cap "
        "(maxCostUsd); the capacity function scaled the group to zero from outside the instance. Raise "
        "trainstack:maxCostUsd and run pulumi up, then trainstack resume, to continue."
    )
    sns.publish(
        TopicArn=cap.topic_arn, Subject=f"trainstack {group_name}: cost cap reached"[:100], Message=line
    )
    return {"action": CAP_STOP, "reason": line, "group": group_name, "job_id": job_id}


def run(
    event: Mapping[str, Any],
    autoscaling: Any,
    settings: Settings,
    now: datetime,
    *,
    cost_cap: CostCap | None = None,
    s3: Any = None,
    sns: Any = None,
) -> dict[str, str]:
    """Read the group, decide, act; returns the decision (also logged as one JSON line)."""
    named = event.get("detail", {}).get("AutoScalingGroupName")
    if named and named != settings.group_name:
        # The rule filters by group already; a stray event must never move another group.
        return _log({"action": STAY, "reason": f"event of another group, {named}", "group": named})
    groups = autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[settings.group_name])
    if not groups["AutoScalingGroups"]:
        return _log({"action": STAY, "reason": "group not found", "group": settings.group_name})
    description = groups["AutoScalingGroups"][0]
    if cost_cap is not None:
        try:
            stopped = enforce_cost_cap(cost_cap, description, s3, autoscaling, sns, settings.group_name, now)
        except Exception as exc:
            # Loud, but never at the fallback's expense: a refused read (the role's statements changed, a
            # bucket policy or the key refuses it) or a corrupt object must not keep a spot drought from
            # reaching on-demand. The agent's own cap still holds on the instance.
            LOG.error(
                json.dumps(
                    {
                        "action": CAP_UNREADABLE,
                        "reason": f"cannot read the current job's ledger for the cost cap: {exc}"[:300],
                        "fix": "check this function's s3:GetObject and s3:ListBucket (s3:prefix) on "
                        "state/current-job.json and jobs/*/state/ledger.json, and kms:Decrypt through S3 "
                        "on the stack's key; the spot fallback goes on",
                        "group": settings.group_name,
                    }
                )
            )
        else:
            if stopped is not None:
                return _log(stopped)
    decision = decide(read_group(description), _recent_launches(autoscaling, settings, now), now, settings)
    if decision.action != STAY:
        percentage = ON_DEMAND_ONLY if decision.action == FALL_BACK else settings.spot_on_demand_percentage
        autoscaling.update_auto_scaling_group(
            AutoScalingGroupName=settings.group_name,
            MixedInstancesPolicy=distribution_update(description, percentage),
        )
    return _log({"action": decision.action, "reason": decision.reason, "group": settings.group_name})


def _recent_launches(autoscaling: Any, settings: Settings, now: datetime) -> list[Launch]:
    activities: list[Mapping[str, Any]] = []
    request: dict[str, Any] = {"AutoScalingGroupName": settings.group_name, "MaxRecords": 100}
    for _ in range(_MAX_PAGES):
        page = autoscaling.describe_scaling_activities(**request)
        activities.extend(page.get("Activities", []))
        # Newest first: stop once a page reaches past the lookback.
        if not page.get("NextToken") or any(a["StartTime"] < now - LOOKBACK for a in page["Activities"]):
            break
        request["NextToken"] = page["NextToken"]
    return read_launches(activities)


def _minutes(delta: timedelta) -> str:
    return f"{delta.total_seconds() / 60:.0f} min"


def _log(result: dict[str, str]) -> dict[str, str]:
    LOG.info(json.dumps(result))
    return result


def handler(event: Mapping[str, Any], context: object) -> dict[str, str]:
    """Lambda entry point: the group's launch-unsuccessful or termination event, or the 5-minute schedule."""
    cap = CostCap.from_env(os.environ)
    return run(
        event,
        boto3.client("autoscaling"),
        Settings.from_env(os.environ),
        datetime.now(timezone.utc),
        cost_cap=cap,
        s3=boto3.client("s3") if cap else None,
        sns=boto3.client("sns") if cap else None,
    )
