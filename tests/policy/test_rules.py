"""Each baseline policy passes the compliant stack and fails, with its own message, on each mutation. At the
end, the identity, network and storage rules one by one: values known only after `up`, malformed values, and
the exact line each refusal is."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

import pytest
from pulumi_policy.proxy import (
    UNKNOWN_ARRAY_VALUE,
    UNKNOWN_BOOLEAN_VALUE,
    UNKNOWN_NUMBER_VALUE,
    UNKNOWN_STRING_VALUE,
)

from policypack.patterns import arn_shape, literal_prefix, matches_shape
from policypack.rules import POLICIES
from tests.policy.golden import (
    ACCESS_LOG_BUCKET_POLICY,
    ACCOUNT,
    BUCKET,
    BUCKET_ARN,
    KEY_ARN,
    LOG_BUCKET,
    SESSION_MANAGER_POLICY,
    compliant_stack,
    multinode_efa_stack,
    named,
)
from tests.policy.harness import Deferred, Resource, Violation, check, evaluate

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


# == the identity, network and storage rules one by one (policypack/), through the engine's path =========
# A value known only after `pulumi up` never fails a preview; a malformed value never hides a good one after
# it; each refusal is one line that names the resource's property, what is wrong and the fix, with the
# policy-config key spelled as the user types it (tests/policy/harness.py).


INGRESS = "no-unrestricted-ingress"
EGRESS = "no-all-protocol-egress-to-internet"
GROUP = "aws.ec2.SecurityGroup 'instances': "


def with_ingress(rule: dict[str, Any]) -> list[Resource]:
    resources = compliant_stack()
    named(resources, "instances").props["ingress"].append(rule)
    return resources


def messages(resources: list[Resource], policy: str, config: dict[str, Any] | None = None) -> list[str]:
    return [v.message for v in check(resources, {policy: config} if config else None) if v.policy == policy]


# -- network -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("unknown", ["fromPort", "toPort"])
def test_a_port_known_only_after_up_never_fails_the_preview(unknown: str) -> None:
    """The engine runs the policy again on `up` with the port known; at preview it cannot judge it."""
    rule = {"protocol": "tcp", "fromPort": 22, "toPort": 22, "cidrBlocks": ["0.0.0.0/0"]}
    assert messages(with_ingress({**rule, unknown: UNKNOWN_NUMBER_VALUE}), INGRESS) == []
    assert messages(with_ingress(rule), INGRESS), "known, the same rule fails"


def test_a_malformed_cidr_never_hides_the_internet_after_it() -> None:
    rule = {"protocol": "tcp", "fromPort": 22, "toPort": 22, "cidrBlocks": ["not-a-cidr", "0.0.0.0/0"]}
    assert messages(with_ingress(rule), INGRESS) == [
        GROUP
        + "ingress[1] opens ports 22-22 to 0.0.0.0/0, more than an IPv4 /8 or IPv6 /32, which counts as the "
        "internet and is refused: use SSM Session Manager, or allow narrower CIDRs (or list the port in the "
        "policy's authorizedPublicPorts config)"
    ]


def test_authorized_public_ports_never_cover_a_range_whose_ends_are_more_than_1024_apart() -> None:
    """`authorizedPublicPorts` lists reviewed ports; a range that wide is not a reviewed service."""
    rule = {"protocol": "tcp", "fromPort": 1000, "toPort": 2100, "cidrBlocks": ["0.0.0.0/0"]}
    every_port = {"authorizedPublicPorts": list(range(1000, 2101))}
    assert messages(with_ingress(rule), INGRESS, every_port)
    narrow = {"protocol": "tcp", "fromPort": 1000, "toPort": 2000, "cidrBlocks": ["0.0.0.0/0"]}
    assert messages(with_ingress(narrow), INGRESS, every_port) == []


def test_another_security_group_as_a_source_is_refused_with_the_fix() -> None:
    rule = {"protocol": "tcp", "fromPort": 22, "toPort": 22, "securityGroups": ["sg-other"]}
    assert messages(with_ingress(rule), INGRESS) == [
        GROUP
        + "ingress[1] admits security group sg-other, not only this group's own members: allow peers with a "
        "self-referencing rule (self = true) and reach instances with SSM Session Manager"
    ]


def test_an_unreviewed_prefix_list_names_the_config_key_that_accepts_it() -> None:
    rule = {"protocol": "tcp", "fromPort": 443, "toPort": 443, "prefixListIds": ["pl-4ea04527"]}
    assert messages(with_ingress(rule), INGRESS) == [
        GROUP
        + "ingress[1] admits prefix list pl-4ea04527 on ports 443-443, whose addresses this pack cannot "
        "judge: allow narrow CIDRs or use SSM Session Manager (or list the prefix list in the policy's "
        "authorizedPrefixListIds once reviewed)"
    ]
    assert messages(with_ingress(rule), INGRESS, {"authorizedPrefixListIds": ["pl-4ea04527"]}) == []


def test_all_protocol_egress_to_the_internet_says_which_ports_to_allow() -> None:
    resources = compliant_stack()
    named(resources, "instances").props["egress"].append(
        {"protocol": "-1", "fromPort": 0, "toPort": 0, "cidrBlocks": ["0.0.0.0/0"]}
    )
    assert messages(resources, EGRESS) == [
        GROUP
        + "egress[1] allows all protocols and ports to 0.0.0.0/0: allow only the ports the instances need "
        "(tcp 443 for AWS APIs and package indexes)"
    ]


# -- the ARN shapes the identity rules judge resources with -------------------------------------------


def test_an_arn_shape_matches_the_arns_of_its_service_and_resource_type() -> None:
    key = arn_shape("kms", "key/")
    assert matches_shape("arn:aws:kms:us-east-1:123456789012:key/1234abcd", key)
    assert matches_shape("ARN:AWS:KMS:US-EAST-1:123456789012:KEY/1234ABCD", key), "compared case-blind"
    assert not matches_shape("arn:aws:kms:us-east-1:123456789012:alias/x", key)
    role = arn_shape("iam", "role/", regional=False)
    assert matches_shape("arn:aws:iam::123456789012:role/trainstack", role), "IAM ARNs have no region"
    assert not matches_shape("arn:aws:iam:us-east-1:123456789012:role/trainstack", role)


def test_a_reviewed_public_port_is_not_refused_for_its_prefix_list_either() -> None:
    """`authorizedPublicPorts` says the port may be open to the world: a prefix list on it admits no more."""
    rule = {"protocol": "tcp", "fromPort": 443, "toPort": 443, "prefixListIds": ["pl-4ea04527"]}
    assert messages(with_ingress(rule), INGRESS, {"authorizedPublicPorts": [443]}) == []


def rule_resource(type_: str, **props: Any) -> list[Resource]:
    resources = compliant_stack()
    resources.append(Resource(type_, "extra-rule", {"securityGroupId": "sg-1", **props}))
    return resources


def test_a_separate_rule_with_an_unreviewed_prefix_list_says_which_ports() -> None:
    resources = rule_resource(
        "aws:ec2/securityGroupRule:SecurityGroupRule",
        type="ingress", protocol="tcp", fromPort=443, toPort=443, prefixListIds=["pl-4ea04527"],
    )  # fmt: skip
    assert messages(resources, INGRESS) == [
        "aws.ec2.SecurityGroupRule 'extra-rule': the rule admits prefix list pl-4ea04527 on ports 443-443, "
        "whose addresses this pack cannot judge: allow narrow CIDRs or use SSM Session Manager (or list the "
        "prefix list in the policy's authorizedPrefixListIds once reviewed)"
    ]


@pytest.mark.parametrize(
    "type_, props",
    [
        (
            "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule",
            {"ipProtocol": "tcp", "fromPort": 443, "toPort": 443, "cidrIpv4": "0.0.0.0/0"},
        ),
        (
            "aws:ec2/securityGroupRule:SecurityGroupRule",
            {
                "type": "ingress",
                "protocol": "tcp",
                "fromPort": 443,
                "toPort": 443,
                "cidrBlocks": ["0.0.0.0/0"],
            },
        ),
    ],
    ids=["vpc-ingress-rule", "ec2-rule"],
)
def test_a_separate_rule_on_a_reviewed_public_port_passes(type_: str, props: dict[str, Any]) -> None:
    resources = rule_resource(type_, **props)
    assert messages(resources, INGRESS), "not reviewed: refused"
    assert messages(resources, INGRESS, {"authorizedPublicPorts": [443]}) == []


def test_prefix_lists_known_only_after_up_never_fail_the_preview() -> None:
    rule = {"protocol": "tcp", "fromPort": 443, "toPort": 443, "prefixListIds": UNKNOWN_ARRAY_VALUE}
    assert messages(with_ingress(rule), INGRESS) == []


def test_a_vpc_ingress_rule_with_an_unreviewed_prefix_list_says_which_ports() -> None:
    resources = rule_resource(
        "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule",
        ipProtocol="tcp", fromPort=443, toPort=443, prefixListId="pl-4ea04527",
    )  # fmt: skip
    assert messages(resources, INGRESS) == [
        "aws.vpc.SecurityGroupIngressRule 'extra-rule': the rule admits prefix list pl-4ea04527 on ports "
        "443-443, whose addresses this pack cannot judge: allow narrow CIDRs or use SSM Session Manager (or "
        "list the prefix list in the policy's authorizedPrefixListIds once reviewed)"
    ]


def test_many_blocks_that_add_up_to_the_internet_are_named_three_and_a_share() -> None:
    """The line shows the first three blocks of the union and how much of the address space it is."""
    blocks = ["0.0.0.0/3", "64.0.0.0/3", "128.0.0.0/3", "192.0.0.0/3"]
    rule = {"protocol": "tcp", "fromPort": 22, "toPort": 22, "cidrBlocks": blocks}
    assert messages(with_ingress(rule), INGRESS) == [
        GROUP + "ingress[1] opens ports 22-22 to 0.0.0.0/3, 64.0.0.0/3, 128.0.0.0/3, ... (50% of all IPv4 "
        "addresses), more than an IPv4 /8 or IPv6 /32, which counts as the internet and is refused: use SSM "
        "Session Manager, or allow narrower CIDRs (or list the port in the policy's authorizedPublicPorts "
        "config)"
    ]
    three = {**rule, "cidrBlocks": blocks[:3]}
    assert messages(with_ingress(three), INGRESS)[0].startswith(
        GROUP + "ingress[1] opens ports 22-22 to 0.0.0.0/3, 64.0.0.0/3, 128.0.0.0/3 (38% of all"
    )


def found(
    resources: list[Resource], config: dict[str, dict[str, Any]] | None = None
) -> list[tuple[str, str]]:
    """(policy, message) of every violation, for the assertions that name the resource too."""
    return [(v.policy, v.message) for v in check(resources, config)]


def urn(type_: str, name: str) -> str:
    return f"urn:pulumi:test::trainstack::{type_}::{name}"


# -- storage -------------------------------------------------------------------------------------------


def test_a_public_access_setting_left_off_is_named_on_the_block_and_on_its_bucket() -> None:
    resources = compliant_stack()
    named(resources, "bucket-public-access").props["ignorePublicAcls"] = False
    assert found(resources) == [
        (
            "s3-public-access-blocked",
            "aws.s3.BucketPublicAccessBlock 'bucket-public-access': set ignorePublicAcls = true",
        ),
        ("s3-public-access-blocked", "aws.s3.Bucket 'bucket': set ignorePublicAcls = true"),
    ]


def test_storage_settings_known_only_after_up_never_fail_the_preview() -> None:
    resources = compliant_stack()
    named(resources, "bucket-public-access").props["ignorePublicAcls"] = UNKNOWN_BOOLEAN_VALUE
    named(resources, "bucket-lifecycle").props["rules"][0]["status"] = UNKNOWN_STRING_VALUE
    assert found(resources) == []


@pytest.mark.parametrize(
    "spec, usage, refused",
    [
        ("SYMMETRIC_DEFAULT", None, True),
        (None, "ENCRYPT_DECRYPT", True),
        ("SYMMETRIC_DEFAULT", "ENCRYPT_DECRYPT", True),
        ("RSA_2048", None, False),
        (None, "SIGN_VERIFY", False),
        ("HMAC_256", "GENERATE_VERIFY_MAC", False),
    ],
)
def test_only_symmetric_encryption_keys_must_rotate(
    spec: str | None, usage: str | None, refused: bool
) -> None:
    """AWS rotates symmetric encryption keys only: an asymmetric or HMAC key cannot turn rotation on."""
    resources = compliant_stack()
    named(resources, "key").props.update(enableKeyRotation=False, customerMasterKeySpec=spec, keyUsage=usage)
    expected = [("kms-key-rotation-enabled", "aws.kms.Key 'key': set enableKeyRotation = true")]
    assert found(resources) == (expected if refused else [])


@pytest.mark.parametrize(
    "removed, violation",
    [
        (
            "bucket-lifecycle",
            (
                "s3-lifecycle-configured",
                "aws.s3.Bucket 'bucket': add an aws.s3.BucketLifecycleConfiguration (abort incomplete "
                "multipart uploads, expire noncurrent versions)",
            ),
        ),
        (
            "bucket-logging",
            (
                "s3-access-logging",
                "aws.s3.Bucket 'bucket': add an aws.s3.BucketLogging with target_bucket=<a separate log "
                "bucket> (whose policy lets logging.s3.amazonaws.com write)",
            ),
        ),
    ],
)
def test_a_missing_bucket_configuration_says_what_to_add(removed: str, violation: tuple[str, str]) -> None:
    resources = compliant_stack()
    resources.remove(named(resources, removed))
    assert found(resources) == [violation]


# -- flow logs -----------------------------------------------------------------------------------------

SHORT = (
    "vpc-flow-logs-retained",
    "aws.cloudwatch.LogGroup 'flow-logs': set retentionInDays to at least 365 for the VPC flow logs of "
    "aws.ec2.FlowLog 'flow-log' (it is 30)",
)


def test_a_flow_log_group_kept_too_short_is_refused_on_the_group_saying_how_long_it_is() -> None:
    resources = compliant_stack()
    named(resources, "flow-logs").props["retentionInDays"] = 30
    violations = [v for v in check(resources) if v.policy == SHORT[0]]
    assert violations == [Violation(*SHORT, urn("aws:cloudwatch/logGroup:LogGroup", "flow-logs"))]
    named(resources, "flow-logs").props["retentionInDays"] = UNKNOWN_NUMBER_VALUE
    assert found(resources) == [], "known only after up: judged then"


@pytest.mark.parametrize("by", ["name", "id", "arn"])
def test_a_flow_log_finds_its_group_by_any_of_its_names(by: str) -> None:
    """A flow log names its group by ARN (logDestination) or by name (the legacy logGroupName); the group
    may know only its id or ARN at preview. Found either way, the group's retention is judged."""
    resources = compliant_stack()
    group = named(resources, "flow-logs").props
    flow_log = named(resources, "flow-log").props
    group["retentionInDays"] = 30
    arn = "arn:aws:logs:us-east-1:123456789012:log-group:/x/y"
    if by == "name":
        flow_log.pop("logDestination")
        flow_log["logGroupName"] = group["name"]
    elif by == "id":
        group.update(name=UNKNOWN_STRING_VALUE, id="/trainstack/dev/vpc-flow-logs")
        flow_log.pop("logDestination")
        flow_log["logGroupName"] = "/trainstack/dev/vpc-flow-logs"
    else:
        group.update(name=UNKNOWN_STRING_VALUE, arn=arn)
        flow_log["logDestination"] = arn
    assert found(resources) == [SHORT]


