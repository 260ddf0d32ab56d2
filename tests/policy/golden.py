"""A compliant stack, written as the engine sees it: every baseline control satisfied."""

from __future__ import annotations

import base64
import json

from tests.policy.harness import Resource

KEY_ARN = "arn:aws:kms:us-east-1:123456789012:key/1234abcd-12ab-34cd-56ef-1234567890ab"
BUCKET = "trainstack-dev-artifacts"
BUCKET_ARN = f"arn:aws:s3:::{BUCKET}"
VPC_ID = "vpc-0abc"
LOG_BUCKET = "trainstack-dev-access-logs"
LOG_BUCKET_ARN = f"arn:aws:s3:::{LOG_BUCKET}"
FLOW_LOG_GROUP = "/trainstack/dev/vpc-flow-logs"
FLOW_LOG_GROUP_ARN = f"arn:aws:logs:us-east-1:123456789012:log-group:{FLOW_LOG_GROUP}"
ACCOUNT = "123456789012"
SSM_CORE = "arn:aws:iam::aws:policy/AmazonSSMManagedInstanceCore"
# What the instance attaches instead of SSM core: the stack's own Session Manager policy (issue 24).
SESSION_MANAGER_POLICY = f"arn:aws:iam::{ACCOUNT}:policy/trainstack-dev-session-manager"
TOPIC_ARN = f"arn:aws:sns:us-east-1:{ACCOUNT}:trainstack-dev-alerts"
RULE_ARN = f"arn:aws:events:us-east-1:{ACCOUNT}:rule/trainstack-dev-capacity"

USER_DATA = """#cloud-config
write_files:
  - path: /etc/trainstack/agent.yaml
    content: |
      bucket: trainstack-dev-artifacts
      region: us-east-1
runcmd:
  - [python3, -m, bootstrap.agent, --config, /etc/trainstack/agent.yaml]
"""


def _document(*statements: dict[str, object]) -> str:
    return json.dumps({"Version": "2012-10-17", "Statement": list(statements)})


TLS_ONLY_POLICY = _document(
    {
        "Sid": "DenyInsecureTransport",
        "Effect": "Deny",
        "Principal": "*",
        "Action": "s3:*",
        "Resource": [BUCKET_ARN, f"{BUCKET_ARN}/*"],
        "Condition": {"Bool": {"aws:SecureTransport": "false"}},
    },
    {
        "Sid": "DenyUnencryptedUploads",
        "Effect": "Deny",
        "Principal": "*",
        "Action": "s3:PutObject",
        "Resource": f"{BUCKET_ARN}/*",
        "Condition": {"StringNotEquals": {"s3:x-amz-server-side-encryption": "aws:kms"}},
    },
)

INSTANCE_POLICY = _document(
    {
        "Effect": "Allow",
        "Action": ["s3:GetObject", "s3:PutObject"],
        "Resource": f"{BUCKET_ARN}/checkpoints/*",
    },
    {"Effect": "Allow", "Action": "s3:ListBucket", "Resource": BUCKET_ARN},
    {"Effect": "Allow", "Action": ["kms:Decrypt", "kms:GenerateDataKey"], "Resource": KEY_ARN},
    {"Effect": "Allow", "Action": "logs:PutLogEvents", "Resource": "*"},
)


KEY_POLICY = _document(
    {
        "Sid": "AccountAdministersKeyThroughIam",
        "Effect": "Allow",
        "Principal": {"AWS": f"arn:aws:iam::{ACCOUNT}:root"},
        "Action": ["kms:DescribeKey", "kms:PutKeyPolicy", "kms:Decrypt"],
        "Resource": "*",
    },
    {
        "Sid": "AutoScalingLaunchesEncryptedVolumes",
        "Effect": "Allow",
        "Principal": {"AWS": "*"},
        "Action": ["kms:Decrypt", "kms:GenerateDataKey"],
        "Resource": "*",
        "Condition": {
            "StringEquals": {"aws:PrincipalAccount": ACCOUNT},
            "ArnEquals": {
                "aws:PrincipalArn": f"arn:aws:iam::{ACCOUNT}:role/aws-service-role/autoscaling.amazonaws.com/"
                "AWSServiceRoleForAutoScaling"
            },
        },
    },
)

TOPIC_POLICY = _document(
    {
        "Sid": "EventBridgeRulesPublish",
        "Effect": "Allow",
        "Principal": {"Service": "events.amazonaws.com"},
        "Action": "sns:Publish",
        "Resource": TOPIC_ARN,
        "Condition": {
            "StringEquals": {"aws:SourceAccount": ACCOUNT},
            "ArnLike": {"aws:SourceArn": f"arn:aws:events:us-east-1:{ACCOUNT}:rule/*"},
        },
    }
)

