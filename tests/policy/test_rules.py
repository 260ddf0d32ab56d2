"""Each baseline policy passes the compliant stack and fails, with its own message, on each mutation."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

import pytest

from infra.policy.rules import POLICIES
from tests.policy.golden import BUCKET, KEY_ARN, compliant_stack, named
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
                {"Effect": "Allow", "Action": "kms:Re*", "Resource": "arn:aws:kms:*:123456789012:key/*"}
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
            value=_policy_document({"Effect": "Allow", "NotAction": "kms:*", "Resource": "*"}),
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