def test_a_flow_log_into_an_undeclared_group_by_its_legacy_name_is_refused() -> None:
    resources = compliant_stack()
    flow_log = named(resources, "flow-log").props
    flow_log.pop("logDestination")
    flow_log["logGroupName"] = "/trainstack/dev/other"
    assert found(resources) == [
        (
            "vpc-flow-logs-retained",
            "aws.ec2.FlowLog 'flow-log': delivers to /trainstack/dev/other, a log group this stack does not "
            "declare (deleted, or kept elsewhere with no known retention): declare it as an "
            "aws.cloudwatch.LogGroup with retention_in_days >= 365 and kms_key_id",
        )
    ]


# -- settings written inline on the bucket (the provider's older, still accepted form) -------------------

DAYS_30 = {"days": 30}
LIFECYCLE = (
    "s3-lifecycle-configured",
    "aws.s3.Bucket 'bucket': add an aws.s3.BucketLifecycleConfiguration (abort incomplete multipart uploads, "
    "expire noncurrent versions)",
)


@pytest.mark.parametrize("algorithm, refused", [("aws:kms", False), ("AES256", True)])
def test_encryption_written_on_the_bucket_itself_is_judged_like_a_configuration(
    algorithm: str, refused: bool
) -> None:
    resources = compliant_stack()
    resources.remove(named(resources, "bucket-encryption"))
    rule = {"applyServerSideEncryptionByDefault": {"sseAlgorithm": algorithm, "kmsMasterKeyId": KEY_ARN}}
    named(resources, "bucket").props["serverSideEncryptionConfiguration"] = {"rule": rule}
    expected = (
        "s3-sse-kms",
        "aws.s3.Bucket 'bucket': add an aws.s3.BucketServerSideEncryptionConfiguration: "
        'apply_server_side_encryption_by_default sse_algorithm="aws:kms" with kms_master_key_id',
    )
    assert found(resources) == ([expected] if refused else [])


