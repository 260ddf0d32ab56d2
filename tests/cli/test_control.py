"""`trainstack stop` / `resume`: the stop request the agent reads, and the group's desired capacity."""

from __future__ import annotations

import json
from datetime import datetime

import boto3
from botocore.stub import Stubber

from trainstack.aws import Clients

from .conftest import BUCKET, GROUP, REGION, Deployed


def _control(deployed: Deployed) -> dict | None:
    try:
        body = deployed.s3().get_object(Bucket=BUCKET, Key="state/control.json")["Body"].read()
    except deployed.s3().exceptions.NoSuchKey:
        return None
    return json.loads(body)


def test_stop_while_training_leaves_scaling_to_the_agent_after_its_checkpoint(deployed: Deployed):
    deployed.launch_instance()

    result = deployed.run("stop")

    assert result.code == 0, result.err
    control = _control(deployed)
    assert control is not None and control["action"] == "stop" and control["requested_at"]
    # The agent must checkpoint first: the CLI does not pull the instance away under it.
    assert deployed.group()["DesiredCapacity"] == 1
    assert "the agent checkpoints" in result.out
    head = deployed.s3().head_object(Bucket=BUCKET, Key="state/control.json")
    assert head["ServerSideEncryption"] == "aws:kms"
    assert head["SSEKMSKeyId"] == deployed.kms_key_arn


def test_stop_with_nothing_in_service_scales_to_zero_at_once(deployed: Deployed):
    # FAKE at the client boundary: moto always fills a group at once, so the moment after a spot
    # interruption (desired 1, replacement not launched yet) is played by a stubbed Auto Scaling client.
    autoscaling = boto3.client("autoscaling", region_name=REGION)
    stub = Stubber(autoscaling)
    group = {
        "AutoScalingGroupName": GROUP,
        "MinSize": 0,
        "MaxSize": 2,
        "DesiredCapacity": 1,
        "DefaultCooldown": 300,
        "AvailabilityZones": ["us-east-1a"],
        "HealthCheckType": "EC2",
        "CreatedTime": datetime(2026, 1, 1),
        "Instances": [],
    }
    stub.add_response(
        "describe_auto_scaling_groups", {"AutoScalingGroups": [group]}, {"AutoScalingGroupNames": [GROUP]}
    )
    stub.add_response(
        "update_auto_scaling_group", {}, {"AutoScalingGroupName": GROUP, "MinSize": 0, "DesiredCapacity": 0}
    )
    stub.activate()

    result = deployed.run("stop", "--json", clients=Clients(None, overrides={"autoscaling": autoscaling}))

    assert result.code == 0, result.err
    report = result.json()
    assert report["in_service"] == 0
    assert report["scaled_to_zero_now"] is True
    stub.assert_no_pending_responses()
    assert _control(deployed) is not None


def test_resume_withdraws_the_stop_request_and_restores_the_instance_count(deployed: Deployed):
    deployed.run("stop")
    assert _control(deployed) is not None

    result = deployed.run("resume", "--json")

    assert result.code == 0, result.err
    assert _control(deployed) is None
    assert deployed.group()["DesiredCapacity"] == 2
    assert result.json()["desired"] == 2


def test_resume_after_repeated_failures_warns_before_burning_more_time(deployed: Deployed):
    deployed.put_state("ledger.json", {"status": "failed", "lives": [], "consecutive_failures": 3})
    result = deployed.run("resume")
    assert result.code == 0, result.err
    assert "desired 0 → 2" in result.out
    assert "the last 3 lives failed" in result.out
