"""`trainstack dev up/down/destroy/status` against moto: the box comes from the stack's template, in its
workspace's zone, and the workspace outlives every box (down, spot loss) until `dev destroy`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from botocore.exceptions import ClientError

from bootstrap.devbox.heartbeat import HEARTBEAT_KEY, Heartbeat
from demo.stack import STAND_IN_AMI
from tests.cli.conftest import BUCKET, REGION, Deployed, Result
from trainstack.aws import Clients
from trainstack.dev.instances import DEV_TAG
from trainstack.dev.lifecycle import IDLE_MINUTES_TAG
from trainstack.dev.workspace import WORKSPACE_TAG

DEV_NAME = "trainstack-test-dev"


class OnlineSessionManager:
    """SSM as it answers once the box's agent registered (moto does not link SSM to its instances)."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def describe_instance_information(self, **request: Any) -> dict[str, Any]:
        self.asked += request["Filters"][0]["Values"]
        return {"InstanceInformationList": [{"PingStatus": "Online"}]}


class NoCatalogue:
    """The Price List API without this product: status falls back to the built-in on-demand table."""

    def get_products(self, **_: Any) -> dict[str, Any]:
        return {"PriceList": []}


@dataclass
class DevStack:
    deployed: Deployed
    template_id: str
    security_group: str
    subnets: list[dict[str, Any]]
    ssm: OnlineSessionManager

    def dev(self, *argv: str) -> Result:
        clients = Clients(REGION, overrides={"ssm": self.ssm, "pricing": NoCatalogue()})
        return self.deployed.run("dev", *argv, clients=clients)

    def ec2(self) -> Any:
        return self.deployed.ec2()

    def instance(self, instance_id: str) -> dict[str, Any]:
        return dict(
            self.ec2().describe_instances(InstanceIds=[instance_id])["Reservations"][0]["Instances"][0]
        )

    def workspaces(self) -> list[dict[str, Any]]:
        return list(
            self.ec2().describe_volumes(Filters=[{"Name": f"tag:{WORKSPACE_TAG}", "Values": [DEV_NAME]}])[
                "Volumes"
            ]
        )


def _tags(resource: dict[str, Any]) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in resource.get("Tags", [])}


@pytest.fixture()
def dev_stack(deployed: Deployed) -> DevStack:
    """The deployed stack with trainstack:devBox on: the dev template (as infra/devbox.py declares its
    baseline) and the outputs that name it."""
    ec2 = deployed.ec2()
    subnets = ec2.describe_subnets()["Subnets"][:2]
    group = ec2.create_security_group(
        GroupName="trainstack-test-instances", Description="no inbound", VpcId=subnets[0]["VpcId"]
    )["GroupId"]
    template_id = ec2.create_launch_template(
        LaunchTemplateName=DEV_NAME,
        LaunchTemplateData={
            "ImageId": STAND_IN_AMI,
            "InstanceType": "g6.xlarge",
            "InstanceInitiatedShutdownBehavior": "terminate",
            "MetadataOptions": {
                "HttpTokens": "required",
                "HttpPutResponseHopLimit": 1,
                "InstanceMetadataTags": "enabled",
            },
            "NetworkInterfaces": [
                {
                    "DeviceIndex": 0,
                    "Groups": [group],
                    "AssociatePublicIpAddress": False,
                    "DeleteOnTermination": True,
                }
            ],
            "TagSpecifications": [
                {"ResourceType": "instance", "Tags": [{"Key": DEV_TAG, "Value": DEV_NAME}]}
            ],
        },
    )["LaunchTemplate"]["LaunchTemplateId"]
    outputs = {
        **deployed.outputs,
        "dev_template_id": template_id,
        "dev_box_name": DEV_NAME,
        "dev_subnet_ids": [s["SubnetId"] for s in subnets],
    }
    deployed.outputs_file.write_text(json.dumps(outputs), encoding="utf-8")
    return DevStack(deployed, template_id, group, subnets, OnlineSessionManager())


def _up(dev_stack: DevStack, *flags: str) -> dict[str, Any]:
    result = dev_stack.dev("up", "--json", *flags)
    assert result.code == 0, result.err
    return dict(result.json())


