"""The pack's capacity rules: Lambda logs in a declared, encrypted log group; group changes name the group."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pulumi_policy.proxy import UNKNOWN_STRING_VALUE

from infra.capacity import function_policy, group_arn_pattern
from policypack.capacity import POLICIES
from tests.infra.program import shared_run
from tests.policy.golden import KEY_ARN, compliant_stack
from tests.policy.harness import Resource, Violation, check

LOG_GROUP = "/trainstack/dev/capacity-fallback"
GROUP_ARN = group_arn_pattern(
    partition="aws", region="us-east-1", account_id="123456789012", group_name="trainstack-dev-gpu"
)
OURS = {policy.name for policy in POLICIES}
# The pack's rules that also read the fallback's resources: its role's actions and its log group.
ALSO_READ = {"iam-no-wildcard-actions", "kms-no-decrypt-on-all-keys", "log-group-retained-and-encrypted"}


def _function(logging: dict[str, Any] | None) -> Resource:
    props: dict[str, Any] = {"runtime": "python3.13", "handler": "handler.handler"}
    if logging is not None:
        props["loggingConfig"] = logging
    return Resource("aws:lambda/function:Function", "capacity-function", props)


def _log_group(**props: Any) -> Resource:
    return Resource("aws:cloudwatch/logGroup:LogGroup", "capacity-logs", {"name": LOG_GROUP, **props})


def _role_policy(*statements: dict[str, Any]) -> Resource:
    document = json.dumps({"Version": "2012-10-17", "Statement": list(statements)})
    return Resource("aws:iam/rolePolicy:RolePolicy", "capacity-policy", {"role": "r", "policy": document})


def _ours(*extra: Resource) -> list[Violation]:
    return [v for v in check([*compliant_stack(), *extra]) if v.policy in OURS]


def test_function_with_its_encrypted_log_group_and_scoped_role_passes() -> None:
    policy = function_policy(
        group_arn=GROUP_ARN, log_group_arn=f"arn:aws:logs:us-east-1:1:log-group:{LOG_GROUP}"
    )
    resources = [
        _log_group(kmsKeyId=KEY_ARN, retentionInDays=30),
        _function({"logFormat": "Text", "logGroup": LOG_GROUP}),
        Resource(
            "aws:iam/rolePolicy:RolePolicy", "capacity-policy", {"role": "r", "policy": json.dumps(policy)}
        ),
    ]
    assert [v for v in check([*compliant_stack(), *resources]) if v.policy in OURS | ALSO_READ] == []


def test_the_programs_fallback_passes_the_pack() -> None:
    recorded = shared_run().resources
    resources = [Resource(r.type, r.name, {**r.inputs, "id": f"{r.name}-id"}) for r in recorded]
    capacity = {r.name for r in recorded if r.parent == "capacity"}
    assert len(capacity) == 10
    violations = [v for v in check(resources) if v.policy in OURS or any(n in v.message for n in capacity)]
    assert violations == []


def test_function_logging_to_the_lambda_default_group_fails() -> None:
    (violation,) = _ours(_function(None))
    assert violation.policy == "lambda-logs-encrypted"
    assert "/aws/lambda/<name> is unencrypted" in violation.message


def test_function_logging_to_an_undeclared_group_fails() -> None:
    (violation,) = _ours(_function({"logFormat": "Text", "logGroup": "/somewhere/else"}))
    assert "/somewhere/else, which this stack does not declare" in violation.message


def test_function_logging_to_an_unencrypted_group_fails() -> None:
    (violation,) = _ours(
        _log_group(retentionInDays=30), _function({"logFormat": "Text", "logGroup": LOG_GROUP})
    )
    assert violation.policy == "lambda-logs-encrypted"
    assert "has no kmsKeyId" in violation.message


def test_log_group_found_by_dependency_when_its_name_is_unknown_at_preview() -> None:
    function = _function({"logFormat": "Text", "logGroup": UNKNOWN_STRING_VALUE})
    assert _ours(_log_group(kmsKeyId=KEY_ARN, retentionInDays=30), function) == []
    function = _function({"logFormat": "Text", "logGroup": LOG_GROUP})
    function.depends_on = {"loggingConfig": ["capacity-logs"]}
    renamed = _log_group(kmsKeyId=KEY_ARN, retentionInDays=30)
    renamed.props["name"] = UNKNOWN_STRING_VALUE
    assert _ours(renamed, function) == []


@pytest.mark.parametrize(
    ("action", "resource"),
    [
        ("autoscaling:UpdateAutoScalingGroup", "*"),
        ("autoscaling:Update*", "*"),
        (
            "autoscaling:SetDesiredCapacity",
            "arn:aws:autoscaling:us-east-1:1:autoScalingGroup:*:autoScalingGroupName/*",
        ),
        ("autoscaling:UpdateAutoScalingGroup", "arn:aws:autoscaling:*"),
        # A wildcard in the name matches groups nobody named; so does a `?` where the name should be.
        (
            "autoscaling:SetDesiredCapacity",
            "arn:aws:autoscaling:us-east-1:1:autoScalingGroup:*:autoScalingGroupName/trainstack-*",
        ),
        (
            "autoscaling:SetDesiredCapacity",
            "arn:aws:autoscaling:us-east-1:1:autoScalingGroup:*:autoScalingGroupName/trainstack-dev-gp?",
        ),
        (
            "autoscaling:UpdateAutoScalingGroup",
            "arn:aws:autoscaling:us-east-1:1:autoScalingGroup:????????-????-????-????-????????????",
        ),
    ],
)
def test_changing_every_group_fails(action: str, resource: str) -> None:
    (violation,) = _ours(_role_policy({"Effect": "Allow", "Action": action, "Resource": resource}))
    assert violation.policy == "autoscaling-changes-scoped"
    assert "name the group" in violation.message


@pytest.mark.parametrize(
    "statement",
    [
        {"Effect": "Allow", "Action": "autoscaling:UpdateAutoScalingGroup", "Resource": GROUP_ARN},
        {"Effect": "Allow", "Action": "autoscaling:DescribeScalingActivities", "Resource": "*"},
        {"Effect": "Deny", "Action": "autoscaling:UpdateAutoScalingGroup", "Resource": "*"},
    ],
    ids=["named-group", "read-only", "deny"],
)
def test_named_group_reads_and_denies_pass(statement: dict[str, Any]) -> None:
    assert _ours(_role_policy(statement)) == []


def test_role_inline_policies_are_checked_too() -> None:
    document = json.dumps(
        {"Statement": [{"Effect": "Allow", "Action": "autoscaling:UpdateAutoScalingGroup", "Resource": "*"}]}
    )
    role = Resource(
        "aws:iam/role:Role", "capacity-role", {"inlinePolicies": [{"name": "x", "policy": document}]}
    )
    (violation,) = _ours(role)
    assert violation.message.startswith("aws.iam.Role 'capacity-role': inlinePolicies[0].policy Statement[0]")
