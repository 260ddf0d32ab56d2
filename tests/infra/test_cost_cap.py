"""The cost cap outside the instance: the capacity function reads the current job's ledger and, at or over
`maxCostUsd`, scales the group to zero and publishes one line, against moto. Its calls are recorded as the
function role's, so the session's IAM check (tests/iam) holds them to the role the program declares. At the
end, the spot fallback's decision that shares the function (lambdas/capacity_fallback/handler.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError

from demo.stack import STAND_IN_AMI
from lambdas.capacity_fallback import handler
from lambdas.capacity_fallback.handler import (
    CAP_STOP,
    RETURN_TO_SPOT,
    STAY,
    CostCap,
    Decision,
    Group,
    Settings,
    decide,
    estimated_cost,
)
from tests.iam.plugin import record_as
from tests.iam.principals import CAPACITY_FALLBACK
from trainstack_job.contract import JobStatus
from trainstack_job.launches import Launch
from trainstack_job.records import IDLE_STATUSES, Ledger

REGION = "us-east-1"
STACK = "trainstack-test"
GROUP = f"{STACK}-gpu"
BUCKET = f"{STACK}-data"
JOB = "charlm-1a2b3c4d"
NOW = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)


def _iso(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


def ledger(total: float, *, running_since: datetime | None = None, price: float = 1.0) -> dict[str, Any]:
    lives: list[dict[str, Any]] = []
    if running_since is not None:
        lives.append(
            {
                "life_id": f"i-0123@{_iso(running_since)}",
                "outcome": "running",
                "started_at": _iso(running_since),
                "heartbeat_at": _iso(running_since),
                "priced_at": _iso(running_since),
                "price_usd_per_hour": price,
                "storage_usd_per_hour": 0.0,
            }
        )
    return {"status": "running", "total_cost_usd": total, "lives": lives}


@dataclass
class World:
    autoscaling: Any
    s3: Any
    sqs: Any
    queue_url: str
    cap: CostCap
    function: dict[str, Any]

    def put(self, key: str, value: dict[str, Any]) -> None:
        self.s3.put_object(Bucket=BUCKET, Key=key, Body=json.dumps(value).encode())

    def tick(self, now: datetime = NOW, *, fallback_minutes: int = 0) -> dict[str, str]:
        settings = Settings(group_name=GROUP, fallback_minutes=fallback_minutes, spot_on_demand_percentage=0)
        return handler.run(
            {}, self.function["autoscaling"], settings, now, cost_cap=self.cap, **self._clients()
        )

    def _clients(self) -> dict[str, Any]:
        return {"s3": self.function["s3"], "sns": self.function["sns"]}

    def desired(self) -> int:
        groups = self.autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[GROUP])
        return int(groups["AutoScalingGroups"][0]["DesiredCapacity"])

    def lines(self) -> list[str]:
        found = self.sqs.receive_message(QueueUrl=self.queue_url, MaxNumberOfMessages=10, WaitTimeSeconds=0)
        return [json.loads(m["Body"])["Message"] for m in found.get("Messages", [])]


@pytest.fixture()
def world(aws: Any) -> Iterator[World]:
    ec2 = boto3.client("ec2", region_name=REGION)
    autoscaling = boto3.client("autoscaling", region_name=REGION)
    template = ec2.create_launch_template(
        LaunchTemplateName=GROUP, LaunchTemplateData={"ImageId": STAND_IN_AMI}
    )
    subnets = ",".join(s["SubnetId"] for s in ec2.describe_subnets()["Subnets"][:2])
    autoscaling.create_auto_scaling_group(
        AutoScalingGroupName=GROUP,
        MinSize=0,
        MaxSize=1,
        DesiredCapacity=1,
        VPCZoneIdentifier=subnets,
        LaunchTemplate={"LaunchTemplateId": template["LaunchTemplate"]["LaunchTemplateId"], "Version": "1"},
    )
    s3 = boto3.client("s3", region_name=REGION)
    s3.create_bucket(Bucket=BUCKET)
    sns = boto3.client("sns", region_name=REGION)
    topic = sns.create_topic(Name=f"{STACK}-alerts")["TopicArn"]
    sqs = boto3.client("sqs", region_name=REGION)
    queue_url = sqs.create_queue(QueueName="alerts")["QueueUrl"]
    queue_arn = sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["QueueArn"])["Attributes"][
        "QueueArn"
    ]
    sns.subscribe(TopicArn=topic, Protocol="sqs", Endpoint=queue_arn)
    function = {
        service: record_as(boto3.client(service, region_name=REGION), CAPACITY_FALLBACK)
        for service in ("autoscaling", "s3", "sns")
    }
    yield World(
        autoscaling, s3, sqs, queue_url, CostCap(max_cost_usd=25.0, bucket=BUCKET, topic_arn=topic), function
    )


def test_at_the_cap_the_group_goes_to_zero_and_the_topic_gets_one_line(world: World) -> None:
    world.put("state/current-job.json", {"job_id": JOB, "since": _iso(NOW)})
    world.put(f"jobs/{JOB}/state/ledger.json", ledger(25.0))
    result = world.tick()
    assert result["action"] == CAP_STOP and result["job_id"] == JOB
    assert world.desired() == 0
    (line,) = world.lines()
    assert f"job {JOB} reached 25.00 USD of its 25 USD cap" in line and "trainstack:maxCostUsd" in line
    # Five minutes later: the group is at zero already, so nothing is done and nothing is said again.
    assert world.tick(NOW + timedelta(minutes=5))["action"] == STAY
    assert world.lines() == []


@pytest.mark.parametrize("status", ["cost_cap", "completed", "cancelled", "failed", "queued"])
def test_a_job_the_agent_already_ended_is_left_to_it(world: World, status: str) -> None:
    # The agent's own cap wrote `cost_cap` and is notifying, or it moved on to the next queued job on this
    # instance: scaling the group to zero now would notify twice or stop the next job.
    world.put("state/current-job.json", {"job_id": JOB})
    world.put(f"jobs/{JOB}/state/ledger.json", {**ledger(50.0), "status": status})
    assert world.tick()["action"] == STAY
    assert world.desired() == 1 and world.lines() == []


def test_the_statuses_left_alone_are_every_status_of_the_contract_but_the_billing_ones() -> None:
    billing = {JobStatus.WAITING_FOR_DATA.value, JobStatus.RUNNING.value}
    assert {status.value for status in IDLE_STATUSES} == {status.value for status in JobStatus} - billing


@pytest.mark.parametrize("status", ["waiting_for_data", "runing", None])
def test_a_job_still_billing_or_of_a_status_unknown_here_is_capped(world: World, status: str | None) -> None:
    # Never disarmed by a status this function does not know (a newer agent's, a damaged ledger's).
    world.put("state/current-job.json", {"job_id": JOB})
    world.put(f"jobs/{JOB}/state/ledger.json", {**ledger(50.0), "status": status})
    assert world.tick()["action"] == CAP_STOP
    assert world.desired() == 0 and len(world.lines()) == 1


def test_under_the_cap_nothing_happens(world: World) -> None:
    world.put("state/current-job.json", {"job_id": JOB})
    world.put(f"jobs/{JOB}/state/ledger.json", ledger(24.99))
    assert world.tick()["action"] == STAY
    assert world.desired() == 1 and world.lines() == []


def test_a_ledger_its_agent_stopped_updating_still_counts_up(world: World) -> None:
    """A wedged agent (or one a job starved) leaves the ledger at 20 USD; its open life at 2 USD/h since
    three hours ago is 26 USD now."""
    world.put("state/current-job.json", {"job_id": JOB})
    world.put(
        f"jobs/{JOB}/state/ledger.json", ledger(20.0, running_since=NOW - timedelta(hours=3), price=2.0)
    )
    assert world.tick()["action"] == CAP_STOP
    assert world.desired() == 0


def test_no_current_job_or_no_ledger_yet_is_quiet(world: World, caplog: pytest.LogCaptureFixture) -> None:
    """A new stack, then a new job before its first instance wrote its ledger: both reads are NoSuchKey
    (the role may list exactly these keys, so AWS says NoSuchKey too: the session's IAM check holds these
    recorded reads to that), nothing to cap, and not one error line every five minutes."""
    with caplog.at_level("INFO"):
        assert world.tick()["action"] == STAY
        world.put("state/current-job.json", {"job_id": JOB})
        assert world.tick()["action"] == STAY
    assert world.desired() == 1
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    assert not any("cost_cap_unreadable" in r.getMessage() for r in caplog.records)


def test_a_ledger_the_function_is_refused_never_stops_the_spot_fallback(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    """A real refusal (the role's statements changed, the bucket policy or the key refuses): the cap check
    says so loudly, naming what to check, and the fallback decision still runs."""

    class Refusing:
        exceptions = world.function["s3"].exceptions

        def get_object(self, **_: Any) -> Any:
            raise ClientError({"Error": {"Code": "AccessDenied", "Message": "Access Denied"}}, "GetObject")

    settings = Settings(group_name=GROUP, fallback_minutes=0, spot_on_demand_percentage=0)
    with caplog.at_level("ERROR"):
        result = handler.run(
            {}, world.function["autoscaling"], settings, NOW, cost_cap=world.cap, s3=Refusing(),
            sns=world.function["sns"],
        )  # fmt: skip
    assert result["action"] == STAY and "group not found" not in result["reason"]
    (line,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert "cost_cap_unreadable" in line and "AccessDenied" in line and "s3:ListBucket" in line
    assert world.desired() == 1


def test_a_corrupt_ledger_is_loud_and_the_fallback_still_decides(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    world.put("state/current-job.json", {"job_id": JOB})
    world.s3.put_object(Bucket=BUCKET, Key=f"jobs/{JOB}/state/ledger.json", Body=b'{"total_cost_usd": 3')
    with caplog.at_level("ERROR"):
        result = world.tick()
    assert result["action"] == STAY and "fallback disabled" in result["reason"]  # the decision's own reason
    assert any("cost_cap_unreadable" in r.getMessage() for r in caplog.records)
    assert world.desired() == 1


def test_a_pointer_naming_no_job_id_is_never_turned_into_a_key(world: World) -> None:
    world.put("state/current-job.json", {"job_id": "../../code/x"})
    assert world.tick()["action"] == STAY


def test_the_legacy_job_reads_the_stacks_own_ledger(world: World) -> None:
    world.put("state/current-job.json", {"job_id": "legacy"})
    world.put("state/ledger.json", ledger(30.0))
    assert world.tick()["action"] == CAP_STOP


def test_the_handler_reads_the_cap_from_its_environment(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in {
        "GROUP_NAME": GROUP,
        "FALLBACK_MINUTES": "0",
        "SPOT_ON_DEMAND_PERCENTAGE": "0",
        "MAX_COST_USD": "25",
        "BUCKET": BUCKET,
        "TOPIC_ARN": world.cap.topic_arn,
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(handler.boto3, "client", lambda service: world.function[service])
    world.put("state/current-job.json", {"job_id": JOB})
    world.put(f"jobs/{JOB}/state/ledger.json", ledger(100.0))
    assert (
        handler.handler({"source": "aws.events", "detail-type": "Scheduled Event"}, None)["action"]
        == CAP_STOP
    )
    assert CostCap.from_env({"GROUP_NAME": GROUP}) is None


def test_estimated_cost_adds_only_open_priced_lives() -> None:
    raw = ledger(10.0, running_since=NOW - timedelta(hours=2), price=1.5)
    raw["lives"].append({**raw["lives"][0], "outcome": "completed"})
    raw["lives"].append({**raw["lives"][0], "price_usd_per_hour": None})
    assert estimated_cost(Ledger.from_json(raw), NOW) == pytest.approx(13.0)
    assert estimated_cost(Ledger.from_json({"total_cost_usd": 4.0}), NOW) == 4.0
    # An open life whose instance the group no longer has died without a word: it bills nothing more.
    gone = {**raw["lives"][0], "instance_id": "i-0gone"}
    alone = Ledger.from_json({"total_cost_usd": 10.0, "lives": [gone]})
    assert estimated_cost(alone, NOW, {"i-0alive"}) == 10.0
    assert estimated_cost(alone, NOW, {"i-0gone"}) == pytest.approx(13.0)


# -- the spot fallback's decision, beside the cap in the same function ------------------------------------
# Pure (the group and its launches in, an action and the reason out); the reason is the one line an operator
# reads in the function's log to learn why the group moved or did not: each situation gives its own line.


SPOT = Settings(group_name=GROUP, fallback_minutes=15, spot_on_demand_percentage=0)


def launched(minutes_ago: float, *, ok: bool) -> Launch:
    return Launch(started_at=NOW - timedelta(minutes=minutes_ago), succeeded=ok)


@pytest.mark.parametrize(
    "group, launches, decision",
    [
        (
            Group(desired=1, active=1, on_demand_percentage=100),
            [launched(30, ok=True)],
            Decision(STAY, "on-demand instance running; spot is tried again at the next launch"),
        ),
        (
            Group(desired=0, active=0, on_demand_percentage=100),
            [],
            Decision(RETURN_TO_SPOT, "group at zero: the next launch tries spot first"),
        ),
        (
            Group(desired=1, active=0, on_demand_percentage=100),
            [launched(1, ok=True), launched(40, ok=False)],
            Decision(RETURN_TO_SPOT, "the on-demand life ended and a launch is due: spot first"),
        ),
        (
            Group(desired=1, active=0, on_demand_percentage=100),
            [launched(1, ok=False)],
            Decision(STAY, "waiting for the on-demand launch"),
        ),
        (
            Group(desired=1, active=0, on_demand_percentage=100),
            [],
            Decision(STAY, "waiting for the on-demand launch"),
        ),
    ],
    ids=["on-demand-running", "at-zero", "on-demand-ended", "on-demand-launch-failed", "nothing-launched"],
)
def test_in_fallback_each_situation_says_why_in_its_own_line(
    group: Group, launches: list[Launch], decision: Decision
) -> None:
    assert decide(group, launches, NOW, SPOT) == decision
