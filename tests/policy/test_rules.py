"""Each baseline policy passes the compliant stack and fails, with its own message, on each mutation."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

import pytest

from infra.policy.rules import POLICIES
from tests.policy.golden import (
    ACCOUNT,
    BUCKET,
    BUCKET_ARN,
    KEY_ARN,
    SESSION_MANAGER_POLICY,
    compliant_stack,
    multinode_efa_stack,
    named,
)
from tests.policy.harness import Resource, check

Mutation = Callable[[list[Resource]], None]


def _set(name: str, *path: str | int, value: object) -> Mutation:
    def mutate(resources: list[Resource]) -> None:
        target: Any = named(resources, name).props
        for step in path[:-1]:
            target = target[step]
        target[path[-1]] = value

    return mutate


def _delete(name: str, *path: str | int) -> Mutation:
    def mutate(resources: list[Resource]) -> None:
        target: Any = named(resources, name).props
        for step in path[:-1]:
            target = target[step]
        del target[path[-1]]

    return mutate


def _remove(name: str) -> Mutation:
    def mutate(resources: list[Resource]) -> None:
        resources.remove(named(resources, name))

    return mutate


def _add(resource: Resource) -> Mutation:
    def mutate(resources: list[Resource]) -> None:
        resources.append(resource)

    return mutate


def _policy_document(*statements: dict[str, object]) -> str:
    return json.dumps({"Version": "2012-10-17", "Statement": list(statements)})


def _user_data(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


NAT = Resource("aws:ec2/natGateway:NatGateway", "nat", {"subnetId": "subnet-a", "allocationId": "eipalloc-1"})

# (what goes wrong, mutation, the policy that must catch it, a fragment of the one-line message)
MUTATIONS: list[tuple[str, Mutation, str, str]] = [
    (
        "imdsv1-allowed",
        _set("launch-template", "metadataOptions", "httpTokens", value="optional"),
        "imdsv2-required",
        'httpTokens = "required"',
    ),
    (
        "http-tokens-unset",
        _delete("launch-template", "metadataOptions", "httpTokens"),
        "imdsv2-required",
        "httpTokens",
    ),
    (
        "hop-limit-2",
        _set("launch-template", "metadataOptions", "httpPutResponseHopLimit", value=2),
        "imds-hop-limit-one",
        "httpPutResponseHopLimit = 1 (it is 2)",
    ),
    (
        "root-volume-unencrypted-string",
        _set("launch-template", "blockDeviceMappings", 0, "ebs", "encrypted", value="false"),
        "ebs-encrypted-with-cmk",
        "blockDeviceMappings[/dev/sda1].ebs.encrypted = true",
    ),
    (
        "root-volume-aws-managed-key",
        _delete("launch-template", "blockDeviceMappings", 0, "ebs", "kmsKeyId"),
        "ebs-encrypted-with-cmk",
        "kmsKeyId to a customer managed KMS key",
    ),
    (
        "no-block-device-mappings",
        _delete("launch-template", "blockDeviceMappings"),
        "ebs-encrypted-with-cmk",
        "add blockDeviceMappings",
    ),
    (
        "volume-unencrypted",
        _set("scratch", "encrypted", value=False),
        "ebs-encrypted-with-cmk",
        "the volume.encrypted = true",
    ),
    (
        "public-ip-behind-nat",
        _add(NAT),
        "no-public-ip-with-private-networking",
        'networkInterfaces[0].associatePublicIpAddress = "false"',
    ),
    (
        "one-subnet",
        _set("group", "vpcZoneIdentifiers", value=["subnet-a"]),
        "group-spans-zones-and-types",
        "two or more Availability Zones",
    ),
    (
        "one-instance-type",
        _set(
            "group",
            "mixedInstancesPolicy",
            "launchTemplate",
            "overrides",
            value=[{"instanceType": "g6.xlarge"}],
        ),
        "group-spans-zones-and-types",
        "two or more instance types",
    ),
    (
        "launch-configuration",
        _set("group", "launchConfiguration", value="lc-1"),
        "group-uses-launch-template",
        "replace launchConfiguration",
    ),
    (
        "no-launch-template",
        _set("group", "mixedInstancesPolicy", "launchTemplate", "launchTemplateSpecification", value={}),
        "group-uses-launch-template",
        "set launchTemplate",
    ),
    (
        "default-sg-allows-ingress",
        _set("default-sg", "ingress", value=[{"protocol": "-1", "fromPort": 0, "toPort": 0, "self": True}]),
        "default-security-group-closed",
        "remove every ingress rule",
    ),
    (
        "default-sg-not-adopted",
        _remove("default-sg"),
        "default-security-group-closed",
        "adopt its default security group",
    ),
    ("no-flow-log", _remove("flow-log"), "vpc-flow-logs-enabled", "add an aws.ec2.FlowLog"),
    (
        "flow-log-accepts-only",
        _set("flow-log", "trafficType", value="ACCEPT"),
        "vpc-flow-logs-enabled",
        'trafficType = "ALL" or "REJECT"',
    ),
    (
        "ssh-open-to-world",
        _set("instances", "ingress", 0, "cidrBlocks", value=["0.0.0.0/0"]),
        "no-unrestricted-ingress",
        "ingress[0] opens ports 22-22 to 0.0.0.0/0",
    ),
    (
        "all-ports-open-ipv6",
        _set(
            "instances",
            "ingress",
            value=[{"protocol": "-1", "fromPort": 0, "toPort": 0, "ipv6CidrBlocks": ["::/0"]}],
        ),
        "no-unrestricted-ingress",
        "opens all ports",
    ),
    (
        "ingress-rule-open",
        _set("ssh-from-office", "cidrIpv4", value="0.0.0.0/0"),
        "no-unrestricted-ingress",
        "the rule opens ports 22-22",
    ),
    (
        "sg-rule-open",
        _add(
            Resource(
                "aws:ec2/securityGroupRule:SecurityGroupRule",
                "rdp",
                {
                    "type": "ingress",
                    "protocol": "tcp",
                    "fromPort": 3389,
                    "toPort": 3389,
                    "cidrBlocks": ["0.0.0.0/0"],
                    "securityGroupId": "sg-1",
                },
            )
        ),
        "no-unrestricted-ingress",
        "ports 3389-3389",
    ),
    (
        "no-public-access-block",
        _remove("bucket-public-access"),
        "s3-public-access-blocked",
        "add an aws.s3.BucketPublicAccessBlock",
    ),
    (
        "public-policy-allowed",
        _set("bucket-public-access", "blockPublicPolicy", value=False),
        "s3-public-access-blocked",
        "set blockPublicPolicy = true",
    ),
    ("no-bucket-policy", _remove("bucket-policy"), "s3-tls-only", "add an aws.s3.BucketPolicy"),
    (
        "policy-without-tls-deny",
        _set(
            "bucket-policy",
            "policy",
            value=_policy_document(
                {
                    "Effect": "Deny",
                    "Principal": "*",
                    "Action": "s3:DeleteBucket",
                    "Resource": f"arn:aws:s3:::{BUCKET}",
                }
            ),
        ),
        "s3-tls-only",
        "lacks a Deny of s3:* for Principal *",
    ),
    ("policy-not-json", _set("bucket-policy", "policy", value="{not json"), "s3-tls-only", "not valid JSON"),
    (
        "no-default-encryption",
        _remove("bucket-encryption"),
        "s3-sse-kms",
        "add an aws.s3.BucketServerSideEncryptionConfiguration",
    ),
    (
        "sse-s3-not-kms",
        _set(
            "bucket-encryption",
            "rules",
            0,
            "applyServerSideEncryptionByDefault",
            value={"sseAlgorithm": "AES256"},
        ),
        "s3-sse-kms",
        'sseAlgorithm = "aws:kms" (it is AES256)',
    ),
    (
        "aws-managed-s3-key",
        _delete("bucket-encryption", "rules", 0, "applyServerSideEncryptionByDefault", "kmsMasterKeyId"),
        "s3-sse-kms",
        "set kmsMasterKeyId",
    ),
    (
        "versioning-suspended",
        _set("bucket-versioning", "versioningConfiguration", "status", value="Suspended"),
        "s3-versioning-enabled",
        'status="Enabled"',
    ),
    (
        "no-lifecycle",
        _remove("bucket-lifecycle"),
        "s3-lifecycle-configured",
        "add an aws.s3.BucketLifecycleConfiguration",
    ),
    (
        "old-versions-kept-forever",
        _delete("bucket-lifecycle", "rules", 0, "noncurrentVersionExpiration"),
        "s3-lifecycle-configured",
        "add noncurrent_version_expiration",
    ),
    (
        "lifecycle-disabled",
        _set("bucket-lifecycle", "rules", 0, "status", value="Disabled"),
        "s3-lifecycle-configured",
        "enable a rule",
    ),
    (
        "bucket-acl",
        _add(Resource("aws:s3/bucketAcl:BucketAcl", "acl", {"bucket": BUCKET, "acl": "public-read"})),
        "s3-no-acls",
        "remove the ACL",
    ),
    (
        "acls-enabled",
        _set("bucket-ownership", "rule", "objectOwnership", value="ObjectWriter"),
        "s3-no-acls",
        'objectOwnership = "BucketOwnerEnforced"',
    ),
    (
        "no-key-rotation",
        _set("key", "enableKeyRotation", value=False),
        "kms-key-rotation-enabled",
        "enableKeyRotation = true",
    ),
    (
        "decrypt-all-keys",
        _set(
            "instance-policy",
            "policy",
            value=_policy_document({"Effect": "Allow", "Action": "kms:Decrypt", "Resource": "*"}),
        ),
        "kms-no-decrypt-on-all-keys",
        "allows kms:Decrypt on every KMS key",
    ),
    (
        "inline-decrypt-all-keys-by-wildcard",
        _set(
            "instance-inline",
            "policy",
            value=_policy_document(
                {
                    "Effect": "Allow",
                    "Action": "kms:ReEncryptFrom",
                    "Resource": "arn:aws:kms:*:123456789012:key/*",
                }
            ),
        ),
        "kms-no-decrypt-on-all-keys",
        "allows kms:ReEncryptFrom",
    ),
    (
        "admin-policy",
        _set(
            "instance-policy",
            "policy",
            value=_policy_document({"Effect": "Allow", "Action": "*", "Resource": f"arn:aws:s3:::{BUCKET}"}),
        ),
        "iam-no-wildcard-actions",
        "allows *",
    ),
    (
        "service-wildcard-inline",
        _set(
            "instance-role",
            "inlinePolicies",
            0,
            "policy",
            value=_policy_document(
                {"Effect": "Allow", "Action": ["s3:*"], "Resource": f"arn:aws:s3:::{BUCKET}/*"}
            ),
        ),
        "iam-no-wildcard-actions",
        "inlinePolicies[0].policy Statement[0] allows s3:*",
    ),
    (
        "allow-not-action",
        _set(
            "instance-inline",
            "policy",
            # On the bucket's checkpoints only: the same NotAction on `*` also grants iam:PassRole and
            # s3:GetObject everywhere, which test_effective_permissions.py shows the grant rules catch.
            value=_policy_document(
                {"Effect": "Allow", "NotAction": "kms:*", "Resource": f"arn:aws:s3:::{BUCKET}/checkpoints/*"}
            ),
        ),
        "iam-no-wildcard-actions",
        "allows NotAction",
    ),
    ("topic-unencrypted", _delete("topic", "kmsMasterKeyId"), "sns-topic-encrypted", "set kmsMasterKeyId"),
    (
        "topic-aws-managed-key",
        _set("topic", "kmsMasterKeyId", value="alias/aws/sns"),
        "sns-topic-encrypted",
        "not alias/aws/sns",
    ),
    (
        "logs-kept-forever",
        _delete("logs", "retentionInDays"),
        "log-group-retained-and-encrypted",
        "set retentionInDays to at least 1",
    ),
    ("logs-unencrypted", _delete("logs", "kmsKeyId"), "log-group-retained-and-encrypted", "set kmsKeyId"),
    (
        "access-key-in-user-data",
        _set(
            "launch-template",
            "userData",
            value=_user_data("#cloud-config\nruncmd:\n  - export AWS_ACCESS_KEY_ID=AKIAIOSFODNN7EXAMPLE\n"),
        ),
        "no-secrets-in-user-data",
        "userData contains an AWS access key ID",
    ),
    (
        "secret-key-in-instance-user-data",
        _add(
            Resource(
                "aws:ec2/instance:Instance",
                "box",
                {
                    "metadataOptions": {"httpTokens": "required", "httpPutResponseHopLimit": 1},
                    "rootBlockDevice": {"encrypted": True, "kmsKeyId": KEY_ARN},
                    "userData": "aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY\n",
                },
            )
        ),
        "no-secrets-in-user-data",
        "userData contains an AWS secret access key",
    ),
    (
        "private-key-in-user-data",
        _set(
            "launch-template",
            "userData",
            value=_user_data("-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEA\n"),
        ),
        "no-secrets-in-user-data",
        "a private key",
    ),
]


MUTATIONS += [
    (
        "lambda-logging-to-its-default-group",
        _add(Resource("aws:lambda/function:Function", "function", {"runtime": "python3.13"})),
        "lambda-logs-encrypted",
        "/aws/lambda/<name> is unencrypted",
    ),
    (
        "instance-role-sets-capacity-of-every-group",
        _set(
            "instance-role",
            "inlinePolicies",
            0,
            "policy",
            value=_policy_document(
                {"Effect": "Allow", "Action": "autoscaling:SetDesiredCapacity", "Resource": "*"}
            ),
        ),
        "autoscaling-changes-scoped",
        "name the group",
    ),
]


def _ssh_from(*cidrs: str) -> Mutation:
    """The instance group's SSH rule opened to `cidrs` (IPv4 and IPv6 mixed as written)."""
    return _set(
        "instances",
        "ingress",
        0,
        value={
            "protocol": "tcp",
            "fromPort": 22,
            "toPort": 22,
            "cidrBlocks": [c for c in cidrs if ":" not in c],
            "ipv6CidrBlocks": [c for c in cidrs if ":" in c],
        },
    )


