"""Policy config, legacy type tokens and encodings the rules must also understand."""

from __future__ import annotations

import base64
import gzip
import json
from typing import Any

import pytest

from tests.policy.golden import (
    LOG_BUCKET,
    SESSION_MANAGER_POLICY,
    TLS_ONLY_POLICY,
    compliant_stack,
    named,
)
from tests.policy.harness import Resource, check


def _open_https(resources: list[Resource]) -> None:
    named(resources, "instances").props["ingress"].append(
        {"protocol": "tcp", "fromPort": 443, "toPort": 443, "cidrBlocks": ["0.0.0.0/0"]}
    )


def test_public_https_fails_by_default_and_passes_when_authorized_in_config() -> None:
    resources = compliant_stack()
    _open_https(resources)
    assert [v.policy for v in check(resources)] == ["no-unrestricted-ingress"]
    assert check(resources, {"no-unrestricted-ingress": {"authorizedPublicPorts": [443]}}) == []


def test_authorized_ports_never_cover_all_protocols() -> None:
    resources = compliant_stack()
    named(resources, "instances").props["ingress"].append(
        {"protocol": "-1", "fromPort": 0, "toPort": 0, "cidrBlocks": ["0.0.0.0/0"]}
    )
    assert check(resources, {"no-unrestricted-ingress": {"authorizedPublicPorts": [0, 443]}})


def test_minimum_log_retention_comes_from_config() -> None:
    resources = compliant_stack()
    violations = check(resources, {"log-group-retained-and-encrypted": {"minimumRetentionDays": 365}})
    assert [v.policy for v in violations] == ["log-group-retained-and-encrypted"]
    assert "at least 365" in violations[0].message


def test_deprecated_v2_bucket_tokens_are_checked_too() -> None:
    resources = compliant_stack()
    named(resources, "bucket").type = "aws:s3/bucketV2:BucketV2"
    named(resources, "bucket-versioning").type = "aws:s3/bucketVersioningV2:BucketVersioningV2"
    assert check(resources) == []
    resources.remove(named(resources, "bucket-versioning"))
    assert [v.policy for v in check(resources)] == ["s3-versioning-enabled"]


def test_gzipped_user_data_is_scanned() -> None:
    resources = compliant_stack()
    payload = gzip.compress(b"#!/bin/sh\nexport AWS_ACCESS_KEY_ID=AKIAIOSFODNN7EXAMPLE\n")
    named(resources, "launch-template").props["userData"] = base64.b64encode(payload).decode()
    assert [v.policy for v in check(resources)] == ["no-secrets-in-user-data"]


def test_public_subnets_without_nat_may_assign_public_ips() -> None:
    resources = compliant_stack()
    interfaces = named(resources, "launch-template").props["networkInterfaces"]
    assert interfaces[0]["associatePublicIpAddress"] == "true"
    assert check(resources) == []


def test_inline_bucket_settings_count_as_configuration() -> None:
    resources = [r for r in compliant_stack() if r.name not in ("bucket-versioning", "bucket-lifecycle")]
    bucket = named(resources, "bucket")
    bucket.props["versioning"] = {"enabled": True}
    bucket.props["lifecycleRules"] = [{"enabled": True, "noncurrentVersionExpiration": {"days": 30}}]
    assert check(resources) == []


def test_instance_from_a_launch_template_inherits_its_metadata_options() -> None:
    resources = compliant_stack()
    resources.append(
        Resource("aws:ec2/instance:Instance", "from-template", {"launchTemplate": {"id": "lt-1"}})
    )
    assert check(resources) == []


def test_secret_in_user_data_that_was_never_base64_encoded_is_found() -> None:
    resources = compliant_stack()
    named(resources, "launch-template").props["userData"] = "#!/bin/sh\npassword=hunter2hunter2\n"
    violations = check(resources)
    assert [v.policy for v in violations] == ["no-secrets-in-user-data"]
    assert "contains a password" in violations[0].message


def test_user_data_referring_to_secrets_by_name_is_not_a_secret() -> None:
    resources = compliant_stack()
    script = "#!/bin/sh\npassword=$(aws ssm get-parameter --name /job/db --with-decryption)\n"
    named(resources, "launch-template").props["userData"] = base64.b64encode(script.encode()).decode()
    assert check(resources) == []


# Issue 12: what the new and tightened rules accept and refuse beyond their one mutation each.