@pytest.mark.parametrize(
    "rule, refused",
    [
        (
            {
                "enabled": True,
                "abortIncompleteMultipartUploadDays": 1,
                "noncurrentVersionExpiration": DAYS_30,
            },
            False,
        ),
        ({"enabled": True, "noncurrentVersionTransitions": [{"days": 30, "storageClass": "GLACIER"}]}, False),
        ({"enabled": False, "noncurrentVersionExpiration": {"days": 30}}, True),
        ({"enabled": True, "abortIncompleteMultipartUploadDays": 1}, True),
    ],
    ids=["expires-old-versions", "moves-old-versions", "disabled", "keeps-old-versions-forever"],
)
def test_lifecycle_rules_written_on_a_versioned_bucket_must_be_enabled_and_end_old_versions(
    rule: dict[str, Any], refused: bool
) -> None:
    resources = compliant_stack()
    resources.remove(named(resources, "bucket-lifecycle"))
    named(resources, "bucket").props["lifecycleRules"] = [rule]
    assert found(resources) == ([LIFECYCLE] if refused else [])


def test_a_vpc_without_its_default_group_adopted_says_how_to_adopt_it() -> None:
    resources = [
        r for r in compliant_stack() if r.type != "aws:ec2/defaultSecurityGroup:DefaultSecurityGroup"
    ]
    assert found(resources) == [
        (
            "default-security-group-closed",
            "aws.ec2.Vpc 'vpc': adopt its default security group with "
            "aws.ec2.DefaultSecurityGroup(vpc_id=...) and no ingress or egress rules (left alone it allows "
            "all traffic between its members and out)",
        )
    ]


# -- TLS only, and decrypt on named keys ---------------------------------------------------------------


def document(*statements: dict[str, Any]) -> str:
    return json.dumps({"Version": "2012-10-17", "Statement": list(statements)})


def tls_deny(**changes: Any) -> dict[str, Any]:
    statement = {
        "Effect": "Deny",
        "Principal": "*",
        "Action": "s3:*",
        "Resource": [BUCKET_ARN, f"{BUCKET_ARN}/*"],
        "Condition": {"Bool": {"aws:SecureTransport": "false"}},
    }
    return {**statement, **changes}


LACKS_TLS = (
    "s3-tls-only",
    "aws.s3.Bucket 'bucket': its bucket policy lacks a Deny of s3:* for Principal * when "
    '{"Bool": {"aws:SecureTransport": "false"}}: add one',
)


@pytest.mark.parametrize(
    "changes, refused",
    [
        ({"Condition": {"BoolIfExists": {"aws:SecureTransport": "false"}}}, False),
        ({"Principal": {"AWS": "arn:aws:iam::123456789012:role/x"}}, True),
        ({"Action": "s3:GetObject"}, True),
        ({"Action": "s3:PutObject"}, True),
        ({"Condition": {"Bool": {"aws:SecureTransport": "true"}}}, True),
        ({"Condition": {"Bool": {"aws:ViaAWSService": "false"}}}, True),
    ],
    ids=["bool-if-exists", "one-principal-only", "reads-only", "writes-only", "denies-tls", "other-key"],
)
def test_only_a_deny_of_every_plain_http_request_by_anyone_makes_a_bucket_tls_only(
    changes: dict[str, Any], refused: bool
) -> None:
    resources = compliant_stack()
    named(resources, "bucket-policy").props["policy"] = document(tls_deny(**changes))
    assert found(resources) == ([LACKS_TLS] if refused else [])


def test_a_tls_deny_written_on_the_bucket_itself_counts_and_its_absence_says_what_to_add() -> None:
    resources = compliant_stack()
    resources.remove(named(resources, "bucket-policy"))
    named(resources, "bucket").props["policy"] = document(tls_deny())
    assert found(resources) == []
    reads = {
        "Effect": "Allow",
        "Principal": {"AWS": f"arn:aws:iam::{ACCOUNT}:root"},
        "Action": "s3:GetObject",
    }
    named(resources, "bucket").props["policy"] = document({**reads, "Resource": f"{BUCKET_ARN}/*"})
    assert found(resources) == [
        (
            "s3-tls-only",
            "aws.s3.Bucket 'bucket': add an aws.s3.BucketPolicy with a Deny of s3:* for Principal * when "
            '{"Bool": {"aws:SecureTransport": "false"}}',
        )
    ]


def test_decrypt_on_every_key_is_refused_in_a_roles_inline_policy_and_through_not_resource() -> None:
    resources = compliant_stack()
    every_key = {"Effect": "Allow", "Action": "kms:Decrypt", "Resource": "*"}
    named(resources, "instance-role").props["inlinePolicies"] = [{"name": "x", "policy": document(every_key)}]
    named(resources, "instance-policy").props["policy"] = document(
        {"Effect": "Allow", "Action": "kms:Decrypt", "NotResource": KEY_ARN}
    )
    assert found(resources) == [
        (
            "kms-no-decrypt-on-all-keys",
            "aws.iam.Policy 'instance-policy': policy Statement[0] allows kms:Decrypt with NotResource, "
            "which is every KMS key it does not list: name the key ARNs in Resource",
        ),
        (
            "kms-no-decrypt-on-all-keys",
            "aws.iam.Role 'instance-role': inlinePolicies[0].policy Statement[0] allows kms:Decrypt on every "
            "KMS key: name the key ARNs in Resource",
        ),
    ]


# -- ACLs, managed admin policies, versioning ----------------------------------------------------------

ACL_TYPE = "aws:s3/bucketAclV2:BucketAclV2"


@pytest.mark.parametrize(
    "where, props, refused",
    [
        (
            ACL_TYPE,
            {"accessControlPolicy": {"owner": {"id": "x"}}},
            "aws.s3.BucketAclV2 'acl': remove the ACL",
        ),
        (ACL_TYPE, {"acl": "public-read"}, "aws.s3.BucketAclV2 'acl': remove the ACL"),
        (ACL_TYPE, {"acl": "private"}, None),
        ("bucket", {"acl": "public-read"}, "aws.s3.Bucket 'bucket': remove acl/grants"),
        ("bucket", {"acl": "private"}, None),
    ],
    ids=[
        "acl-resource-grants",
        "acl-resource-public",
        "acl-resource-private",
        "bucket-public",
        "bucket-private",
    ],
)
def test_acls_are_refused_unless_private(where: str, props: dict[str, Any], refused: str | None) -> None:
    resources = compliant_stack()
    if where == "bucket":
        named(resources, "bucket").props.update(props)
    else:
        resources.append(Resource(where, "acl", {"bucket": "trainstack-dev-artifacts", **props}))
    fix = "and grant access through IAM or the bucket policy"
    assert found(resources) == ([("s3-no-acls", f"{refused} {fix}")] if refused else [])


def test_an_aws_managed_admin_policy_is_refused_with_the_fix() -> None:
    resources = compliant_stack()
    resources.append(
        Resource(
            "aws:iam/rolePolicyAttachment:RolePolicyAttachment",
            "admin",
            {"role": "r", "policyArn": "arn:aws:iam::aws:policy/AdministratorAccess"},
        )
    )
    assert found(resources) == [
        (
            "iam-no-admin-managed-policies",
            "aws.iam.RolePolicyAttachment 'admin': policyArn attaches the AWS managed AdministratorAccess, "
            "which grants far more than one stack needs: attach a policy that names the actions and "
            "resources it needs",
        )
    ]


def test_an_unversioned_bucket_is_refused_on_the_bucket() -> None:
    resources = compliant_stack()
    resources.remove(named(resources, "bucket-versioning"))
    assert check(resources) == [
        Violation(
            "s3-versioning-enabled",
            "aws.s3.Bucket 'bucket': add an aws.s3.BucketVersioning with versioning_configuration "
            'status="Enabled"',
            urn("aws:s3/bucket:Bucket", "bucket"),
        )
    ]


def test_behind_nat_an_instance_asking_for_a_public_address_is_refused_on_the_instance() -> None:
    resources = multinode_efa_stack()
    resources.append(Resource("aws:ec2/instance:Instance", "box", {"associatePublicIpAddress": True}))
    refused = [v for v in check(resources) if v.policy == "no-public-ip-with-private-networking"]
    assert refused == [
        Violation(
            "no-public-ip-with-private-networking",
            "aws.ec2.Instance 'box': set associatePublicIpAddress = false (the stack routes egress through a "
            "NAT gateway)",
            urn("aws:ec2/instance:Instance", "box"),
        )
    ]
    named(resources, "box").props["associatePublicIpAddress"] = False
    assert [v for v in check(resources) if v.policy == "no-public-ip-with-private-networking"] == []


# -- the access-log bucket: found by any of the three ways a stack says so ---------------------------------
# A log bucket may use SSE-S3 (S3 log delivery supports nothing else) and logs no accesses of its own.


def tls_only_log_bucket_policy() -> str:
    """The log bucket's policy without its log-delivery grant: TLS only, nothing that marks a log bucket."""
    statements = json.loads(ACCESS_LOG_BUCKET_POLICY)["Statement"]
    return document(*[s for s in statements if s["Sid"] == "DenyInsecureTransport"])