ENDPOINT_POLICY = _document(
    {
        "Sid": "ThisStacksBucketOnly",
        "Effect": "Allow",
        "Principal": "*",
        "Action": ["s3:GetObject", "s3:PutObject"],
        "Resource": f"{BUCKET_ARN}/*",
    },
    {"Effect": "Allow", "Principal": "*", "Action": "s3:ListBucket", "Resource": BUCKET_ARN},
)


def compliant_stack() -> list[Resource]:
    """One of each resource type the pack reads, every property set the secure way."""
    return [
        Resource(
            "aws:kms/key:Key",
            "key",
            {"enableKeyRotation": True, "deletionWindowInDays": 7, "arn": KEY_ARN, "policy": KEY_POLICY},
        ),
        Resource("aws:ec2/vpc:Vpc", "vpc", {"cidrBlock": "10.42.0.0/16", "id": VPC_ID}),
        Resource(
            "aws:ec2/defaultSecurityGroup:DefaultSecurityGroup",
            "default-sg",
            {"vpcId": VPC_ID, "ingress": [], "egress": []},
            {"vpcId": ["vpc"]},
        ),
        Resource(
            "aws:ec2/flowLog:FlowLog",
            "flow-log",
            {
                "vpcId": VPC_ID,
                "trafficType": "ALL",
                "logDestinationType": "cloud-watch-logs",
                "logDestination": FLOW_LOG_GROUP_ARN,
            },
            {"vpcId": ["vpc"]},
        ),
        Resource(
            "aws:ec2/securityGroup:SecurityGroup",
            "instances",
            {
                "vpcId": VPC_ID,
                "ingress": [
                    {"protocol": "tcp", "fromPort": 22, "toPort": 22, "cidrBlocks": ["203.0.113.7/32"]},
                ],
                "egress": [{"protocol": "tcp", "fromPort": 443, "toPort": 443, "cidrBlocks": ["0.0.0.0/0"]}],
            },
        ),
        Resource(
            "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule",
            "ssh-from-office",
            {
                "securityGroupId": "sg-1",
                "ipProtocol": "tcp",
                "fromPort": 22,
                "toPort": 22,
                "cidrIpv4": "198.51.100.0/24",
            },
        ),
        Resource(
            "aws:ec2/launchTemplate:LaunchTemplate",
            "launch-template",
            {
                "id": "lt-1",
                "imageId": "resolve:ssm:/aws/service/deeplearning/ami/x86_64/oss-nvidia-driver-gpu-pytorch",
                "metadataOptions": {
                    "httpEndpoint": "enabled",
                    "httpTokens": "required",
                    "httpPutResponseHopLimit": 1,
                },
                "blockDeviceMappings": [
                    {
                        "deviceName": "/dev/sda1",
                        "ebs": {
                            "encrypted": "true",
                            "kmsKeyId": KEY_ARN,
                            "volumeSize": 150,
                            "volumeType": "gp3",
                        },
                    }
                ],
                "networkInterfaces": [{"associatePublicIpAddress": "true", "securityGroups": ["sg-1"]}],
                "userData": base64.b64encode(USER_DATA.encode()).decode(),
            },
        ),
        Resource(
            "aws:autoscaling/group:Group",
            "group",
            {
                "minSize": 0,
                "maxSize": 1,
                "vpcZoneIdentifiers": ["subnet-a", "subnet-b"],
                "capacityRebalance": True,
                "mixedInstancesPolicy": {
                    "instancesDistribution": {"spotAllocationStrategy": "price-capacity-optimized"},
                    "launchTemplate": {
                        "launchTemplateSpecification": {"launchTemplateId": "lt-1", "version": "$Latest"},
                        "overrides": [{"instanceType": "g6.xlarge"}, {"instanceType": "g5.xlarge"}],
                    },
                },
            },
        ),
        Resource(
            "aws:ebs/volume:Volume",
            "scratch",
            {"availabilityZone": "us-east-1a", "size": 100, "encrypted": True, "kmsKeyId": KEY_ARN},
        ),
        Resource("aws:s3/bucket:Bucket", "bucket", {"bucket": BUCKET, "id": BUCKET, "forceDestroy": False}),
        Resource(
            "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock",
            "bucket-public-access",
            {
                "bucket": BUCKET,
                "blockPublicAcls": True,
                "blockPublicPolicy": True,
                "ignorePublicAcls": True,
                "restrictPublicBuckets": True,
            },
            {"bucket": ["bucket"]},
        ),
        Resource(
            "aws:s3/bucketPolicy:BucketPolicy", "bucket-policy", {"bucket": BUCKET, "policy": TLS_ONLY_POLICY}
        ),
        Resource(
            "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration",
            "bucket-encryption",
            {
                "bucket": BUCKET,
                "rules": [
                    {
                        "applyServerSideEncryptionByDefault": {
                            "sseAlgorithm": "aws:kms",
                            "kmsMasterKeyId": KEY_ARN,
                        },
                        "bucketKeyEnabled": True,
                    }
                ],
            },
        ),
        Resource(
            "aws:s3/bucketVersioning:BucketVersioning",
            "bucket-versioning",
            {"bucket": BUCKET, "versioningConfiguration": {"status": "Enabled"}},
        ),
        Resource(
            "aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration",
            "bucket-lifecycle",
            {
                "bucket": BUCKET,
                "rules": [
                    {
                        "id": "tidy",
                        "status": "Enabled",
                        "filter": {},
                        "abortIncompleteMultipartUpload": {"daysAfterInitiation": 1},
                        "noncurrentVersionExpiration": {"noncurrentDays": 30},
                    }
                ],
            },
        ),
        Resource(
            "aws:s3/bucketOwnershipControls:BucketOwnershipControls",
            "bucket-ownership",
            {"bucket": BUCKET, "rule": {"objectOwnership": "BucketOwnerEnforced"}},
        ),
        Resource("aws:iam/policy:Policy", "instance-policy", {"policy": INSTANCE_POLICY}),
        Resource(
            "aws:iam/rolePolicy:RolePolicy", "instance-inline", {"role": "r", "policy": INSTANCE_POLICY}
        ),
        Resource(
            "aws:iam/role:Role",
            "instance-role",
            {
                "assumeRolePolicy": _document(
                    {
                        "Effect": "Allow",
                        "Principal": {"Service": "ec2.amazonaws.com"},
                        "Action": "sts:AssumeRole",
                    }
                ),
                "inlinePolicies": [
                    {
                        "name": "scale-to-zero",
                        "policy": _document(
                            {
                                "Effect": "Allow",
                                "Action": "autoscaling:SetDesiredCapacity",
                                "Resource": "arn:aws:autoscaling:us-east-1:123456789012:autoScalingGroup:*:"
                                "autoScalingGroupName/trainstack-dev-gpu",
                            }
                        ),
                    }
                ],
            },
        ),
        Resource("aws:sns/topic:Topic", "topic", {"kmsMasterKeyId": KEY_ARN, "arn": TOPIC_ARN}),
        Resource(
            "aws:sns/topicPolicy:TopicPolicy", "topic-policy", {"arn": TOPIC_ARN, "policy": TOPIC_POLICY}
        ),
        Resource(
            "aws:lambda/permission:Permission",
            "invoke",
            {
                "action": "lambda:InvokeFunction",
                "function": "trainstack-dev-capacity",
                "principal": "events.amazonaws.com",
                "sourceArn": RULE_ARN,
            },
        ),
        Resource(
            "aws:ec2/vpcEndpoint:VpcEndpoint",
            "s3-endpoint",
            {
                "vpcId": VPC_ID,
                "serviceName": "com.amazonaws.us-east-1.s3",
                "vpcEndpointType": "Gateway",
                "policy": ENDPOINT_POLICY,
            },
        ),
        Resource("aws:cloudwatch/logGroup:LogGroup", "logs", {"retentionInDays": 30, "kmsKeyId": KEY_ARN}),
        *_audit_trail(),
    ]


