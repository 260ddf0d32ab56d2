"""The stack's AWS resources as `pulumi up` would make them, created in the embedded moto server."""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import boto3
from botocore.config import Config

from bootstrap.agent_config import AgentConfig, Prefixes

_RETRIES = Config(retries={"mode": "standard"})
# boto3's default session parses botocore's models once and shares them with every client made from it,
# but it is not thread-safe: clients are made under this lock (the IMDS simulator and tests ask at once).
_client_lock = threading.RLock()


# Every client made, by service, region and the endpoint it was made for: a process that creates many stacks
# (a test worker makes one per test) makes each client once. Making one costs more CPU than most calls it
# makes (an EC2 client 13 ms, a stack's seven 30 ms); nothing hooks the events of these clients.
_made: dict[tuple[str, str, str | None], Any] = {}


def _client(service: str, region: str) -> Any:
    key = (service, region, os.environ.get("AWS_ENDPOINT_URL"))
    with _client_lock:
        if key not in _made:
            _made[key] = boto3.client(service, region_name=region, config=_RETRIES)  # type: ignore[call-overload]
        return _made[key]


# Stands in for the DLAMI: moto does not check AMI ids (MOTO_ENABLE_AMI_VALIDATION is off by default).
STAND_IN_AMI = "ami-12c6146b"


@dataclass(frozen=True)
class LocalStack:
    """Names of the embedded stack's resources, plus an SQS queue subscribed to the topic to read alerts."""

    name: str
    region: str
    bucket: str
    kms_key_arn: str
    topic_arn: str
    group_name: str
    log_group: str
    alerts_queue_url: str
    # One client per service, made once: the simulated IMDS asks the group for this instance's lifecycle
    # state at every agent poll, and building a client costs more CPU than the call it makes.
    _clients: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def client(self, service: str) -> Any:
        with _client_lock:
            if service not in self._clients:
                self._clients[service] = _client(service, self.region)
            return self._clients[service]

    def agent_config(self, **overrides: Any) -> AgentConfig:
        values: dict[str, Any] = {
            "region": self.region,
            "bucket": self.bucket,
            "group_name": self.group_name,
            "topic_arn": self.topic_arn,
            "log_group": self.log_group,
            "stack": self.name,
            "prefixes": Prefixes(),
            "gpu_required": False,
            **overrides,
        }
        return AgentConfig(**values)

    def group(self) -> dict[str, Any]:
        groups = self.client("autoscaling").describe_auto_scaling_groups(
            AutoScalingGroupNames=[self.group_name]
        )
        found: dict[str, Any] = groups["AutoScalingGroups"][0]
        return found

    def instance_ids(self) -> list[str]:
        return [i["InstanceId"] for i in self.group()["Instances"]]

    def lifecycle_state(self, instance_id: str) -> str:
        """What IMDS `autoscaling/target-lifecycle-state` says: Terminated once the group let go of it."""
        return "InService" if instance_id in self.instance_ids() else "Terminated"

    def alerts(self) -> list[dict[str, str]]:
        """SNS messages delivered so far (each {"Subject", "Message"}), consumed from the queue."""
        sqs = self.client("sqs")
        found: list[dict[str, str]] = []
        while True:
            batch = sqs.receive_message(QueueUrl=self.alerts_queue_url, MaxNumberOfMessages=10).get(
                "Messages", []
            )
            if not batch:
                return found
            for message in batch:
                body = json.loads(message["Body"])
                found.append({"Subject": body.get("Subject", ""), "Message": body.get("Message", "")})
                sqs.delete_message(QueueUrl=self.alerts_queue_url, ReceiptHandle=message["ReceiptHandle"])

    def read_json(self, key: str) -> dict[str, Any] | None:
        s3 = self.client("s3")
        try:
            value = json.loads(s3.get_object(Bucket=self.bucket, Key=key)["Body"].read())
        except s3.exceptions.NoSuchKey:
            return None
        return value if isinstance(value, dict) else None