BROAD_AWS_MANAGED = [
    "arn:aws:iam::aws:policy/AdministratorAccess",
    "arn:aws:iam::aws:policy/PowerUserAccess",
    "arn:aws:iam::aws:policy/IAMFullAccess",
    "arn:aws:iam::aws:policy/AmazonS3FullAccess",
    "arn:aws:iam::aws:policy/AWSLambda_FullAccess",
    "arn:aws:iam::aws:policy/job-function/SystemAdministrator",
    "arn:aws:iam::aws:policy/AdministratorAccess-Amplify",
    "arn:aws-us-gov:iam::aws:policy/AdministratorAccess",
]


@pytest.mark.parametrize("arn", BROAD_AWS_MANAGED)
@pytest.mark.parametrize(
    ("token", "prop", "as_list"),
    [
        ("aws:iam/rolePolicyAttachment:RolePolicyAttachment", "policyArn", False),
        ("aws:iam/userPolicyAttachment:UserPolicyAttachment", "policyArn", False),
        ("aws:iam/groupPolicyAttachment:GroupPolicyAttachment", "policyArn", False),
        ("aws:iam/policyAttachment:PolicyAttachment", "policyArn", False),
        ("aws:iam/rolePolicyAttachmentsExclusive:RolePolicyAttachmentsExclusive", "policyArns", True),
        ("aws:iam/role:Role", "managedPolicyArns", True),
    ],
)
def test_broad_aws_managed_policies_are_refused_however_attached(
    arn: str, token: str, prop: str, as_list: bool
) -> None:
    resources = compliant_stack()
    resources.append(Resource(token, "attacher", {prop: [SESSION_MANAGER_POLICY, arn] if as_list else arn}))
    violations = check(resources)
    assert [v.policy for v in violations] == ["iam-no-admin-managed-policies"]
    assert "'attacher'" in violations[0].message and arn.rsplit("/", 1)[1] in violations[0].message


@pytest.mark.parametrize(
    "arn",
    [
        "arn:aws:iam::aws:policy/CloudWatchAgentServerPolicy",
        "arn:aws:iam::aws:policy/service-role/AWSLambdaBasicExecutionRole",
        "arn:aws:iam::123456789012:policy/trainstack-instance",
    ],
)
def test_narrow_and_customer_managed_policies_may_be_attached(arn: str) -> None:
    """AmazonS3ReadOnlyAccess and AmazonSSMManagedInstanceCore used to be listed here: their documents grant
    s3:GetObject and ssm:GetParameter on `*`, which iam-data-access-on-named-resources now refuses."""
    resources = compliant_stack()
    named(resources, "session-manager").props["policyArn"] = arn
    assert check(resources) == []