def _instance_inline_allows(*actions: str) -> Mutation:
    return _set(
        "instance-inline",
        "policy",
        value=_policy_document(
            {"Effect": "Allow", "Action": list(actions), "Resource": f"arn:aws:s3:::{BUCKET}/checkpoints/*"}
        ),
    )


# Issue 12: the internet judged by address space, admin and wildcard grants in disguise, the stack's own
# key on the topic, the bucket's access log (S3.9) and flow logs kept a year (CloudWatch.16).
MUTATIONS += [
    (
        "ssh-open-to-the-internet-in-two-halves",
        _ssh_from("0.0.0.0/1", "128.0.0.0/1"),
        "no-unrestricted-ingress",
        "ingress[0] opens ports 22-22 to 0.0.0.0/0",
    ),
    (
        "ssh-open-to-ipv6-zero-spelled-differently",
        _ssh_from("::0/0"),
        "no-unrestricted-ingress",
        "ingress[0] opens ports 22-22 to ::/0",
    ),
    (
        "ssh-open-to-a-quarter-of-ipv4",
        _ssh_from("64.0.0.0/2"),
        "no-unrestricted-ingress",
        "64.0.0.0/2 (25% of all IPv4 addresses)",
    ),
    (
        "two-narrow-rules-that-together-exceed-a-slash-8",
        _set(
            "instances",
            "ingress",
            value=[
                {"protocol": "tcp", "fromPort": 22, "toPort": 22, "cidrBlocks": ["44.0.0.0/8"]},
                {"protocol": "tcp", "fromPort": 443, "toPort": 443, "cidrBlocks": ["45.0.0.0/8"]},
            ],
        ),
        "no-unrestricted-ingress",
        "ingress[0] and ingress[1] together open their ports to 44.0.0.0/7",
    ),
    (
        "ingress-rule-open-to-ipv6-global-unicast",
        _set("ssh-from-office", "cidrIpv6", value="2000::/3"),
        "no-unrestricted-ingress",
        "the rule opens ports 22-22 to 2000::/3",
    ),
    (
        "administrator-access-attached",
        _set("session-manager", "policyArn", value="arn:aws:iam::aws:policy/AdministratorAccess"),
        "iam-no-admin-managed-policies",
        "policyArn attaches the AWS managed AdministratorAccess",
    ),
    (
        "power-user-in-role-managed-policy-arns",
        _set(
            "instance-role",
            "managedPolicyArns",
            value=[SESSION_MANAGER_POLICY, "arn:aws:iam::aws:policy/PowerUserAccess"],
        ),
        "iam-no-admin-managed-policies",
        "managedPolicyArns[1] attaches the AWS managed PowerUserAccess",
    ),
    (
        "question-mark-wildcard",
        _instance_inline_allows("s3:GetObject", "s3:?*"),
        "iam-no-wildcard-actions",
        "allows s3:?*",
    ),
    (
        "infix-wildcard",
        _instance_inline_allows("s3:*Object*"),
        "iam-no-wildcard-actions",
        "allows s3:*Object*",
    ),
    (
        "topic-aws-managed-key-by-alias-arn",
        _set("topic", "kmsMasterKeyId", value="arn:aws:kms:us-east-1:123456789012:alias/aws/sns"),
        "sns-topic-encrypted",
        "not alias/aws/sns",
    ),
    (
        "no-access-logging",
        _remove("bucket-logging"),
        "s3-access-logging",
        "'bucket': add an aws.s3.BucketLogging",
    ),
    (
        "bucket-logs-into-itself",
        _set("bucket-logging", "targetBucket", value=BUCKET),
        "s3-access-logging",
        "logs the bucket into itself",
    ),
    (
        "flow-logs-kept-a-month",
        _set("flow-logs", "retentionInDays", value=30),
        "vpc-flow-logs-retained",
        "set retentionInDays to at least 365",
    ),
]