def test_up_launches_from_the_template_in_the_workspace_zone_with_the_workspace_attached(
    dev_stack: DevStack,
) -> None:
    up = _up(dev_stack)

    instance = dev_stack.instance(up["instance_id"])
    tags = _tags(instance)
    assert tags["aws:ec2launchtemplate:id"] == dev_stack.template_id
    assert tags[DEV_TAG] == DEV_NAME and tags[IDLE_MINUTES_TAG] == "60"
    assert instance["InstanceType"] == "g6.xlarge"  # the stack's first type
    assert instance.get("InstanceLifecycle") != "spot"  # on-demand unless --spot
    assert [g["GroupId"] for g in instance["NetworkInterfaces"][0]["Groups"]] == [dev_stack.security_group]
    [volume] = dev_stack.workspaces()
    assert up["workspace_created"] is True and up["workspace_volume_id"] == volume["VolumeId"]
    assert tags[WORKSPACE_TAG] == volume["VolumeId"]  # the box finds its workspace through this tag
    assert volume["Encrypted"] and volume["KmsKeyId"] == dev_stack.deployed.kms_key_arn
    assert volume["VolumeType"] == "gp3" and volume["Size"] == 100
    assert volume["AvailabilityZone"] == instance["Placement"]["AvailabilityZone"]
    assert [a["InstanceId"] for a in volume["Attachments"]] == [up["instance_id"]]
    assert dev_stack.ssm.asked == [up["instance_id"]] and up["session_manager_online"] is True


def test_up_spot_with_another_type_asks_for_one_time_spot(dev_stack: DevStack) -> None:
    up = _up(dev_stack, "--spot", "--type", "g5.xlarge", "--idle-minutes", "0", "--workspace-gb", "20")

    instance = dev_stack.instance(up["instance_id"])
    assert instance["InstanceLifecycle"] == "spot" and instance["InstanceType"] == "g5.xlarge"
    assert _tags(instance)[IDLE_MINUTES_TAG] == "0"
    assert dev_stack.workspaces()[0]["Size"] == 20


def test_up_when_a_box_is_up_starts_no_second_one(dev_stack: DevStack) -> None:
    first = _up(dev_stack)
    again = dev_stack.dev("up")

    assert again.code == 0 and f"dev box {first['instance_id']} is already up" in again.out
    running = dev_stack.ec2().describe_instances(
        Filters=[
            {"Name": f"tag:{DEV_TAG}", "Values": [DEV_NAME]},
            {"Name": "instance-state-name", "Values": ["running"]},
        ]
    )["Reservations"]
    assert sum(len(r["Instances"]) for r in running) == 1


def test_down_keeps_the_workspace_and_the_next_up_reattaches_it(dev_stack: DevStack) -> None:
    first = _up(dev_stack)
    down = dev_stack.dev("down")

    assert down.code == 0 and f"workspace {first['workspace_volume_id']} kept" in down.out
    assert dev_stack.instance(first["instance_id"])["State"]["Name"] in ("shutting-down", "terminated")
    [volume] = dev_stack.workspaces()
    assert volume["State"] == "available"

    second = _up(dev_stack)
    assert second["instance_id"] != first["instance_id"]
    assert (
        second["workspace_volume_id"] == first["workspace_volume_id"] and second["workspace_created"] is False
    )
    assert second["availability_zone"] == first["availability_zone"]
    [volume] = dev_stack.workspaces()
    assert [a["InstanceId"] for a in volume["Attachments"]] == [second["instance_id"]]


def test_after_a_spot_loss_up_continues_on_the_same_workspace(dev_stack: DevStack) -> None:
    first = _up(dev_stack, "--spot")
    # AWS reclaims the box behind the CLI's back.
    dev_stack.ec2().terminate_instances(InstanceIds=[first["instance_id"]])

    second = _up(dev_stack, "--spot")

    assert second["workspace_volume_id"] == first["workspace_volume_id"]
    assert len(dev_stack.workspaces()) == 1


def test_workspace_decides_the_zone(dev_stack: DevStack) -> None:
    zone = dev_stack.subnets[1]["AvailabilityZone"]
    kept = dev_stack.ec2().create_volume(
        AvailabilityZone=zone,
        Size=50,
        VolumeType="gp3",
        Encrypted=True,
        TagSpecifications=[{"ResourceType": "volume", "Tags": [{"Key": WORKSPACE_TAG, "Value": DEV_NAME}]}],
    )["VolumeId"]

    up = _up(dev_stack)

    assert up["workspace_volume_id"] == kept and up["availability_zone"] == zone
    assert dev_stack.instance(up["instance_id"])["SubnetId"] == dev_stack.subnets[1]["SubnetId"]


def test_destroy_terminates_the_box_and_deletes_the_workspace(dev_stack: DevStack) -> None:
    up = _up(dev_stack)
    dev_stack.deployed.s3().put_object(Bucket=BUCKET, Key=HEARTBEAT_KEY, Body=b"{}")

    unconfirmed = dev_stack.dev("destroy")
    assert (
        unconfirmed.code == 1 and "pass --yes" in unconfirmed.err and len(unconfirmed.err.splitlines()) == 1
    )
    assert len(dev_stack.workspaces()) == 1  # nothing deleted without confirmation

    destroyed = dev_stack.dev("destroy", "--yes")

    assert destroyed.code == 0, destroyed.err
    assert dev_stack.workspaces() == []
    assert dev_stack.instance(up["instance_id"])["State"]["Name"] in ("shutting-down", "terminated")
    assert "Contents" not in dev_stack.deployed.s3().list_objects_v2(Bucket=BUCKET, Prefix="dev/")
    assert "nothing to destroy" in dev_stack.dev("destroy", "--yes").out


