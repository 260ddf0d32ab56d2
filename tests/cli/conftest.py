"""A deployed-looking stack on the moto server: project files, outputs, bucket, group, log group."""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest

from demo.stack import STAND_IN_AMI
from trainstack.aws import Clients
from trainstack.cli import main

REPO = Path(__file__).resolve().parents[2]
REGION = "us-east-1"
STACK = "test"
BUCKET = "trainstack-test-data"
GROUP = "trainstack-test-gpu"
LOG_GROUP = "/trainstack/test"
AMI_PARAMETER = "/trainstack-test/dlami/ami-id"


@dataclass
class Result:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


def aws_client(service: str) -> Any:
    """The stack fixtures' client of `service` in REGION at the endpoint this test points at (the worker's
    moto server, or a test's fault proxy): made once per endpoint, never handed to a test (tests hook their
    clients' events). An EC2 client costs about 19 ms of CPU to make, and a stack takes six."""
    return _client(service, os.environ.get("AWS_ENDPOINT_URL"))


@functools.cache
def _client(service: str, endpoint: str | None) -> Any:
    return boto3.client(service, region_name=REGION)  # type: ignore[call-overload]


@dataclass
class Deployed:
    """What `pulumi up` would have created, and how to run the CLI against it."""

    project: Path
    outputs_file: Path
    outputs: dict[str, Any]
    kms_key_arn: str
    run: Callable[..., Result]

    def s3(self) -> Any:
        return boto3.client("s3", region_name=REGION)  # a client of its own: tests hook its events

    def autoscaling(self) -> Any:
        return boto3.client("autoscaling", region_name=REGION)

    def ec2(self) -> Any:
        return boto3.client("ec2", region_name=REGION)

    def put_state(self, name: str, document: dict[str, Any]) -> None:
        self.s3().put_object(Bucket=BUCKET, Key=f"state/{name}", Body=json.dumps(document).encode())

    def launch_instance(self, *, spot: bool = True, az_index: int = 0) -> str:
        """Start an instance and attach it to the group, as the group would after a launch."""
        ec2 = self.ec2()
        subnet = ec2.describe_subnets()["Subnets"][az_index]
        market = {"InstanceMarketOptions": {"MarketType": "spot"}} if spot else {}
        image = STAND_IN_AMI
        instance = ec2.run_instances(
            ImageId=image,
            MinCount=1,
            MaxCount=1,
            InstanceType="g6.xlarge",
            SubnetId=subnet["SubnetId"],
            **market,
        )["Instances"][0]["InstanceId"]
        self.autoscaling().attach_instances(InstanceIds=[instance], AutoScalingGroupName=GROUP)
        return str(instance)

    def group(self) -> dict[str, Any]:
        groups = self.autoscaling().describe_auto_scaling_groups(AutoScalingGroupNames=[GROUP])
        return dict(groups["AutoScalingGroups"][0])


def write_project(root: Path, config: dict[str, Any]) -> Path:
    """The project's real Pulumi.yaml (its schema holds the defaults) and Pulumi.<stack>.yaml with values."""
    shutil.copyfile(REPO / "Pulumi.yaml", root / "Pulumi.yaml")
    (root / f"Pulumi.{STACK}.yaml").write_text(json.dumps({"config": config}), encoding="utf-8")
    return root


@pytest.fixture()
def cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Callable[..., Result]:
    """Run `trainstack ARGS...` in this process; returns exit code, stdout and stderr."""
    # Wide enough that rich never wraps or truncates a table cell the tests look for.
    monkeypatch.setenv("COLUMNS", "220")

    def run(*argv: str, clients: Clients | None = None) -> Result:
        capsys.readouterr()
        code = main(list(argv), clients=clients)
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)

    return run


def create_stack_resources(bucket: str = BUCKET, group: str = GROUP, log_group: str = LOG_GROUP) -> str:
    """What `pulumi up` makes that the CLI talks to, in moto: the stack's key, bucket, template, job group
    (at zero, two at most) and log group. Returns the key's ARN."""
    kms_key_arn = str(aws_client("kms").create_key()["KeyMetadata"]["Arn"])
    aws_client("s3").create_bucket(Bucket=bucket)
    create_group(group)
    aws_client("logs").create_log_group(logGroupName=log_group)
    return kms_key_arn


def create_group(group: str, instance_type: str = "g6.xlarge", max_size: int = 2) -> None:
    """A job group at zero on its own launch template, as one pool's `pulumi up` makes it."""
    ec2 = aws_client("ec2")
    subnets = [s["SubnetId"] for s in ec2.describe_subnets()["Subnets"][:2]]
    data: Any = {"ImageId": STAND_IN_AMI, "InstanceType": instance_type}
    ec2.create_launch_template(LaunchTemplateName=f"{group}-lt", LaunchTemplateData=data)
    aws_client("autoscaling").create_auto_scaling_group(
        AutoScalingGroupName=group,
        MinSize=0,
        MaxSize=max_size,
        DesiredCapacity=0,
        LaunchTemplate={"LaunchTemplateName": f"{group}-lt", "Version": "$Latest"},
        VPCZoneIdentifier=",".join(subnets),
    )


@pytest.fixture()
def deployed(aws: Any, tmp_path: Path, cli: Callable[..., Result]) -> Deployed:
    kms_key_arn = create_stack_resources()
    project = write_project(
        tmp_path,
        {"aws:region": REGION, "trainstack:instanceCount": 2, "trainstack:amiParameter": AMI_PARAMETER},
    )
    outputs = {
        "region": REGION,
        "bucket_name": BUCKET,
        "data_prefix": "data/",
        "code_prefix": "code/",
        "checkpoints_prefix": "checkpoints/",
        "results_prefix": "results/",
        "state_prefix": "state/",
        "group_name": GROUP,
        "instance_count": 2,
        "instance_types": ["g6.xlarge", "g5.xlarge"],
        "log_group_name": LOG_GROUP,
        "kms_key_arn": kms_key_arn,
    }
    outputs_file = tmp_path / "outputs.json"
    outputs_file.write_text(json.dumps(outputs), encoding="utf-8")

    def run(*argv: str, clients: Clients | None = None) -> Result:
        where = ["--cwd", str(project), "--stack", STACK, "--outputs", str(outputs_file)]
        return cli(*argv, *where, clients=clients)

    return Deployed(project, outputs_file, outputs, kms_key_arn, run)