ACCESS_LOG_BUCKET_POLICY = _document(
    {
        "Sid": "DenyInsecureTransport",
        "Effect": "Deny",
        "Principal": "*",
        "Action": "s3:*",
        "Resource": [LOG_BUCKET_ARN, f"{LOG_BUCKET_ARN}/*"],
        "Condition": {"Bool": {"aws:SecureTransport": "false"}},
    },
    {
        "Sid": "S3ServerAccessLogDelivery",
        "Effect": "Allow",
        "Principal": {"Service": "logging.s3.amazonaws.com"},
        "Action": "s3:PutObject",
        "Resource": f"{LOG_BUCKET_ARN}/s3-access/*",
        "Condition": {
            "StringEquals": {"aws:SourceAccount": "123456789012"},
            "ArnLike": {"aws:SourceArn": BUCKET_ARN},
        },
    },
)


def _audit_trail() -> list[Resource]:
    """Who did what: the bucket's access logs in a log bucket of their own, flow logs kept a year, and the
    one AWS managed policy the instance needs (SSM core), attached the way the program attaches it."""
    return [
        Resource(
            "aws:s3/bucketLogging:BucketLogging",
            "bucket-logging",
            {"bucket": BUCKET, "targetBucket": LOG_BUCKET, "targetPrefix": "s3-access/"},
        ),
        Resource("aws:s3/bucket:Bucket", "access-logs", {"bucket": LOG_BUCKET, "id": LOG_BUCKET}),
        Resource(
            "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock",
            "access-logs-public-access",
            {
                "bucket": LOG_BUCKET,
                "blockPublicAcls": True,
                "blockPublicPolicy": True,
                "ignorePublicAcls": True,
                "restrictPublicBuckets": True,
            },
        ),
        Resource(
            "aws:s3/bucketPolicy:BucketPolicy",
            "access-logs-policy",
            {"bucket": LOG_BUCKET, "policy": ACCESS_LOG_BUCKET_POLICY},
        ),
        Resource(
            "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration",
            "access-logs-encryption",
            {
                "bucket": LOG_BUCKET,
                "rules": [{"applyServerSideEncryptionByDefault": {"sseAlgorithm": "AES256"}}],
            },
        ),
        Resource(
            "aws:s3/bucketVersioning:BucketVersioning",
            "access-logs-versioning",
            {"bucket": LOG_BUCKET, "versioningConfiguration": {"status": "Enabled"}},
        ),
        Resource(
            "aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration",
            "access-logs-lifecycle",
            {
                "bucket": LOG_BUCKET,
                "rules": [
                    {
                        "id": "expire-access-logs",
                        "status": "Enabled",
                        "filter": {},
                        "expiration": {"days": 365},
                        "noncurrentVersionExpiration": {"noncurrentDays": 7},
                    }
                ],
            },
        ),
        Resource(
            "aws:s3/bucketOwnershipControls:BucketOwnershipControls",
            "access-logs-ownership",
            {"bucket": LOG_BUCKET, "rule": {"objectOwnership": "BucketOwnerEnforced"}},
        ),
        Resource(
            "aws:cloudwatch/logGroup:LogGroup",
            "flow-logs",
            {"name": FLOW_LOG_GROUP, "retentionInDays": 365, "kmsKeyId": KEY_ARN},
        ),
        Resource(
            "aws:iam/rolePolicyAttachment:RolePolicyAttachment",
            "session-manager",
            {"role": "instance-role", "policyArn": SESSION_MANAGER_POLICY},
        ),
    ]