def _peer_rule(**source: object) -> Resource:
    """A multi-node job's peer rule as a separate resource on the instance group sg-1, from `source`."""
    props = {"type": "ingress", "protocol": "-1", "fromPort": 0, "toPort": 0, "securityGroupId": "sg-1"}
    return Resource("aws:ec2/securityGroupRule:SecurityGroupRule", "peers", {**props, **source})


def _inline_peer_rule(**source: object) -> Mutation:
    """The instance group's inline peer rule (all traffic), admitting `source`."""

    def mutate(resources: list[Resource]) -> None:
        rule = {"protocol": "-1", "fromPort": 0, "toPort": 0, "self": True, **source}
        named(resources, "instances").props["ingress"].append(rule)

    return mutate


# Issue 11: multi-node peers may talk through a self-referencing rule, and through nothing wider.
MUTATIONS += [
    (
        "ingress-from-another-group",
        _inline_peer_rule(self=False, securityGroups=["sg-0other"]),
        "no-unrestricted-ingress",
        "ingress[1] admits security group sg-0other",
    ),
    (
        "peer-rule-from-another-group",
        _add(_peer_rule(sourceSecurityGroupId="sg-0other")),
        "no-unrestricted-ingress",
        "the rule admits security group sg-0other",
    ),
    (
        "peer-ingress-rule-from-another-group",
        _set("ssh-from-office", "referencedSecurityGroupId", value="sg-0other"),
        "no-unrestricted-ingress",
        "the rule admits security group sg-0other",
    ),
    (
        "peer-rule-widened-to-the-internet",
        _inline_peer_rule(cidrBlocks=["0.0.0.0/0"]),
        "no-unrestricted-ingress",
        "ingress[1] opens all ports to 0.0.0.0/0",
    ),
]