def test_a_bucket_logging_into_the_log_bucket_makes_it_a_log_bucket_whatever_its_policy_says() -> None:
    resources = compliant_stack()
    named(resources, "access-logs-policy").props["policy"] = tls_only_log_bucket_policy()
    assert found(resources) == []


def test_the_source_buckets_inline_logging_makes_the_log_bucket_a_log_bucket() -> None:
    """The provider's older form: `logging` written on the source bucket, no BucketLogging resource."""
    resources = compliant_stack()
    resources.remove(named(resources, "bucket-logging"))
    named(resources, "bucket").props["logging"] = {"targetBucket": LOG_BUCKET, "targetPrefix": "s3-access/"}
    named(resources, "access-logs-policy").props["policy"] = tls_only_log_bucket_policy()
    assert found(resources) == []


def test_a_bucket_whose_own_policy_lets_log_delivery_write_is_a_log_bucket_with_nothing_pointing_at_it() -> (
    None
):
    """The stack's buckets log into a bucket of another stack; this one is still a log bucket (for another
    stack's buckets): its policy, written on the bucket itself, lets logging.s3.amazonaws.com write."""
    resources = compliant_stack()
    named(resources, "bucket-logging").props["targetBucket"] = "central-access-logs"
    resources.remove(named(resources, "access-logs-policy"))
    named(resources, "access-logs").props["policy"] = ACCESS_LOG_BUCKET_POLICY
    assert found(resources) == []


def test_sse_s3_is_refused_on_a_bucket_that_only_another_buckets_logging_mentions() -> None:
    """A BucketLogging of some other bucket into the log bucket says nothing about the data bucket."""
    resources = compliant_stack()
    resources.append(
        Resource(
            "aws:s3/bucketLogging:BucketLogging",
            "elsewhere-logging",
            {"bucket": "a-bucket-of-another-stack", "targetBucket": LOG_BUCKET},
        )
    )
    encryption = named(resources, "bucket-encryption").props
    encryption["rules"] = [{"applyServerSideEncryptionByDefault": {"sseAlgorithm": "AES256"}}]
    assert found(resources) == [
        ("s3-sse-kms", "aws.s3.Bucket 'bucket': set sseAlgorithm = \"aws:kms\" (it is AES256)")
    ]


# -- values known only after `up`: deferred to `up`, never a failure at preview ---------------------------


def test_an_encryption_algorithm_known_only_after_up_never_fails_the_preview() -> None:
    resources = compliant_stack()
    default = named(resources, "bucket-encryption").props["rules"][0]["applyServerSideEncryptionByDefault"]
    default["sseAlgorithm"] = UNKNOWN_STRING_VALUE
    assert found(resources) == []
    default["sseAlgorithm"] = "AES256"
    assert found(resources) == [
        ("s3-sse-kms", "aws.s3.Bucket 'bucket': set sseAlgorithm = \"aws:kms\" (it is AES256)")
    ], "known, the same value fails"


@pytest.mark.parametrize("where", ["inline", "resource"])
def test_versioning_known_only_after_up_never_fails_the_preview(where: str) -> None:
    resources = compliant_stack()
    if where == "inline":
        resources.remove(named(resources, "bucket-versioning"))
        named(resources, "bucket").props["versioning"] = {"enabled": UNKNOWN_BOOLEAN_VALUE}
    else:
        versioning = named(resources, "bucket-versioning").props["versioningConfiguration"]
        versioning["status"] = UNKNOWN_STRING_VALUE
    assert found(resources) == []


def test_an_egress_protocol_known_only_after_up_is_deferred_not_judged_by_its_ports() -> None:
    resources = compliant_stack()
    named(resources, "instances").props["egress"].append(
        {"protocol": UNKNOWN_STRING_VALUE, "fromPort": 0, "toPort": 65535, "cidrBlocks": ["0.0.0.0/0"]}
    )
    verdict = evaluate(resources)
    assert verdict.violations == []
    assert [(d.policy, d.resource) for d in verdict.deferred] == [(EGRESS, "instances")]


def test_an_egress_rule_without_a_protocol_is_all_traffic() -> None:
    """AWS's default for a rule that names no protocol is -1, every protocol and port."""
    resources = rule_resource(
        "aws:vpc/securityGroupEgressRule:SecurityGroupEgressRule", fromPort=0, toPort=0, cidrIpv4="0.0.0.0/0"
    )
    assert found(resources) == [
        (
            EGRESS,
            "aws.vpc.SecurityGroupEgressRule 'extra-rule': the rule allows all protocols and ports to "
            "0.0.0.0/0: allow only the ports the instances need (tcp 443 for AWS APIs and package indexes)",
        )
    ]


def test_a_roles_inline_policies_known_only_after_up_are_deferred() -> None:
    resources = compliant_stack()
    named(resources, "instance-role").props["inlinePolicies"] = UNKNOWN_ARRAY_VALUE
    verdict = evaluate(resources)
    assert verdict.violations == []
    assert Deferred("kms-no-decrypt-on-all-keys", "instance-role", verdict.deferred[0].message) in (
        verdict.deferred
    )


# -- the S3 endpoint's policy: every endpoint and every statement judged ----------------------------------

ENDPOINT = "s3-endpoint-policy-scoped"
ENDPOINT_URN = urn("aws:ec2/vpcEndpoint:VpcEndpoint", "s3-endpoint")


def test_an_s3_endpoint_without_a_policy_is_refused_after_an_endpoint_of_another_service() -> None:
    resources = compliant_stack()
    other = Resource(
        "aws:ec2/vpcEndpoint:VpcEndpoint",
        "ssm-endpoint",
        {"vpcId": "vpc-0abc", "serviceName": "com.amazonaws.us-east-1.ssm", "vpcEndpointType": "Interface"},
    )
    resources.insert(resources.index(named(resources, "s3-endpoint")), other)
    del named(resources, "s3-endpoint").props["policy"]
    assert [v for v in check(resources) if v.policy == ENDPOINT] == [
        Violation(
            ENDPOINT,
            "aws.ec2.VpcEndpoint 's3-endpoint': set a policy allowing the stack's bucket only (without one "
            "the endpoint reaches every bucket of every account)",
            ENDPOINT_URN,
        )
    ]


def test_an_s3_endpoint_policy_is_judged_past_a_deny_other_services_and_a_not_resource() -> None:
    """Every statement of the document is judged, whatever comes before it."""
    resources = compliant_stack()
    named(resources, "s3-endpoint").props["policy"] = document(
        {"Effect": "Deny", "Principal": "*", "Action": "s3:DeleteBucket", "Resource": "*"},
        {"Effect": "Allow", "Principal": "*", "Action": "dynamodb:GetItem", "Resource": "*"},
        {"Effect": "Allow", "Principal": "*", "Action": "s3:GetObject", "NotResource": f"{BUCKET_ARN}/*"},
        {"Effect": "Allow", "Principal": "*", "Action": "s3:*", "Resource": "*"},
    )
    where = "aws.ec2.VpcEndpoint 's3-endpoint': policy "
    assert [v for v in check(resources) if v.policy == ENDPOINT] == [
        Violation(
            ENDPOINT,
            where + "Statement[2] allows S3 with NotResource: name the stack's bucket in Resource",
            ENDPOINT_URN,
        ),
        Violation(
            ENDPOINT,
            where
            + "Statement[3] allows s3:GetObject, s3:PutObject, s3:ListBucket on *, every bucket: name the "
            "stack's bucket (arn:aws:s3:::<bucket> and arn:aws:s3:::<bucket>/*)",
            ENDPOINT_URN,
        ),
    ]


def test_a_literal_prefix_ends_at_the_first_wildcard_of_either_kind() -> None:
    """What a Resource pattern pins down exactly (the S3 endpoint and grant rules judge the bucket in it)."""
    assert literal_prefix(" arn:aws:s3:::b?cket/key?") == "arn:aws:s3:::b"
    assert literal_prefix("arn:aws:s3:::bucket/a?b*c?") == "arn:aws:s3:::bucket/a"
    assert literal_prefix("arn:aws:s3:::bucket/*?") == "arn:aws:s3:::bucket/"
    assert literal_prefix("arn:aws:s3:::bucket") == "arn:aws:s3:::bucket"
    assert literal_prefix("arn:aws:s3:::b*/data/*") == "arn:aws:s3:::b", "the first `*`, not the last"
    assert literal_prefix(" *") == literal_prefix("?x") == "", "a wildcard first pins down nothing"


# -- lists known only after `up`: never a failure, never a crash of the policy ----------------------------


def _set_at(props: dict[str, Any], path: tuple[str | int, ...], value: Any) -> None:
    for step in path[:-1]:
        props = props[step]  # type: ignore[index]
    props[path[-1]] = value  # type: ignore[index]