def named(resources: list[Resource], name: str) -> Resource:
    return next(resource for resource in resources if resource.name == name)


_ALL_TRAFFIC = {"protocol": "-1", "fromPort": 0, "toPort": 0}


def multinode_stack() -> list[Resource]:
    """The compliant stack as infra/ writes it for instanceCount > 1 with placementStrategy cluster."""
    resources = compliant_stack()
    group = named(resources, "instances").props
    group["ingress"].append({**_ALL_TRAFFIC, "self": True})
    group["egress"].append({**_ALL_TRAFFIC, "self": True})
    named(resources, "group").props.update(vpcZoneIdentifiers=["subnet-a"], placementGroup="trainstack-pg")
    resources.append(Resource("aws:ec2/placementGroup:PlacementGroup", "placement", {"strategy": "cluster"}))
    return resources


def multinode_efa_stack() -> list[Resource]:
    """The multi-node stack on EFA types: private subnets behind NAT, one EFA per network card, no public
    address (EC2 assigns none with several interfaces), as infra/fleet.py writes it."""
    resources = multinode_stack()
    resources.append(
        Resource(
            "aws:ec2/natGateway:NatGateway", "nat", {"subnetId": "subnet-a", "allocationId": "eipalloc-1"}
        )
    )
    named(resources, "launch-template").props["networkInterfaces"] = [
        {
            "deviceIndex": 0 if card == 0 else 1,
            "networkCardIndex": card,
            "interfaceType": "efa" if card == 0 else "efa-only",
            "securityGroups": ["sg-1"],
            "deleteOnTermination": "true",
        }
        for card in range(4)
    ]
    named(resources, "group").props["mixedInstancesPolicy"]["launchTemplate"]["overrides"] = [
        {"instanceType": "p5.48xlarge"},
        {"instanceType": "p4d.24xlarge"},
    ]
    return resources