def _allow(action: str, resource: str = "*", **extra: object) -> str:
    return _policy_document({"Effect": "Allow", "Action": action, "Resource": resource, **extra})


def _both(*mutations: Mutation) -> Mutation:
    def mutate(resources: list[Resource]) -> None:
        for mutation in mutations:
            mutation(resources)

    return mutate


OTHER_ACCOUNT = "999988887777"
PUBLIC_SNAPSHOT = Resource(
    "aws:ec2/snapshotCreateVolumePermission:SnapshotCreateVolumePermission",
    "share",
    {"snapshotId": "snap-0abc", "accountId": "all"},
)
BUCKET_POLICY_FOR_ANOTHER_ACCOUNT = _policy_document(
    {
        "Effect": "Deny",
        "Principal": "*",
        "Action": "s3:*",
        "Resource": [f"arn:aws:s3:::{BUCKET}", f"arn:aws:s3:::{BUCKET}/*"],
        "Condition": {"Bool": {"aws:SecureTransport": "false"}},
    },
    {
        "Effect": "Allow",
        "Principal": {"AWS": f"arn:aws:iam::{OTHER_ACCOUNT}:root"},
        "Action": "s3:GetObject",
        "Resource": f"arn:aws:s3:::{BUCKET}/*",
    },
)
UNDECLARED_OVERRIDE = {
    "instanceType": "g5.xlarge",
    "launchTemplateSpecification": {"launchTemplateId": "lt-0console"},
}