def test_status_shows_type_market_cost_and_idle_time_left(dev_stack: DevStack) -> None:
    up = _up(dev_stack)
    beat = Heartbeat(
        instance_id=up["instance_id"],
        sampled_at=datetime.now(timezone.utc),
        idle_seconds=600,
        idle_limit_minutes=60,
    )
    dev_stack.deployed.s3().put_object(Bucket=BUCKET, Key=HEARTBEAT_KEY, Body=beat.to_json().encode())

    shown = dev_stack.dev("status")
    status = dev_stack.dev("status", "--json").json()

    assert shown.code == 0, shown.err
    assert f"{up['instance_id']} running, g6.xlarge on-demand" in shown.out
    assert "idle 10m 00s; stops in 49m" in shown.out or "idle 10m 00s; stops in 50m" in shown.out
    assert status["instance"]["lifecycle"] == "on-demand" and status["usd_per_hour"] == pytest.approx(0.8048)
    assert status["cost_usd"] is not None and status["cost_usd"] >= 0
    assert 2900 < status["idle_left_seconds"] <= 3000
    assert status["workspace"]["attached_to"] == up["instance_id"]


def test_status_ignores_an_earlier_box_heartbeat_and_a_corrupt_one(dev_stack: DevStack) -> None:
    _up(dev_stack)
    old = Heartbeat(instance_id="i-0earlier", sampled_at=datetime.now(timezone.utc) - timedelta(hours=3),
                    idle_seconds=5, idle_limit_minutes=60)  # fmt: skip
    s3 = dev_stack.deployed.s3()
    s3.put_object(Bucket=BUCKET, Key=HEARTBEAT_KEY, Body=old.to_json().encode())
    assert dev_stack.dev("status", "--json").json()["idle_left_seconds"] is None

    s3.put_object(Bucket=BUCKET, Key=HEARTBEAT_KEY, Body=b"{not json")
    corrupt = dev_stack.dev("status")
    assert corrupt.code == 0 and "idle: -" in corrupt.out and "not a dev box heartbeat" in corrupt.out


def test_status_without_a_box_says_how_to_start_one(dev_stack: DevStack) -> None:
    shown = dev_stack.dev("status")
    assert shown.code == 0 and "not up (no compute billing)" in shown.out and "none yet" in shown.out


@pytest.mark.parametrize("command", ["up", "down", "status"])
def test_a_stack_without_the_dev_template_gets_one_line_with_the_fix(
    deployed: Deployed, command: str
) -> None:
    result = deployed.run("dev", command)
    assert result.code == 1
    assert len(result.err.splitlines()) == 1 and "pulumi config set trainstack:devBox true" in result.err


@pytest.mark.parametrize(
    ("flags", "named"),
    [(["--idle-minutes", "-5"], "--idle-minutes -5"), (["--workspace-gb", "0"], "--workspace-gb 0")],
)
def test_bad_up_options_are_one_line_naming_the_option(
    dev_stack: DevStack, flags: list[str], named: str
) -> None:
    result = dev_stack.dev("up", *flags)
    assert result.code == 1 and len(result.err.splitlines()) == 1 and named in result.err
    assert dev_stack.workspaces() == []


def test_up_refuses_a_type_the_stack_zones_do_not_offer(dev_stack: DevStack) -> None:
    result = dev_stack.dev("up", "--type", "x9.nonexistent")
    assert result.code == 1 and "--type x9.nonexistent: not offered" in result.err
    assert dev_stack.workspaces() == []  # refused before anything is created


class NoSpotCapacity:
    """moto's EC2, except that RunInstances finds no spot capacity, as AWS answers in a busy zone."""

    def __init__(self, ec2: Any) -> None:
        self._ec2 = ec2

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ec2, name)

    def run_instances(self, **request: Any) -> Any:
        error = {"Error": {"Code": "InsufficientInstanceCapacity", "Message": "no capacity"}}
        raise ClientError(error, "RunInstances")  # type: ignore[arg-type]


def test_no_spot_capacity_is_one_line_with_the_way_out_and_the_workspace_kept(dev_stack: DevStack) -> None:
    clients = Clients(REGION, overrides={"ssm": dev_stack.ssm, "ec2": NoSpotCapacity(dev_stack.ec2())})
    result = dev_stack.deployed.run("dev", "up", "--spot", clients=clients)

    assert result.code == 1 and len(result.err.splitlines()) == 1
    assert "no spot g6.xlarge in us-east-1a now (InsufficientInstanceCapacity)" in result.err
    assert "--on-demand" in result.err
    [volume] = dev_stack.workspaces()  # created once, reused by the next try
    assert volume["State"] == "available"