@pytest.mark.parametrize(
    "resource, path",
    [
        ("instance-role", ("inlinePolicies",)),
        ("instance-role", ("managedPolicyArns",)),
        ("instances", ("ingress",)),
        ("instances", ("egress",)),
        ("instances", ("ingress", 0, "cidrBlocks")),
        ("instances", ("ingress", 0, "securityGroups")),
        ("default-sg", ("ingress",)),
        ("default-sg", ("egress",)),
        ("launch-template", ("networkInterfaces",)),
        ("bucket-encryption", ("rules",)),
        ("bucket-lifecycle", ("rules",)),
    ],
)
def test_a_list_known_only_after_up_never_fails_the_preview(
    resource: str, path: tuple[str | int, ...]
) -> None:
    """Behind NAT (the multi-node EFA stack), so that the public-address rule reads the interfaces too."""
    resources = multinode_efa_stack()
    _set_at(named(resources, resource).props, path, UNKNOWN_ARRAY_VALUE)
    assert evaluate(resources).violations == []


def test_lifecycle_rules_written_on_the_bucket_known_only_after_up_never_fail_the_preview() -> None:
    resources = compliant_stack()
    resources.remove(named(resources, "bucket-lifecycle"))
    named(resources, "bucket").props["lifecycleRules"] = UNKNOWN_ARRAY_VALUE
    assert found(resources) == []
    resources.remove(named(resources, "access-logs-lifecycle"))
    assert found(resources) == [
        (
            "s3-lifecycle-configured",
            "aws.s3.Bucket 'access-logs': add an aws.s3.BucketLifecycleConfiguration (abort incomplete "
            "multipart uploads, expire noncurrent versions)",
        )
    ], "the next bucket is still judged"


def test_an_ingress_rule_without_a_protocol_opens_all_ports() -> None:
    """AWS's default protocol is -1: the line says all ports, not the 0-0 the rule happens to carry."""
    rule = {"fromPort": 0, "toPort": 0, "cidrBlocks": ["0.0.0.0/0"]}
    assert messages(with_ingress(rule), INGRESS) == [
        GROUP
        + "ingress[1] opens all ports to 0.0.0.0/0, more than an IPv4 /8 or IPv6 /32, which counts as the "
        "internet and is refused: use SSM Session Manager, or allow narrower CIDRs (or list the port in the "
        "policy's authorizedPublicPorts config)"
    ]


SG_RULE = "aws:ec2/securityGroupRule:SecurityGroupRule"


def test_a_separate_rule_from_the_internet_is_refused_naming_the_rule() -> None:
    resources = rule_resource(
        SG_RULE, type="ingress", protocol="tcp", fromPort=22, toPort=22, cidrBlocks=["0.0.0.0/0"]
    )
    assert messages(resources, INGRESS) == [
        "aws.ec2.SecurityGroupRule 'extra-rule': the rule opens ports 22-22 to 0.0.0.0/0, more than an IPv4 "
        "/8 or IPv6 /32, which counts as the internet and is refused: use SSM Session Manager, or allow "
        "narrower CIDRs (or list the port in the policy's authorizedPublicPorts config)"
    ]


def test_the_whole_ipv6_internet_is_named_without_a_share_and_half_of_it_with_one() -> None:
    whole = {"protocol": "tcp", "fromPort": 22, "toPort": 22, "ipv6CidrBlocks": ["::/0"]}
    half = {**whole, "ipv6CidrBlocks": ["8000::/1"]}
    assert messages(with_ingress(whole), INGRESS)[0].startswith(
        GROUP + "ingress[1] opens ports 22-22 to ::/0, more"
    )
    assert messages(with_ingress(half), INGRESS)[0].startswith(
        GROUP + "ingress[1] opens ports 22-22 to 8000::/1 (50% of all IPv6 addresses), more"
    )


def test_an_empty_source_group_on_a_separate_rule_is_no_other_group() -> None:
    """The provider leaves an unset source group empty: the rule admits its CIDRs only."""
    resources = rule_resource(
        SG_RULE, type="ingress", protocol="tcp", fromPort=22, toPort=22, cidrBlocks=["203.0.113.7/32"],
        sourceSecurityGroupId="",
    )  # fmt: skip
    assert messages(resources, INGRESS) == []


def test_another_group_as_the_source_of_a_rule_whose_own_group_is_known_only_after_up_waits_for_up() -> None:
    """Whether the source is the rule's own group (a self rule, allowed) is known only when both ids are."""
    resources = rule_resource(SG_RULE, type="ingress", protocol="tcp", fromPort=22, toPort=22,
                              sourceSecurityGroupId="sg-other")  # fmt: skip
    named(resources, "extra-rule").props["securityGroupId"] = UNKNOWN_STRING_VALUE
    assert messages(resources, INGRESS) == []
    named(resources, "extra-rule").props["securityGroupId"] = "sg-1"
    assert messages(resources, INGRESS) == [
        "aws.ec2.SecurityGroupRule 'extra-rule': the rule admits security group sg-other, not only this "
        "group's own members: allow peers with a self-referencing rule (self = true) and reach instances "
        "with SSM Session Manager"
    ]


@pytest.mark.parametrize("missing", ["fromPort", "toPort"])
def test_authorized_public_ports_never_cover_a_rule_missing_one_end_of_its_range(missing: str) -> None:
    rule = {"protocol": "tcp", "fromPort": 22, "toPort": 22, "cidrBlocks": ["0.0.0.0/0"]}
    del rule[missing]
    refused = messages(with_ingress(rule), INGRESS, {"authorizedPublicPorts": [22]})
    assert len(refused) == 1 and refused[0].startswith(GROUP + "ingress[1] opens ports ")


def test_a_logging_target_known_only_after_up_never_fails_the_preview() -> None:
    """Whether the bucket logs into itself is known only when the target is."""
    resources = compliant_stack()
    named(resources, "bucket-logging").props["targetBucket"] = UNKNOWN_STRING_VALUE
    assert found(resources) == []


def test_a_separate_endpoint_policy_is_judged_like_one_written_on_the_endpoint() -> None:
    resources = compliant_stack()
    del named(resources, "s3-endpoint").props["policy"]
    every_bucket = {"Effect": "Allow", "Principal": "*", "Action": "s3:*", "Resource": "*"}
    resources.append(
        Resource(
            "aws:ec2/vpcEndpointPolicy:VpcEndpointPolicy",
            "endpoint-policy",
            {"vpcEndpointId": "vpce-1", "policy": document(every_bucket)},
            {"vpcEndpointId": ["s3-endpoint"]},
        )
    )
    assert [v.message for v in check(resources) if v.policy == ENDPOINT] == [
        "aws.ec2.VpcEndpoint 's3-endpoint': the policy of aws.ec2.VpcEndpointPolicy 'endpoint-policy' "
        "Statement[0] allows s3:GetObject, s3:PutObject, s3:ListBucket on *, every bucket: name the stack's "
        "bucket (arn:aws:s3:::<bucket> and arn:aws:s3:::<bucket>/*)"
    ]


def test_a_managed_policy_list_with_an_empty_entry_still_judges_the_others() -> None:
    resources = compliant_stack()
    admin = "arn:aws:iam::aws:policy/AdministratorAccess"
    named(resources, "instance-role").props["managedPolicyArns"] = [None, admin]
    assert found(resources) == [
        (
            "iam-no-admin-managed-policies",
            "aws.iam.Role 'instance-role': managedPolicyArns[1] attaches the AWS managed "
            "AdministratorAccess, which grants far more than one stack needs: attach a policy that names the "
            "actions and resources it needs",
        )
    ]


def test_decrypt_and_re_encrypt_on_every_key_are_named_together() -> None:
    resources = compliant_stack()
    named(resources, "instance-policy").props["policy"] = document(
        {"Effect": "Allow", "Action": ["kms:Decrypt", "kms:ReEncryptFrom"], "Resource": "*"}
    )
    assert found(resources) == [
        (
            "kms-no-decrypt-on-all-keys",
            "aws.iam.Policy 'instance-policy': policy Statement[0] allows kms:Decrypt, kms:ReEncryptFrom on "
            "every KMS key: name the key ARNs in Resource",
        )
    ]


def test_a_bucket_whose_policy_denies_log_delivery_is_no_log_bucket() -> None:
    """Naming S3 log delivery in a Deny does not make a data bucket a log bucket (exempt from SSE-KMS)."""
    resources = compliant_stack()
    deny_logs = {
        "Effect": "Deny",
        "Principal": {"Service": "logging.s3.amazonaws.com"},
        "Action": "s3:PutObject",
        "Resource": f"{BUCKET_ARN}/*",
    }
    statements = json.loads(named(resources, "bucket-policy").props["policy"])["Statement"]
    named(resources, "bucket-policy").props["policy"] = document(*statements, deny_logs)
    encryption = named(resources, "bucket-encryption").props
    encryption["rules"] = [{"applyServerSideEncryptionByDefault": {"sseAlgorithm": "AES256"}}]
    assert found(resources) == [
        ("s3-sse-kms", "aws.s3.Bucket 'bucket': set sseAlgorithm = \"aws:kms\" (it is AES256)")
    ]