# Issue 24: the 29 adversarial mutations the pack missed. Effective permissions (however the action is
# spelled, in identity, AWS managed, resource and trust policies alike), what groups launch, egress, the S3
# endpoint, the flow logs' log group and what user data runs. Each is also run on the multi-node/EFA
# variant (test_issue_24_mutations_fail_the_multinode_efa_stack_too).
ISSUE_24_MUTATIONS: list[tuple[str, Mutation, str, str]] = [
    (
        "pass-role-on-every-role",
        _set("instance-inline", "policy", value=_allow("iam:PassRole")),
        "iam-escalation-on-named-resources",
        "'instance-inline': policy Statement[0] allows iam:PassRole on *: name the role ARNs",
    ),
    (
        "assume-any-role-through-a-roles-inline-policy",
        _set("instance-role", "inlinePolicies", 0, "policy", value=_allow("sts:AssumeRole")),
        "iam-escalation-on-named-resources",
        "inlinePolicies[0].policy Statement[0] allows sts:AssumeRole on *",
    ),
    (
        "launch-template-versions-of-every-template",
        _set("instance-policy", "policy", value=_allow("ec2:CreateLaunchTemplateVersion")),
        "iam-escalation-on-named-resources",
        "allows ec2:CreateLaunchTemplateVersion on *: name the launch template ARNs",
    ),
    (
        "get-object-in-every-bucket",
        _set("instance-inline", "policy", value=_allow("s3:GetObject")),
        "iam-data-access-on-named-resources",
        "allows s3:GetObject on *: name the bucket",
    ),
    (
        "get-every-ssm-parameter",
        _set("instance-inline", "policy", value=_allow("ssm:GetParameter")),
        "iam-data-access-on-named-resources",
        "allows ssm:GetParameter on *: name the parameter path",
    ),
    (
        "get-every-secret-value",
        _set("instance-policy", "policy", value=_allow("secretsmanager:GetSecretValue")),
        "iam-data-access-on-named-resources",
        "allows secretsmanager:GetSecretValue on *: name the secrets",
    ),
    (
        "s3-read-only-access-attached",
        _set("session-manager", "policyArn", value="arn:aws:iam::aws:policy/AmazonS3ReadOnlyAccess"),
        "iam-data-access-on-named-resources",
        "policyArn (the AWS managed AmazonS3ReadOnlyAccess) Statement[0] allows s3:GetObject",
    ),
    (
        "bucket-policy-grants-another-account",
        _set("bucket-policy", "policy", value=BUCKET_POLICY_FOR_ANOTHER_ACCOUNT),
        "s3-bucket-policy-not-public",
        f"'bucket-policy': policy Statement[1] grants account {OTHER_ACCOUNT}",
    ),
    (
        "key-policy-for-everyone",
        _set("key", "policy", value=_allow("kms:Decrypt", Principal={"AWS": "*"})),
        "kms-key-policy-not-public",
        """'key': policy Statement[0] allows Principal {"AWS": "*"} (anyone) without a restricting""",
    ),
    (
        "trust-policy-for-any-aws-principal",
        _set(
            "instance-role",
            "assumeRolePolicy",
            value=_policy_document(
                {"Effect": "Allow", "Principal": {"AWS": "*"}, "Action": "sts:AssumeRole"}
            ),
        ),
        "iam-trust-policy-not-public",
        """'instance-role': assumeRolePolicy Statement[0] allows Principal {"AWS": "*"} (anyone)""",
    ),
    (
        "topic-policy-for-everyone",
        _set("topic-policy", "policy", value=_allow("sns:Publish", Principal="*")),
        "sns-topic-policy-not-public",
        """'topic-policy': policy Statement[0] allows Principal "*" (anyone)""",
    ),
    (
        "lambda-permission-for-everyone",
        _both(_set("invoke", "principal", value="*"), _delete("invoke", "sourceArn")),
        "lambda-permission-not-public",
        "'invoke': principal * lets anyone invoke the function",
    ),
    (
        "public-ebs-snapshot",
        _add(PUBLIC_SNAPSHOT),
        "ebs-snapshot-not-public",
        "'share': makes the snapshot public",
    ),
    (
        "group-launches-an-undeclared-template",
        _set(
            "group",
            "mixedInstancesPolicy",
            "launchTemplate",
            "launchTemplateSpecification",
            "launchTemplateId",
            value="lt-0console",
        ),
        "launch-templates-declared",
        "'group': mixedInstancesPolicy.launchTemplate.launchTemplateSpecification.launchTemplateId names "
        "launch template lt-0console, which this stack does not declare",
    ),
    (
        "override-launches-an-undeclared-template",
        _set("group", "mixedInstancesPolicy", "launchTemplate", "overrides", 1, value=UNDECLARED_OVERRIDE),
        "launch-templates-declared",
        "overrides[1].launchTemplateSpecification.launchTemplateId names launch template lt-0console",
    ),
    (
        "ssh-through-a-prefix-list",
        _set(
            "instances",
            "ingress",
            0,
            value={"protocol": "tcp", "fromPort": 22, "toPort": 22, "prefixListIds": ["pl-0abc"]},
        ),
        "no-unrestricted-ingress",
        "'instances': ingress[0] admits prefix list pl-0abc on ports 22-22",
    ),
    (
        "all-protocol-egress-to-anywhere",
        _set(
            "instances",
            "egress",
            0,
            value={"protocol": "-1", "fromPort": 0, "toPort": 0, "cidrBlocks": ["0.0.0.0/0"]},
        ),
        "no-all-protocol-egress-to-internet",
        "'instances': egress[0] allows all protocols and ports to 0.0.0.0/0",
    ),
    (
        "s3-endpoint-policy-on-everything",
        _set("s3-endpoint", "policy", value=_allow("s3:*", Principal="*")),
        "s3-endpoint-policy-scoped",
        "'s3-endpoint': policy Statement[0] allows s3:GetObject, s3:PutObject, s3:ListBucket on *, every",
    ),
    (
        "flow-logs-log-group-deleted",
        _remove("flow-logs"),
        "vpc-flow-logs-retained",
        "'flow-log': delivers to arn:aws:logs:us-east-1:123456789012:log-group:/trainstack/dev/vpc-flow-logs,"
        " a log group this stack does not declare",
    ),
    (
        "curl-pipe-bash-in-user-data",
        _set(
            "launch-template",
            "userData",
            value=_user_data("#!/bin/sh\ncurl -fsSL https://get.example.sh | bash\n"),
        ),
        "no-piped-downloads-in-user-data",
        "'launch-template': userData runs a download unseen (curl -fsSL https://get.example.sh | bash)",
    ),
]
MUTATIONS += ISSUE_24_MUTATIONS

