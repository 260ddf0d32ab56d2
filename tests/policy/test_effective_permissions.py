"""Issue 24: the grant rules judge what a policy allows, not how it is spelled, and in every document a
principal gets; the exposure rules refuse everyone and other accounts, and accept what is tied down."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from policypack.managed import DOCUMENTS
from policypack.patterns import OBJECT_ARN, PARAMETER_ARN, ROLE_ARN, SECRET_ARN, reaches_unnamed
from tests.policy.golden import ACCOUNT, BUCKET, compliant_stack, named
from tests.policy.harness import Resource, check

ESCALATION = "iam-escalation-on-named-resources"
DATA = "iam-data-access-on-named-resources"
ROLE = f"arn:aws:iam::{ACCOUNT}:role/trainstack-dev-instance"


def _doc(*statements: dict[str, Any]) -> str:
    return json.dumps({"Version": "2012-10-17", "Statement": list(statements)})


def _policies(resources: list[Resource]) -> set[str]:
    return {v.policy for v in check(resources)}


@pytest.mark.parametrize(
    "statement",
    [
        {"Action": "iam:Pass*", "Resource": "*"},
        {"Action": "iam:*Role", "Resource": "*"},
        {"Action": "*", "Resource": "*"},
        {"NotAction": "s3:*", "Resource": "*"},
        {"Action": "iam:PassRole", "Resource": "arn:aws:iam::*:role/trainstack-dev-instance"},
        {"Action": "iam:PassRole", "Resource": f"arn:aws:iam::{ACCOUNT}:role/trainstack-*"},
        {"Action": "iam:PassRole", "Resource": "arn:aws:iam::*"},
        {"Action": "iam:PassRole", "NotResource": ROLE},
    ],
    ids=[
        "iam:Pass*",
        "iam:*Role",
        "star",
        "not-action",
        "any-account",
        "role-prefix",
        "iam-star",
        "not-resource",
    ],
)
def test_pass_role_in_disguise_is_escalation(statement: dict[str, Any]) -> None:
    resources = compliant_stack()
    named(resources, "instance-inline").props["policy"] = _doc({"Effect": "Allow", **statement})
    violations = check(resources)
    assert ESCALATION in {v.policy for v in violations}, violations
    assert any("iam:PassRole" in v.message and "'instance-inline'" in v.message for v in violations)


def test_pass_role_on_a_named_role_passes() -> None:
    resources = compliant_stack()
    statement = {"Effect": "Allow", "Action": "iam:PassRole", "Resource": ROLE}
    named(resources, "instance-inline").props["policy"] = _doc(statement)
    assert check(resources) == []


@pytest.mark.parametrize(
    ("resource", "shape", "unnamed"),
    [
        (f"arn:aws:s3:::{BUCKET}/data/*", OBJECT_ARN, False),
        (f"arn:aws:s3:::{BUCKET}/*", OBJECT_ARN, False),
        ("arn:aws:s3:::trainstack-*/data/*", OBJECT_ARN, True),
        ("arn:aws:s3:::*", OBJECT_ARN, True),
        ("arn:aws:s3:::*/*", OBJECT_ARN, True),
        (f"arn:aws:s3:::{BUCKET}", OBJECT_ARN, False),
        ("arn:aws:kms:us-east-1:123456789012:key/*", OBJECT_ARN, False),
        (f"arn:aws:ssm:us-east-1:{ACCOUNT}:parameter/trainstack/dev/*", PARAMETER_ARN, False),
        (f"arn:aws:ssm:us-east-1:{ACCOUNT}:parameter/*", PARAMETER_ARN, True),
        (f"arn:aws:ssm:*:{ACCOUNT}:parameter/trainstack/dev/*", PARAMETER_ARN, True),
        (f"arn:aws:secretsmanager:us-east-1:{ACCOUNT}:secret:trainstack/dev/*", SECRET_ARN, False),
        (f"arn:aws:secretsmanager:us-east-1:{ACCOUNT}:secret:hf-token-??????", SECRET_ARN, False),
        (f"arn:aws:secretsmanager:us-east-1:{ACCOUNT}:secret:*", SECRET_ARN, True),
        (ROLE, ROLE_ARN, False),
        ("*", ROLE_ARN, True),
    ],
)
def test_what_counts_as_a_resource_nobody_named(resource: str, shape: tuple[str, ...], unnamed: bool) -> None:
    assert reaches_unnamed(resource, shape) is unnamed


@pytest.mark.parametrize(
    ("name", "action"),
    [
        ("AmazonS3ReadOnlyAccess", "s3:GetObject"),
        ("AmazonSSMManagedInstanceCore", "ssm:GetParameter"),
        ("AmazonSSMReadOnlyAccess", "ssm:GetParameter"),
        ("service-role/AmazonEC2RoleforSSM", "s3:GetObject"),
        ("SecretsManagerReadWrite", "secretsmanager:GetSecretValue"),
        ("ReadOnlyAccess", "s3:GetObject"),
    ],
)
@pytest.mark.parametrize(
    ("token", "prop", "as_list"),
    [
        ("aws:iam/rolePolicyAttachment:RolePolicyAttachment", "policyArn", False),
        ("aws:iam/policyAttachment:PolicyAttachment", "policyArn", False),
        ("aws:iam/rolePolicyAttachmentsExclusive:RolePolicyAttachmentsExclusive", "policyArns", True),
        ("aws:iam/role:Role", "managedPolicyArns", True),
    ],
)
def test_aws_managed_policies_are_judged_by_what_they_allow(
    name: str, action: str, token: str, prop: str, as_list: bool
) -> None:
    arn = f"arn:aws:iam::aws:policy/{name}"
    resources = compliant_stack()
    resources.append(Resource(token, "attacher", {prop: [arn] if as_list else arn}))
    violations = check(resources)
    assert {v.policy for v in violations} == {DATA}, violations
    assert any(action in v.message and name.rsplit("/", 1)[-1] in v.message for v in violations)


def test_every_listed_managed_document_is_refused() -> None:
    for name in DOCUMENTS:
        resources = compliant_stack()
        named(resources, "session-manager").props["policyArn"] = f"arn:aws:iam::aws:policy/{name}"
        assert _policies(resources) == {DATA}, name


def test_a_policy_and_its_attachment_are_judged_by_the_policy_document() -> None:
    resources = compliant_stack()
    resources.append(
        Resource(
            "aws:iam/policy:Policy",
            "extra",
            {"policy": _doc({"Effect": "Allow", "Action": "ssm:GetParametersByPath", "Resource": "*"})},
        )
    )
    resources.append(
        Resource("aws:iam/policyAttachment:PolicyAttachment", "extra-attach", {"policyArn": "extra-arn"})
    )
    violations = check(resources)
    assert [(v.policy, "'extra'" in v.message) for v in violations] == [(DATA, True)]


# Resource and trust policies.

_CROSS = "999988887777"


@pytest.mark.parametrize(
    "principal",
    [
        "*",
        {"AWS": "*"},
        {"AWS": ["arn:aws:iam::*:root"]},
        {"AWS": f"arn:aws:iam::{_CROSS}:root"},
        {"AWS": _CROSS},
    ],
)
def test_key_policy_refuses_everyone_and_other_accounts(principal: Any) -> None:
    resources = compliant_stack()
    statement = {"Effect": "Allow", "Principal": principal, "Action": "kms:Decrypt", "Resource": "*"}
    named(resources, "key").props["policy"] = _doc(statement)
    assert _policies(resources) == {"kms-key-policy-not-public"}


@pytest.mark.parametrize(
    "condition",
    [
        {"StringEquals": {"aws:PrincipalAccount": ACCOUNT}},
        {"StringEquals": {"aws:PrincipalOrgID": "o-abc123"}},
        {"StringEquals": {"kms:CallerAccount": ACCOUNT}},
        {"ArnLike": {"aws:PrincipalArn": f"arn:aws:iam::{ACCOUNT}:role/trainstack-*"}},
    ],
)
def test_everyone_tied_to_this_account_or_organization_passes(condition: dict[str, Any]) -> None:
    resources = compliant_stack()
    statement = {"Effect": "Allow", "Principal": {"AWS": "*"}, "Action": "kms:Decrypt", "Resource": "*"}
    named(resources, "key").props["policy"] = _doc({**statement, "Condition": condition})
    assert check(resources) == []


@pytest.mark.parametrize(
    "condition",
    [
        {"StringEquals": {"aws:PrincipalAccount": _CROSS}},
        {"StringEquals": {"aws:PrincipalAccount": "*"}},
        {"StringEqualsIfExists": {"aws:PrincipalAccount": ACCOUNT}},
        {"StringNotEquals": {"aws:PrincipalAccount": _CROSS}},
        {"Bool": {"aws:SecureTransport": "true"}},
    ],
)
def test_conditions_that_do_not_tie_everyone_down_fail(condition: dict[str, Any]) -> None:
    resources = compliant_stack()
    statement = {"Effect": "Allow", "Principal": "*", "Action": "sns:Publish", "Resource": "*"}
    named(resources, "topic-policy").props["policy"] = _doc({**statement, "Condition": condition})
    assert _policies(resources) == {"sns-topic-policy-not-public"}


def test_another_account_passes_only_when_the_pack_config_trusts_it() -> None:
    resources = compliant_stack()
    statement = {"Effect": "Allow", "Principal": {"AWS": _CROSS}, "Action": "sts:AssumeRole"}
    named(resources, "instance-role").props["assumeRolePolicy"] = _doc(statement)
    assert _policies(resources) == {"iam-trust-policy-not-public"}
    assert check(resources, {"iam-trust-policy-not-public": {"trustedAccountIds": [_CROSS]}}) == []


def test_allow_not_principal_is_everyone() -> None:
    resources = compliant_stack()
    statement = {"Effect": "Allow", "NotPrincipal": {"AWS": ROLE}, "Action": "s3:GetObject", "Resource": "*"}
    named(resources, "bucket-policy").props["policy"] = _doc(statement, *_tls_only())
    assert _policies(resources) == {"s3-bucket-policy-not-public"}


def _tls_only() -> list[dict[str, Any]]:
    policy: dict[str, Any] = json.loads(named(compliant_stack(), "bucket-policy").props["policy"])
    return list(policy["Statement"])


def test_a_federated_trust_without_a_condition_fails() -> None:
    resources = compliant_stack()
    statement = {
        "Effect": "Allow",
        "Principal": {"Federated": "cognito-identity.amazonaws.com"},
        "Action": "sts:AssumeRoleWithWebIdentity",
    }
    named(resources, "instance-role").props["assumeRolePolicy"] = _doc(statement)
    assert _policies(resources) == {"iam-trust-policy-not-public"}


@pytest.mark.parametrize(
    "props",
    [
        {"principal": "sns.amazonaws.com"},
        {"principal": _CROSS},
        {"principal": f"arn:aws:iam::{_CROSS}:root", "sourceArn": "arn:aws:sns:us-east-1:1:t"},
    ],
    ids=["service-for-any-source", "another-account", "another-accounts-role"],
)
def test_lambda_permissions_name_this_account_and_a_source(props: dict[str, Any]) -> None:
    resources = compliant_stack()
    named(resources, "invoke").props = {"action": "lambda:InvokeFunction", "function": "f", **props}
    assert _policies(resources) == {"lambda-permission-not-public"}


def test_shares_with_another_account_fail_and_ami_launch_permissions_too() -> None:
    resources = compliant_stack()
    resources.append(
        Resource(
            "aws:ec2/snapshotCreateVolumePermission:SnapshotCreateVolumePermission",
            "share",
            {"snapshotId": "snap-1", "accountId": _CROSS},
        )
    )
    resources.append(
        Resource(
            "aws:ec2/amiLaunchPermission:AmiLaunchPermission", "ami", {"imageId": "ami-1", "group": "all"}
        )
    )
    messages = [v.message for v in check(resources) if v.policy == "ebs-snapshot-not-public"]
    assert len(messages) == 2
    assert any(f"with account {_CROSS}" in m for m in messages) and any("image public" in m for m in messages)


def test_before_any_arn_is_known_only_public_grants_are_judged() -> None:
    """A first preview knows no ARN, so no account: another account is judged after `up`, `*` at once."""
    resources = [r for r in compliant_stack() if r.type != "aws:kms/key:Key"]
    for resource in resources:
        resource.props.pop("arn", None)
    statement = {"Effect": "Allow", "Principal": {"AWS": _CROSS}, "Action": "sts:AssumeRole"}
    named(resources, "instance-role").props["assumeRolePolicy"] = _doc(statement)
    assert check(resources) == []
    named(resources, "instance-role").props["assumeRolePolicy"] = _doc({**statement, "Principal": "*"})
    assert _policies(resources) == {"iam-trust-policy-not-public"}


# Network, launches and user data.


def test_prefix_lists_pass_only_when_the_pack_config_lists_them() -> None:
    resources = compliant_stack()
    rule = {
        "securityGroupId": "sg-1",
        "ipProtocol": "tcp",
        "fromPort": 22,
        "toPort": 22,
        "prefixListId": "pl-1",
    }
    named(resources, "ssh-from-office").props = rule
    assert _policies(resources) == {"no-unrestricted-ingress"}
    assert check(resources, {"no-unrestricted-ingress": {"authorizedPrefixListIds": ["pl-1"]}}) == []


@pytest.mark.parametrize(
    ("token", "props"),
    [
        (
            "aws:ec2/securityGroupRule:SecurityGroupRule",
            {"type": "egress", "protocol": "all", "fromPort": 0, "toPort": 0, "cidrBlocks": ["0.0.0.0/0"]},
        ),
        (
            "aws:ec2/securityGroupRule:SecurityGroupRule",
            {"type": "egress", "protocol": "tcp", "fromPort": 0, "toPort": 65535, "ipv6CidrBlocks": ["::/0"]},
        ),
        (
            "aws:vpc/securityGroupEgressRule:SecurityGroupEgressRule",
            {"ipProtocol": "-1", "cidrIpv4": "0.0.0.0/1"},
        ),
    ],
)
def test_all_traffic_egress_fails_however_written(token: str, props: dict[str, Any]) -> None:
    resources = compliant_stack()
    resources.append(Resource(token, "out", {"securityGroupId": "sg-1", **props}))
    assert _policies(resources) == {"no-all-protocol-egress-to-internet"}


def test_all_traffic_egress_within_the_vpc_passes() -> None:
    resources = compliant_stack()
    named(resources, "instances").props["egress"].append(
        {"protocol": "-1", "fromPort": 0, "toPort": 0, "cidrBlocks": ["10.42.0.0/16"]}
    )
    assert check(resources) == []


def test_an_s3_endpoint_without_a_policy_fails_and_a_separate_policy_resource_counts() -> None:
    resources = compliant_stack()
    endpoint = named(resources, "s3-endpoint")
    policy = endpoint.props.pop("policy")
    assert _policies(resources) == {"s3-endpoint-policy-scoped"}
    resources.append(
        Resource(
            "aws:ec2/vpcEndpointPolicy:VpcEndpointPolicy",
            "s3-endpoint-policy",
            {"vpcEndpointId": "vpce-1", "policy": policy},
            {"vpcEndpointId": ["s3-endpoint"]},
        )
    )
    assert check(resources) == []


def test_a_template_referenced_by_name_or_an_instance_on_an_undeclared_template() -> None:
    resources = compliant_stack()
    named(resources, "launch-template").props["name"] = "trainstack-dev-gpu"
    spec = named(resources, "group").props["mixedInstancesPolicy"]["launchTemplate"][
        "launchTemplateSpecification"
    ]
    spec.pop("launchTemplateId")
    spec["launchTemplateName"] = "trainstack-dev-gpu"
    assert check(resources) == []
    resources.append(Resource("aws:ec2/instance:Instance", "box", {"launchTemplate": {"id": "lt-0other"}}))
    assert _policies(resources) == {"launch-templates-declared"}


@pytest.mark.parametrize(
    "line",
    [
        "wget -O- https://x.example/i.sh | sh",
        "wget -qO- https://x.example/i.sh | sudo bash -s -- --yes",
        "bash <(curl -fsSL https://x.example/i.sh)",
        'sh -c "$(curl -fsSL https://x.example/i.sh)"',
        "curl -s https://x.example/i.py | python3 -",
    ],
)
def test_piped_downloads_fail_however_written(line: str) -> None:
    resources = compliant_stack()
    script = f"#cloud-config\nruncmd:\n  - {json.dumps(line)}\n"
    named(resources, "launch-template").props["userData"] = base64.b64encode(script.encode()).decode()
    assert _policies(resources) == {"no-piped-downloads-in-user-data"}


def test_a_download_checked_before_it_runs_passes() -> None:
    resources = compliant_stack()
    script = (
        "#!/bin/sh\ncurl -fsSLo /tmp/i.sh https://x.example/i.sh\n"
        "echo 'abc123  /tmp/i.sh' | sha256sum -c - && sh /tmp/i.sh\n"
    )
    named(resources, "launch-template").props["userData"] = base64.b64encode(script.encode()).decode()
    assert check(resources) == []