def test_a_bucket_after_buckets_configured_inline_is_still_judged_by_every_bucket_rule() -> None:
    resources = compliant_stack()
    for configuration in ("bucket-logging", "bucket-encryption"):
        resources.remove(named(resources, configuration))
    bucket = named(resources, "bucket").props
    bucket["logging"] = {"targetBucket": LOG_BUCKET, "targetPrefix": "s3-access/"}
    rule = {"applyServerSideEncryptionByDefault": {"sseAlgorithm": "aws:kms", "kmsMasterKeyId": KEY_ARN}}
    bucket["serverSideEncryptionConfiguration"] = {"rule": rule}
    assert found(resources) == []
    resources.append(Resource("aws:s3/bucket:Bucket", "late", {"bucket": "late", "id": "late"}))
    judged = {v.policy for v in check(resources) if v.message.startswith("aws.s3.Bucket 'late': ")}
    assert judged == {
        "s3-public-access-blocked",
        "s3-tls-only",
        "s3-sse-kms",
        "s3-versioning-enabled",
        "s3-lifecycle-configured",
        "s3-access-logging",
    }


def test_every_public_access_setting_left_off_is_named_in_one_line() -> None:
    resources = compliant_stack()
    named(resources, "bucket-public-access").props.update(blockPublicAcls=False, ignorePublicAcls=False)
    fix = "set blockPublicAcls, ignorePublicAcls = true"
    assert found(resources) == [
        ("s3-public-access-blocked", f"aws.s3.BucketPublicAccessBlock 'bucket-public-access': {fix}"),
        ("s3-public-access-blocked", f"aws.s3.Bucket 'bucket': {fix}"),
    ]


@pytest.mark.parametrize("direction", ["ingress", "egress"])
def test_a_rule_on_the_default_security_group_is_refused_on_the_group(direction: str) -> None:
    resources = compliant_stack()
    named(resources, "default-sg").props[direction] = [
        {"protocol": "-1", "fromPort": 0, "toPort": 0, "self": True}
    ]
    refused = [v for v in check(resources) if v.policy == "default-security-group-closed"]
    assert refused == [
        Violation(
            "default-security-group-closed",
            f"aws.ec2.DefaultSecurityGroup 'default-sg': remove every {direction} rule (a default group "
            "allows nothing)",
            urn("aws:ec2/defaultSecurityGroup:DefaultSecurityGroup", "default-sg"),
        )
    ]


def test_behind_nat_a_launch_template_asking_for_a_public_address_is_refused_on_the_template() -> None:
    resources = multinode_efa_stack()
    named(resources, "launch-template").props["networkInterfaces"][0]["associatePublicIpAddress"] = "true"
    refused = [v for v in check(resources) if v.policy == "no-public-ip-with-private-networking"]
    assert refused == [
        Violation(
            "no-public-ip-with-private-networking",
            "aws.ec2.LaunchTemplate 'launch-template': set networkInterfaces[0].associatePublicIpAddress = "
            '"false" (the stack routes egress through a NAT gateway)',
            urn("aws:ec2/launchTemplate:LaunchTemplate", "launch-template"),
        )
    ]


def test_a_flow_log_group_without_a_retention_says_it_is_unset() -> None:
    resources = compliant_stack()
    del named(resources, "flow-logs").props["retentionInDays"]
    unset = (
        "aws.cloudwatch.LogGroup 'flow-logs': set retentionInDays to at least 365 for the VPC flow logs of "
        "aws.ec2.FlowLog 'flow-log' (it is unset)"
    )
    assert ("vpc-flow-logs-retained", unset) in found(resources)


@pytest.mark.parametrize(
    "type_, props",
    [
        (SG_RULE, {"type": "egress", "protocol": "tcp", "cidrBlocks": ["0.0.0.0/0"]}),
        (
            "aws:vpc/securityGroupEgressRule:SecurityGroupEgressRule",
            {"ipProtocol": "tcp", "cidrIpv4": "0.0.0.0/0"},
        ),
    ],
    ids=["ec2-rule", "vpc-egress-rule"],
)
def test_a_separate_egress_rule_is_refused_for_all_protocols_only(type_: str, props: dict[str, Any]) -> None:
    """HTTPS out to the internet is what the instances need; every protocol and port is refused."""
    https = rule_resource(type_, **props, fromPort=443, toPort=443)
    assert messages(https, EGRESS) == []
    protocol = "protocol" if type_ == SG_RULE else "ipProtocol"
    everything = rule_resource(type_, **{**props, protocol: "-1"}, fromPort=0, toPort=0)
    assert messages(everything, EGRESS) == [
        f"{'aws.ec2.SecurityGroupRule' if type_ == SG_RULE else 'aws.vpc.SecurityGroupEgressRule'} "
        "'extra-rule': the rule allows all protocols and ports to 0.0.0.0/0: allow only the ports the "
        "instances need (tcp 443 for AWS APIs and package indexes)"
    ]


def test_versioning_written_on_the_bucket_itself_counts_only_when_enabled() -> None:
    resources = compliant_stack()
    resources.remove(named(resources, "bucket-versioning"))
    named(resources, "bucket").props["versioning"] = {"enabled": False}
    assert [v.policy for v in check(resources)] == ["s3-versioning-enabled"]
    named(resources, "bucket").props["versioning"] = {"enabled": True}
    assert found(resources) == []
    # Versioned, so its lifecycle must also end old versions.
    del named(resources, "bucket-lifecycle").props["rules"][0]["noncurrentVersionExpiration"]
    assert found(resources) == [
        (
            "s3-lifecycle-configured",
            "aws.s3.Bucket 'bucket': add noncurrent_version_expiration to an enabled rule in "
            "aws.s3.BucketLifecycleConfiguration 'bucket-lifecycle'",
        )
    ]


def test_an_unreadable_iam_policy_names_the_document_and_the_fix() -> None:
    resources = compliant_stack()
    named(resources, "instance-policy").props["policy"] = '{"Statement": ['
    refused = [v.message for v in check(resources) if v.policy == "kms-no-decrypt-on-all-keys"]
    assert refused == [
        "aws.iam.Policy 'instance-policy': policy: the policy document is not valid JSON (Expecting value): "
        "fix the JSON"
    ]


def test_a_log_bucket_known_by_its_id_only_is_found_through_the_source_buckets_inline_logging() -> None:
    """A bucket named by AWS from a prefix has no `bucket` property to compare, only its id."""
    resources = compliant_stack()
    resources.remove(named(resources, "bucket-logging"))
    named(resources, "bucket").props["logging"] = {"targetBucket": LOG_BUCKET, "targetPrefix": "s3-access/"}
    named(resources, "access-logs-policy").props["policy"] = tls_only_log_bucket_policy()
    del named(resources, "access-logs").props["bucket"]
    assert found(resources) == []


# -- exact lines on the resource that is wrong, edges, and one bad value never hiding more -------------

FLOW_LOG_URN = urn("aws:ec2/flowLog:FlowLog", "flow-log")


def test_a_public_access_setting_left_off_is_refused_on_the_block_itself() -> None:
    resources = compliant_stack()
    named(resources, "bucket-public-access").props["restrictPublicBuckets"] = False
    refused = [v for v in check(resources) if v.message.startswith("aws.s3.BucketPublicAccessBlock")]
    assert refused == [
        Violation(
            "s3-public-access-blocked",
            "aws.s3.BucketPublicAccessBlock 'bucket-public-access': set restrictPublicBuckets = true",
            urn("aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock", "bucket-public-access"),
        )
    ]


def test_sse_s3_written_on_the_log_bucket_itself_needs_no_configuration_resource() -> None:
    """S3 log delivery supports SSE-S3 only; written inline on the log bucket it is the whole answer."""
    resources = compliant_stack()
    resources.remove(named(resources, "access-logs-encryption"))
    rule = {"applyServerSideEncryptionByDefault": {"sseAlgorithm": "AES256"}}
    named(resources, "access-logs").props["serverSideEncryptionConfiguration"] = {"rule": rule}
    assert found(resources) == []


def test_versioning_known_only_after_up_never_fails_the_lifecycle_rule_at_preview() -> None:
    """Whether old versions must expire depends on versioning: unknown, the lifecycle is judged on `up`."""
    resources = compliant_stack()
    resources.remove(named(resources, "bucket-versioning"))
    named(resources, "bucket").props["versioning"] = {"enabled": UNKNOWN_BOOLEAN_VALUE}
    del named(resources, "bucket-lifecycle").props["rules"][0]["noncurrentVersionExpiration"]
    assert found(resources) == []


def test_an_unversioned_bucket_without_a_lifecycle_is_not_asked_to_expire_old_versions() -> None:
    resources = compliant_stack()
    for configuration in ("bucket-versioning", "bucket-lifecycle"):
        resources.remove(named(resources, configuration))
    assert (
        "s3-lifecycle-configured",
        "aws.s3.Bucket 'bucket': add an aws.s3.BucketLifecycleConfiguration (abort incomplete multipart "
        "uploads)",
    ) in found(resources)