# Issue 34: the job's containment. The golden stack's group launches its template as 'instance-role' (an
# instance profile of it), whose inline policy gets the statements; tests/policy/test_pack_guards.py runs the
# same policies on the real program, one weakening at a time.
_INSTANCE_PROFILE_ARN = f"arn:aws:iam::{ACCOUNT}:instance-profile/trainstack-dev-instance"
_JOB_ROLE_ARN = f"arn:aws:iam::{ACCOUNT}:role/trainstack-dev-job"


def _instances_run_as_instance_role(*statements: dict[str, object]) -> Mutation:
    def mutate(resources: list[Resource]) -> None:
        role = named(resources, "instance-role")
        role.props["name"] = "trainstack-dev-instance"
        inline = role.props["inlinePolicies"][0]
        document = json.loads(inline["policy"])
        document["Statement"].extend(statements)
        inline["policy"] = json.dumps(document)
        resources.append(
            Resource(
                "aws:iam/instanceProfile:InstanceProfile",
                "instance-profile",
                {
                    "name": "trainstack-dev-instance",
                    "role": "trainstack-dev-instance",
                    "arn": _INSTANCE_PROFILE_ARN,
                },
            )
        )
        named(resources, "launch-template").props["iamInstanceProfile"] = {"arn": _INSTANCE_PROFILE_ARN}

    return mutate