@pytest.mark.parametrize("action", ["s3:Get*", "s3:?etObject", "S3:*OBJECT*", "*:GetObject", "s3:GetObject*"])
def test_any_wildcard_in_an_allowed_action_fails_unless_the_pack_config_lists_it(action: str) -> None:
    resources = compliant_stack()
    named(resources, "instance-inline").props["policy"] = json.dumps(
        {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": action, "Resource": "arn:aws:s3:::b/*"}],
        }
    )
    assert [v.policy for v in check(resources)] == ["iam-no-wildcard-actions"]
    allowed = {"iam-no-wildcard-actions": {"allowedActionPatterns": [action.lower()]}}
    assert check(resources, allowed) == []


def test_wildcards_in_deny_statements_are_not_grants() -> None:
    resources = compliant_stack()
    named(resources, "instance-inline").props["policy"] = json.dumps(
        {
            "Version": "2012-10-17",
            "Statement": [
                {"Effect": "Allow", "Action": "s3:GetObject", "Resource": "arn:aws:s3:::b/*"},
                {"Effect": "Deny", "Action": "s3:*", "Resource": "*"},
            ],
        }
    )
    assert check(resources) == []


@pytest.mark.parametrize(
    "sources",
    [
        {"cidrBlocks": ["10.0.0.0/8"]},
        {"cidrBlocks": ["10.0.0.0/9", "10.128.0.0/9"]},
        {"ipv6CidrBlocks": ["2001:db8::/32"]},
        {"cidrBlocks": [f"198.51.{i}.0/24" for i in range(200)]},
    ],
    ids=["one-slash-8", "a-slash-8-in-halves", "an-ipv6-slash-32", "200-office-ranges"],
)
def test_ingress_up_to_a_slash_8_or_an_ipv6_slash_32_passes(sources: dict[str, list[str]]) -> None:
    resources = compliant_stack()
    named(resources, "instances").props["ingress"] = [
        {"protocol": "tcp", "fromPort": 22, "toPort": 22, **sources}
    ]
    assert check(resources) == []


def test_wide_ingress_on_an_authorized_public_port_passes_only_with_the_pack_config() -> None:
    resources = compliant_stack()
    named(resources, "instances").props["ingress"].append(
        {"protocol": "tcp", "fromPort": 443, "toPort": 443, "cidrBlocks": ["0.0.0.0/1", "128.0.0.0/1"]}
    )
    assert [v.policy for v in check(resources)] == ["no-unrestricted-ingress"]
    assert check(resources, {"no-unrestricted-ingress": {"authorizedPublicPorts": [443]}}) == []


@pytest.mark.parametrize(
    ("name", "path", "key"),
    [
        (
            "bucket-encryption",
            ("rules", 0, "applyServerSideEncryptionByDefault", "kmsMasterKeyId"),
            "alias/aws/s3",
        ),
        ("launch-template", ("blockDeviceMappings", 0, "ebs", "kmsKeyId"), "alias/aws/ebs"),
        ("scratch", ("kmsKeyId",), "arn:aws:kms:us-east-1:123456789012:alias/aws/ebs"),
    ],
)
def test_aws_managed_keys_are_not_customer_managed_keys(
    name: str, path: tuple[str | int, ...], key: str
) -> None:
    resources = compliant_stack()
    target: Any = named(resources, name).props
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = key
    violations = check(resources)
    assert violations and all("customer managed KMS key" in v.message for v in violations)


def test_topic_on_the_stacks_own_key_alias_passes() -> None:
    resources = compliant_stack()
    named(resources, "topic").props["kmsMasterKeyId"] = "alias/trainstack-dev"
    assert check(resources) == []


def test_access_log_bucket_may_use_sse_s3_but_the_data_bucket_may_not() -> None:
    resources = compliant_stack()
    assert named(resources, "access-logs-encryption").props["rules"][0][
        "applyServerSideEncryptionByDefault"
    ] == {"sseAlgorithm": "AES256"}
    assert check(resources) == []
    named(resources, "bucket-encryption").props["rules"][0]["applyServerSideEncryptionByDefault"] = {
        "sseAlgorithm": "AES256"
    }
    violations = check(resources)
    assert [v.policy for v in violations] == ["s3-sse-kms"] and "'bucket'" in violations[0].message


def test_a_bucket_without_logging_or_a_log_delivery_grant_is_not_a_log_bucket() -> None:
    resources = [r for r in compliant_stack() if r.name not in ("bucket-logging", "access-logs-policy")]
    resources.append(
        Resource(
            "aws:s3/bucketPolicy:BucketPolicy",
            "access-logs-tls-only",
            {"bucket": LOG_BUCKET, "policy": TLS_ONLY_POLICY},
        )
    )
    violations = check(resources)
    # The data bucket is unlogged; the former log bucket is an ordinary bucket: unlogged and not on the CMK.
    assert {(v.policy, v.urn) for v in violations} == {
        ("s3-access-logging", named(resources, "bucket").urn),
        ("s3-access-logging", named(resources, "access-logs").urn),
        ("s3-sse-kms", named(resources, "access-logs").urn),
    }


def test_deprecated_inline_bucket_logging_counts() -> None:
    resources = [r for r in compliant_stack() if r.name != "bucket-logging"]
    named(resources, "bucket").props["logging"] = {"targetBucket": LOG_BUCKET, "targetPrefix": "s3-access/"}
    assert check(resources) == []


def test_flow_log_floor_comes_from_config_and_s3_destinations_are_not_judged() -> None:
    resources = compliant_stack()
    named(resources, "flow-logs").props["retentionInDays"] = 90
    assert [v.policy for v in check(resources)] == ["vpc-flow-logs-retained"]
    assert check(resources, {"vpc-flow-logs-retained": {"minimumRetentionDays": 90}}) == []
    named(resources, "flow-log").props.update(
        {"logDestinationType": "s3", "logDestination": "arn:aws:s3:::b"}
    )
    assert check(resources) == []