def test_grants_written_on_the_bucket_are_refused_like_an_acl() -> None:
    resources = compliant_stack()
    named(resources, "bucket").props["grants"] = [
        {"type": "Group", "uri": "http://acs.amazonaws.com/groups/global/AllUsers", "permissions": ["READ"]}
    ]
    assert found(resources) == [
        (
            "s3-no-acls",
            "aws.s3.Bucket 'bucket': remove acl/grants and grant access through IAM or the bucket policy",
        )
    ]


def test_object_ownership_known_only_after_up_never_fails_the_preview() -> None:
    resources = compliant_stack()
    rule = named(resources, "bucket-ownership").props["rule"]
    rule["objectOwnership"] = UNKNOWN_STRING_VALUE
    assert found(resources) == []
    rule["objectOwnership"] = "ObjectWriter"
    assert found(resources) == [
        (
            "s3-no-acls",
            "aws.s3.BucketOwnershipControls 'bucket-ownership': set rule.objectOwnership = "
            '"BucketOwnerEnforced" (it is ObjectWriter)',
        )
    ], "known, the same rule fails"


def test_a_bucket_logging_into_itself_inline_is_not_logged() -> None:
    """Every delivery into the bucket would be logged again: inline logging into itself does not count."""
    resources = compliant_stack()
    resources.remove(named(resources, "bucket-logging"))
    named(resources, "bucket").props["logging"] = {"targetBucket": BUCKET, "targetPrefix": "s3-access/"}
    assert found(resources) == [
        (
            "s3-access-logging",
            "aws.s3.Bucket 'bucket': add an aws.s3.BucketLogging with target_bucket=<a separate log bucket> "
            "(whose policy lets logging.s3.amazonaws.com write)",
        )
    ]


def test_a_bucket_logging_without_a_target_names_the_logging_resource() -> None:
    """The log bucket stays one (its own policy lets log delivery write): only the data bucket is refused."""
    resources = compliant_stack()
    del named(resources, "bucket-logging").props["targetBucket"]
    assert found(resources) == [
        (
            "s3-access-logging",
            "aws.s3.Bucket 'bucket': set targetBucket on aws.s3.BucketLogging 'bucket-logging'",
        )
    ]


def test_an_unreadable_policy_on_the_log_bucket_never_hides_the_bucket_policy_that_makes_it_one() -> None:
    """Nothing of this stack logs into it (another stack's buckets do): its BucketPolicy, letting log
    delivery write, says it is a log bucket (SSE-S3 allowed, not logged itself) past an unreadable one."""
    resources = compliant_stack()
    named(resources, "bucket-logging").props["targetBucket"] = "central-access-logs"
    named(resources, "access-logs").props["policy"] = '{"Statement": ['
    assert [v for v in found(resources) if v[0] in ("s3-sse-kms", "s3-access-logging")] == []


def test_a_log_bucket_whose_id_is_known_only_after_up_is_found_by_its_name() -> None:
    resources = compliant_stack()
    resources.remove(named(resources, "bucket-logging"))
    named(resources, "bucket").props["logging"] = {"targetBucket": LOG_BUCKET, "targetPrefix": "s3-access/"}
    named(resources, "access-logs-policy").props["policy"] = tls_only_log_bucket_policy()
    named(resources, "access-logs").props["id"] = UNKNOWN_STRING_VALUE
    assert found(resources) == []


def test_decrypt_on_a_pattern_that_stops_short_of_a_key_arn_is_no_grant_on_every_key() -> None:
    """`arn:aws:kms:us-east-1:<account>:ke?` matches three-letter names only, never `key/<id>`."""
    resources = compliant_stack()
    short = f"arn:aws:kms:us-east-1:{ACCOUNT}:ke?"
    named(resources, "instance-policy").props["policy"] = document(
        {"Effect": "Allow", "Action": "kms:Decrypt", "Resource": short}
    )
    assert found(resources) == []
    assert not matches_shape("arn:aws:kms:us-east-?", arn_shape("kms", "key/"))


def test_decrypt_on_every_key_is_refused_after_a_statement_without_decrypt() -> None:
    resources = compliant_stack()
    named(resources, "instance-policy").props["policy"] = document(
        {"Effect": "Allow", "Action": "s3:GetObject", "Resource": f"{BUCKET_ARN}/*"},
        {"Effect": "Allow", "Action": "kms:Decrypt", "Resource": "*"},
    )
    assert found(resources) == [
        (
            "kms-no-decrypt-on-all-keys",
            "aws.iam.Policy 'instance-policy': policy Statement[1] allows kms:Decrypt on every KMS key: name "
            "the key ARNs in Resource",
        )
    ]


def test_authorized_public_ports_never_cover_a_rule_without_a_protocol() -> None:
    """No protocol is every protocol and every port, whatever ports the rule carries."""
    rule = {"fromPort": 22, "toPort": 22, "cidrBlocks": ["0.0.0.0/0"]}
    assert messages(with_ingress(rule), INGRESS, {"authorizedPublicPorts": [22]}) == [
        GROUP
        + "ingress[1] opens all ports to 0.0.0.0/0, more than an IPv4 /8 or IPv6 /32, which counts as the "
        "internet and is refused: use SSM Session Manager, or allow narrower CIDRs (or list the port in the "
        "policy's authorizedPublicPorts config)"
    ]


def test_authorized_public_ports_cover_a_range_whose_ends_are_1024_apart_port_by_port() -> None:
    """The edge of the bound: ends 1024 apart are judged port by port, 1025 apart are refused."""
    every_port = {"authorizedPublicPorts": list(range(1000, 2026))}
    edge = {"protocol": "tcp", "fromPort": 1000, "toPort": 2024, "cidrBlocks": ["0.0.0.0/0"]}
    assert messages(with_ingress(edge), INGRESS, every_port) == []
    assert messages(with_ingress({**edge, "toPort": 2025}), INGRESS, every_port)


def test_a_vpc_without_a_flow_log_says_what_to_add() -> None:
    resources = compliant_stack()
    resources.remove(named(resources, "flow-log"))
    assert found(resources) == [
        (
            "vpc-flow-logs-enabled",
            "aws.ec2.Vpc 'vpc': add an aws.ec2.FlowLog with vpc_id=<this VPC> and traffic_type=\"ALL\"",
        )
    ]


def test_a_flow_log_into_an_undeclared_group_is_refused_on_the_flow_log() -> None:
    resources = compliant_stack()
    named(resources, "flow-log").props["logDestination"] = "arn:aws:logs:us-east-1:123456789012:log-group:x"
    assert [v.urn for v in check(resources) if v.policy == "vpc-flow-logs-retained"] == [FLOW_LOG_URN]


def test_a_flow_log_whose_destination_is_known_only_after_up_finds_its_group_by_dependency() -> None:
    """The engine says which resource the ARN comes from: that group, and no other, is judged."""
    resources = compliant_stack()
    flow_log = named(resources, "flow-log")
    flow_log.props["logDestination"] = UNKNOWN_STRING_VALUE
    flow_log.depends_on["logDestination"] = ["flow-logs"]
    assert found(resources) == [], "the training log group ('logs', 30 days) receives no flow logs"
    named(resources, "flow-logs").props["retentionInDays"] = 30
    assert found(resources) == [SHORT]


def test_a_flow_log_finds_its_group_by_an_arn_ending_in_a_wildcard() -> None:
    """`arn:...:log-group:<name>:*` is how the console and older providers write a log group's ARN."""
    resources = compliant_stack()
    group = named(resources, "flow-logs").props
    group.update(retentionInDays=30, arn=UNKNOWN_STRING_VALUE, id=UNKNOWN_STRING_VALUE)
    named(resources, "flow-log").props["logDestination"] = (
        f"arn:aws:logs:us-east-1:123456789012:log-group:{group['name']}:*"
    )
    assert found(resources) == [SHORT]


@pytest.mark.parametrize(
    "low, high, refused", [(1, 65535, True), (0, 65535, True), (1024, 65535, False), (2, 65535, False)]
)
def test_egress_of_every_port_counts_as_all_traffic_whatever_the_protocol(
    low: int, high: int, refused: bool
) -> None:
    """Ports 1-65535 (or 0-65535) is every port; the ephemeral range 1024-65535 is not."""
    resources = compliant_stack()
    named(resources, "instances").props["egress"].append(
        {"protocol": "tcp", "fromPort": low, "toPort": high, "cidrBlocks": ["0.0.0.0/0"]}
    )
    assert bool(messages(resources, EGRESS)) is refused


# -- what a bucket lacks, what each endpoint policy reaches, source groups and CIDRs as written ---------


def test_a_bucket_without_a_public_access_block_says_what_to_add() -> None:
    resources = compliant_stack()
    resources.remove(named(resources, "bucket-public-access"))
    assert messages(resources, "s3-public-access-blocked") == [
        "aws.s3.Bucket 'bucket': add an aws.s3.BucketPublicAccessBlock with all four block/ignore/restrict "
        "settings true"
    ]