_JOB_ROLE_ANY_PRINCIPAL_OF_THE_ACCOUNT = Resource(
    "aws:iam/role:Role",
    "job-role",
    {
        "name": "trainstack-dev-job",
        "assumeRolePolicy": _policy_document(
            {
                "Effect": "Allow",
                "Principal": {"AWS": f"arn:aws:iam::{ACCOUNT}:root"},
                "Action": "sts:AssumeRole",
            }
        ),
    },
)
_AGENT_UNIT_WITHOUT_SANDBOX = """#cloud-config
write_files:
  - path: /etc/systemd/system/trainstack-agent.service
    content: |
      [Service]
      ExecStart=/opt/trainstack/current/bootstrap/instance/run-agent.sh --config /etc/trainstack/agent.yaml
"""
_INSTANCE_ROLE_ARN = f"arn:aws:iam::{ACCOUNT}:role/trainstack-dev-instance"


def _bucket_refuses_the_instance_role_outside_the_endpoint(resources: list[Resource]) -> None:
    """The bucket policy's VPC-endpoint Deny for the instance role (s3-instance-roles-through-endpoint)."""
    bucket_policy = named(resources, "bucket-policy")
    document = json.loads(bucket_policy.props["policy"])
    document["Statement"].append(
        {
            "Effect": "Deny",
            "Principal": "*",
            "Action": "s3:*",
            "Resource": [BUCKET_ARN, f"{BUCKET_ARN}/*"],
            "Condition": {
                "ArnEquals": {"aws:PrincipalArn": _INSTANCE_ROLE_ARN},
                "StringNotEquals": {"aws:SourceVpce": "vpce-0abc"},
            },
        }
    )
    bucket_policy.props["policy"] = json.dumps(document)