@dataclass
class EndState:
    """What the stack holds once the story is over: the checks read these."""

    metrics: dict[str, Any]
    artifacts: list[str]
    desired_capacity: int
    alerts: list[dict[str, str]]
    ledger: dict[str, Any]


def end_state(stack: LocalStack) -> EndState:
    listing = stack.client("s3").list_objects_v2(Bucket=stack.bucket, Prefix="results/").get("Contents", [])
    return EndState(
        metrics=stack.read_json("results/metrics.json") or {},
        artifacts=[f"s3://{stack.bucket}/{obj['Key']}" for obj in listing],
        desired_capacity=int(stack.group()["DesiredCapacity"]),
        alerts=stack.alerts(),
        ledger=stack.read_json("state/ledger.json") or {},
    )


def create_stack(name: str = "trainstack-demo", region: str = "us-east-1", desired: int = 1) -> LocalStack:
    """Bucket (SSE-KMS with the stack key, versioned, private), topic, log group, launch template, group."""
    kms, s3, sns, sqs, logs, ec2, autoscaling = (
        _client(s, region) for s in ("kms", "s3", "sns", "sqs", "logs", "ec2", "autoscaling")
    )
    key_arn = kms.create_key(Description=f"{name} data key")["KeyMetadata"]["Arn"]
    kms.enable_key_rotation(KeyId=key_arn)
    bucket = f"{name}-data"
    s3.create_bucket(Bucket=bucket)
    s3.put_bucket_encryption(
        Bucket=bucket,
        ServerSideEncryptionConfiguration={
            "Rules": [
                {
                    "ApplyServerSideEncryptionByDefault": {
                        "SSEAlgorithm": "aws:kms",
                        "KMSMasterKeyID": key_arn,
                    },
                    "BucketKeyEnabled": True,
                }
            ]
        },
    )
    s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    s3.put_public_access_block(
        Bucket=bucket,
        PublicAccessBlockConfiguration={
            "BlockPublicAcls": True,
            "IgnorePublicAcls": True,
            "BlockPublicPolicy": True,
            "RestrictPublicBuckets": True,
        },
    )
    topic_arn = sns.create_topic(Name=f"{name}-alerts", Attributes={"KmsMasterKeyId": key_arn})["TopicArn"]
    queue_url = sqs.create_queue(QueueName=f"{name}-alerts-inbox")["QueueUrl"]
    queue_arn = sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["QueueArn"])["Attributes"][
        "QueueArn"
    ]
    sns.subscribe(TopicArn=topic_arn, Protocol="sqs", Endpoint=queue_arn)
    log_group = f"/trainstack/{name}"
    logs.create_log_group(logGroupName=log_group)
    vpc_id = ec2.create_vpc(CidrBlock="10.42.0.0/16")["Vpc"]["VpcId"]
    subnets = [
        ec2.create_subnet(VpcId=vpc_id, CidrBlock=f"10.42.{i}.0/24", AvailabilityZone=f"{region}{az}")[
            "Subnet"
        ]["SubnetId"]
        for i, az in enumerate("ab")
    ]
    template = f"{name}-instance"
    ec2.create_launch_template(
        LaunchTemplateName=template,
        LaunchTemplateData={
            "ImageId": STAND_IN_AMI,
            "InstanceType": "g6.xlarge",
            "MetadataOptions": {"HttpTokens": "required", "HttpPutResponseHopLimit": 1},
        },
    )
    group_name = f"{name}-gpu"
    autoscaling.create_auto_scaling_group(
        AutoScalingGroupName=group_name,
        LaunchTemplate={"LaunchTemplateName": template, "Version": "$Latest"},
        MinSize=0,
        MaxSize=max(1, desired),
        DesiredCapacity=desired,
        VPCZoneIdentifier=",".join(subnets),
        CapacityRebalance=True,
    )
    return LocalStack(name, region, bucket, key_arn, topic_arn, group_name, log_group, queue_url)