def test_a_bucket_after_one_whose_own_policy_is_tls_only_is_still_judged() -> None:
    resources = compliant_stack()
    resources.remove(named(resources, "bucket-policy"))
    named(resources, "bucket").props["policy"] = document(tls_deny())
    resources.append(Resource("aws:s3/bucket:Bucket", "late", {"bucket": "late", "id": "late"}))
    assert messages(resources, "s3-tls-only") == [
        "aws.s3.Bucket 'late': add an aws.s3.BucketPolicy with a Deny of s3:* for Principal * when "
        '{"Bool": {"aws:SecureTransport": "false"}}'
    ]


def test_a_bucket_acl_known_only_after_up_never_fails_the_preview() -> None:
    resources = compliant_stack()
    named(resources, "bucket").props["acl"] = UNKNOWN_STRING_VALUE
    assert found(resources) == []


def test_a_bucket_logging_into_itself_is_refused_saying_where_to_send_the_logs() -> None:
    resources = compliant_stack()
    named(resources, "bucket-logging").props["targetBucket"] = BUCKET
    assert messages(resources, "s3-access-logging") == [
        "aws.s3.Bucket 'bucket': aws.s3.BucketLogging 'bucket-logging' logs the bucket into itself (every "
        "delivery is logged again): send the logs to a separate log bucket"
    ]


def test_a_flow_log_of_rejected_traffic_only_passes() -> None:
    """REJECT flow logs are what Security Hub's EC2.6 asks for at least."""
    resources = compliant_stack()
    named(resources, "flow-log").props["trafficType"] = "REJECT"
    assert found(resources) == []
    named(resources, "flow-log").props["trafficType"] = "ACCEPT"
    assert messages(resources, "vpc-flow-logs-enabled")


def test_an_endpoint_policy_naming_buckets_by_a_single_character_wildcard_reaches_every_bucket() -> None:
    resources = compliant_stack()
    named(resources, "s3-endpoint").props["policy"] = document(
        {
            "Effect": "Allow",
            "Principal": "*",
            "Action": "s3:GetObject",
            "Resource": "arn:aws:s3:::trainstack-?",
        }
    )
    assert [v.message for v in check(resources) if v.policy == ENDPOINT] == [
        "aws.ec2.VpcEndpoint 's3-endpoint': policy Statement[0] allows s3:GetObject on "
        "arn:aws:s3:::trainstack-?, every bucket: name the stack's bucket (arn:aws:s3:::<bucket> and "
        "arn:aws:s3:::<bucket>/*)"
    ]


def test_an_endpoint_without_a_service_name_is_no_s3_endpoint() -> None:
    resources = compliant_stack()
    resources.insert(0, Resource("aws:ec2/vpcEndpoint:VpcEndpoint", "unnamed", {"vpcId": "vpc-0abc"}))
    assert found(resources) == []


def test_a_source_group_known_only_after_up_never_fails_the_preview() -> None:
    rule = {"protocol": "tcp", "fromPort": 22, "toPort": 22, "securityGroups": [UNKNOWN_STRING_VALUE]}
    assert messages(with_ingress(rule), INGRESS) == []


def test_an_empty_source_group_entry_is_no_group_and_never_hides_the_next() -> None:
    rule = {"protocol": "tcp", "fromPort": 22, "toPort": 22, "securityGroups": [None, "sg-other"]}
    assert messages(with_ingress(rule), INGRESS) == [
        GROUP
        + "ingress[1] admits security group sg-other, not only this group's own members: allow peers with a "
        "self-referencing rule (self = true) and reach instances with SSM Session Manager"
    ]


def test_a_cidr_with_host_bits_set_is_judged_by_its_network() -> None:
    """AWS takes 1.2.3.4/0 as 0.0.0.0/0; so does the pack."""
    rule = {"protocol": "tcp", "fromPort": 22, "toPort": 22, "cidrBlocks": ["1.2.3.4/0"]}
    assert messages(with_ingress(rule), INGRESS) == [
        GROUP
        + "ingress[1] opens ports 22-22 to 0.0.0.0/0, more than an IPv4 /8 or IPv6 /32, which counts as the "
        "internet and is refused: use SSM Session Manager, or allow narrower CIDRs (or list the port in the "
        "policy's authorizedPublicPorts config)"
    ]


# -- every wildcard action, SSE-KMS's key, and a resource after another never left unjudged -------------


def test_every_wildcard_action_of_a_statement_is_named_in_one_line() -> None:
    resources = compliant_stack()
    named(resources, "instance-policy").props["policy"] = document(
        {"Effect": "Allow", "Action": ["s3:Get*", "s3:Put*"], "Resource": f"{BUCKET_ARN}/*"}
    )
    assert found(resources) == [
        (
            "iam-no-wildcard-actions",
            "aws.iam.Policy 'instance-policy': policy Statement[0] allows s3:Get*, s3:Put*: list the actions "
            "it needs instead",
        )
    ]


def test_a_flow_log_traffic_type_known_only_after_up_never_fails_the_preview() -> None:
    resources = compliant_stack()
    named(resources, "flow-log").props["trafficType"] = UNKNOWN_STRING_VALUE
    assert found(resources) == []


def test_a_flow_log_after_one_delivering_to_s3_is_still_judged() -> None:
    resources = compliant_stack()
    to_s3 = Resource(
        "aws:ec2/flowLog:FlowLog",
        "s3-flow-log",
        {"vpcId": "vpc-0abc", "trafficType": "ALL", "logDestinationType": "s3", "logDestination": BUCKET_ARN},
    )
    resources.insert(resources.index(named(resources, "flow-log")), to_s3)
    named(resources, "flow-logs").props["retentionInDays"] = 30
    assert [f for f in found(resources) if f[0] == SHORT[0]] == [SHORT]


def test_an_endpoint_policy_on_every_bucket_by_arn_reaches_every_bucket() -> None:
    resources = compliant_stack()
    named(resources, "s3-endpoint").props["policy"] = document(
        {"Effect": "Allow", "Principal": "*", "Action": "s3:GetObject", "Resource": "arn:aws:s3:::*"}
    )
    assert [v.message for v in check(resources) if v.policy == ENDPOINT] == [
        "aws.ec2.VpcEndpoint 's3-endpoint': policy Statement[0] allows s3:GetObject on arn:aws:s3:::*, every "
        "bucket: name the stack's bucket (arn:aws:s3:::<bucket> and arn:aws:s3:::<bucket>/*)"
    ]


def test_sse_kms_without_a_key_says_to_name_a_customer_managed_key() -> None:
    resources = compliant_stack()
    del named(resources, "bucket-encryption").props["rules"][0]["applyServerSideEncryptionByDefault"][
        "kmsMasterKeyId"
    ]
    assert found(resources) == [
        (
            "s3-sse-kms",
            "aws.s3.Bucket 'bucket': set kmsMasterKeyId to a customer managed KMS key (not the AWS managed "
            "aws/s3 key)",
        )
    ]


def test_decrypt_and_re_encrypt_through_not_resource_are_named_together() -> None:
    resources = compliant_stack()
    named(resources, "instance-policy").props["policy"] = document(
        {"Effect": "Allow", "Action": ["kms:Decrypt", "kms:ReEncryptFrom"], "NotResource": KEY_ARN}
    )
    assert found(resources) == [
        (
            "kms-no-decrypt-on-all-keys",
            "aws.iam.Policy 'instance-policy': policy Statement[0] allows kms:Decrypt, kms:ReEncryptFrom "
            "with NotResource, which is every KMS key it does not list: name the key ARNs in Resource",
        )
    ]


def test_the_log_buckets_own_logging_listed_first_never_hides_the_logging_into_it() -> None:
    resources = compliant_stack()
    named(resources, "access-logs-policy").props["policy"] = tls_only_log_bucket_policy()
    own = Resource(
        "aws:s3/bucketLogging:BucketLogging",
        "access-logs-logging",
        {"bucket": LOG_BUCKET, "targetBucket": "audit-logs", "targetPrefix": "s3-access/"},
    )
    resources.insert(resources.index(named(resources, "bucket-logging")), own)
    assert found(resources) == []


def test_an_s3_endpoint_after_one_without_a_policy_is_still_judged() -> None:
    resources = compliant_stack()
    first = Resource(
        "aws:ec2/vpcEndpoint:VpcEndpoint",
        "first-s3-endpoint",
        {"vpcId": "vpc-0abc", "serviceName": "com.amazonaws.us-east-1.s3", "vpcEndpointType": "Gateway"},
    )
    resources.insert(resources.index(named(resources, "s3-endpoint")), first)
    del named(resources, "s3-endpoint").props["policy"]
    assert [v.urn for v in check(resources) if v.policy == ENDPOINT] == [
        urn("aws:ec2/vpcEndpoint:VpcEndpoint", "first-s3-endpoint"),
        ENDPOINT_URN,
    ]