ISSUE_34_MUTATIONS: list[tuple[str, Mutation, str, str]] = [
    (
        "job-role-taken-by-any-principal-of-the-account",
        _both(
            _instances_run_as_instance_role(
                {"Effect": "Allow", "Action": "sts:AssumeRole", "Resource": _JOB_ROLE_ARN}
            ),
            _add(_JOB_ROLE_ANY_PRINCIPAL_OF_THE_ACCOUNT),
        ),
        "job-role-contained",
        f"'job-role': assumeRolePolicy Statement[0] lets arn:aws:iam::{ACCOUNT}:root take the job role "
        "without an aws:PrincipalArn condition",
    ),
    (
        "instance-role-runs-instances",
        _instances_run_as_instance_role({"Effect": "Allow", "Action": "ec2:RunInstances", "Resource": "*"}),
        "instance-roles-launch-nothing",
        "'instance-role': inlinePolicies[0].policy Statement[1] gives trainstack-dev-instance (the job "
        "instances' role) ec2:RunInstances: remove it",
    ),
    (
        "instance-role-reaches-the-bucket-from-anywhere",
        _instances_run_as_instance_role(
            {"Effect": "Allow", "Action": "s3:GetObject", "Resource": f"{BUCKET_ARN}/data/*"}
        ),
        "s3-instance-roles-through-endpoint",
        f"'bucket-policy': the bucket {BUCKET} does not refuse trainstack-dev-instance outside the stack's "
        "S3 endpoint",
    ),
    (
        "agent-started-without-the-job-sandbox",
        _set("launch-template", "userData", value=_user_data(_AGENT_UNIT_WITHOUT_SANDBOX)),
        "job-sandbox-in-user-data",
        "userData: its trainstack-agent.service does not run the job sandbox before every start of the agent",
    ),
    (
        "instance-deletes-the-bucket",
        _set("instance-inline", "policy", value=_allow("s3:DeleteBucket", BUCKET_ARN)),
        "iam-no-teardown-of-data-or-audit-trail",
        "'instance-inline': policy Statement[0] allows s3:DeleteBucket, which deletes or reopens the stack's "
        "data",
    ),
    (
        "instance-role-submits-into-a-bucket-that-lets-it-overwrite",
        _both(
            _instances_run_as_instance_role(
                {"Effect": "Allow", "Action": "s3:PutObject", "Resource": f"{BUCKET_ARN}/queue/*"}
            ),
            _bucket_refuses_the_instance_role_outside_the_endpoint,
        ),
        "s3-submissions-create-only",
        f"'bucket-policy': the bucket {BUCKET} lets trainstack-dev-instance overwrite job-code/*, "
        "jobs/*/job.json, queue/*",
    ),
]
MUTATIONS += ISSUE_34_MUTATIONS


def test_every_policy_is_mandatory_and_names_its_controls() -> None:
    for policy in POLICIES:
        assert policy.enforcement_level is not None and policy.enforcement_level.value == "mandatory"
        assert policy.description.startswith("[") and "]" in policy.description, policy.name
        assert policy.tags and all(tag in policy.description for tag in policy.tags), policy.name


def test_compliant_stack_passes_every_policy() -> None:
    assert check(compliant_stack()) == []


def test_every_policy_has_a_mutation_that_it_catches() -> None:
    assert {policy for _, _, policy, _ in MUTATIONS} == {policy.name for policy in POLICIES}


@pytest.mark.parametrize(
    ("mutation", "policy", "fragment"), [m[1:] for m in MUTATIONS], ids=[m[0] for m in MUTATIONS]
)
def test_mutation_fails_with_that_policys_message(mutation: Mutation, policy: str, fragment: str) -> None:
    resources = compliant_stack()
    mutation(resources)
    violations = check(resources)
    assert violations, f"{policy} did not catch the mutation"
    assert {violation.policy for violation in violations} == {policy}, violations
    assert any(fragment in violation.message for violation in violations), violations
    for violation in violations:
        assert "\n" not in violation.message
        assert "'" in violation.message, "the message names the resource"


@pytest.mark.parametrize("removed", [policy.name for policy in POLICIES])
def test_a_pack_without_any_one_policy_lets_a_mutation_through(removed: str) -> None:
    """Each policy earns its place: without it, some weakening passes with zero violations.

    Only the policy's own mutations can pass: the test above proves every other mutation is caught by its
    own policy alone, which this smaller pack still holds."""
    smaller_pack = [policy for policy in POLICIES if policy.name != removed]
    undetected = []
    for name, mutation, _, _ in (m for m in MUTATIONS if m[2] == removed):
        resources = compliant_stack()
        mutation(resources)
        if check(resources, policies=smaller_pack) == []:
            undetected.append(name)
    assert undetected, f"every mutation is still caught without {removed}: it guards nothing of its own"


@pytest.mark.parametrize(
    ("mutation", "policy", "fragment"),
    [m[1:] for m in ISSUE_24_MUTATIONS],
    ids=[m[0] for m in ISSUE_24_MUTATIONS],
)
def test_issue_24_mutations_fail_the_multinode_efa_stack_too(
    mutation: Mutation, policy: str, fragment: str
) -> None:
    resources = multinode_efa_stack()
    assert check(resources) == []
    mutation(resources)
    violations = check(resources)
    assert {violation.policy for violation in violations} == {policy}, violations
    assert any(fragment in violation.message for violation in violations), violations
