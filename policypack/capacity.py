"""Checks for the capacity fallback's kind of resources: Lambda functions' logs, roles that change groups."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from fnmatch import fnmatchcase
from typing import Any

from pulumi_policy import Policy, PolicyResource, ReportViolation, Severity

from . import resource_types as t
from .control import resource_policy, stack_policy
from .documents import UnreadableDocumentError, statements
from .properties import Unknown, get, is_set, is_unknown, items
from .stack import describe, of_type

LAMBDA_FUNCTION = "aws:lambda/function:Function"
# Actions that change a group's size, purchase options or instances: never granted on every group.
GROUP_CHANGING_ACTIONS = (
    "autoscaling:UpdateAutoScalingGroup",
    "autoscaling:SetDesiredCapacity",
    "autoscaling:TerminateInstanceInAutoScalingGroup",
    "autoscaling:DeleteAutoScalingGroup",
    "autoscaling:PutScalingPolicy",
    "autoscaling:PutScheduledUpdateGroupAction",
)

_UNRELATED_GROUP = "some-unrelated-group-0"


def lambda_logs_encrypted(
    resources: Sequence[PolicyResource], config: Mapping[str, Any], report: ReportViolation
) -> None:
    """Every function logs to a log group the stack declares, with a CMK (and so a retention, CloudWatch.16).

    Without `loggingConfig.logGroup` Lambda creates /aws/lambda/<name> itself: unencrypted, kept forever.
    """
    log_groups = of_type(resources, [t.LOG_GROUP])
    for function in of_type(resources, [LAMBDA_FUNCTION]):
        name = get(function.props, "loggingConfig", "logGroup")
        if is_unknown(name):
            continue
        if not name:
            report(
                f"{describe(function)}: set logging_config.log_group to a log group of this stack with "
                "kms_key_id; the default /aws/lambda/<name> is unencrypted and never expires",
                function.urn,
            )
            continue
        dependencies = {d.urn for d in function.property_dependencies.get("loggingConfig", [])}
        declared = [g for g in log_groups if g.urn in dependencies or get(g.props, "name") == name]
        if not declared:
            report(
                f"{describe(function)}: logs to {name}, which this stack does not declare; declare it as an "
                "aws.cloudwatch.LogGroup with kms_key_id and retention_in_days",
                function.urn,
            )
        elif not any(is_set(get(g.props, "kmsKeyId")) for g in declared):
            report(
                f"{describe(function)}: its log group {name} has no kmsKeyId; encrypt it with a CMK",
                function.urn,
            )


def group_changes_scoped(
    resource_type: str, props: Mapping[str, Any], config: Mapping[str, Any]
) -> Iterator[str]:
    """IAM.21 for Auto Scaling: actions that change a group name the group's ARN, never every group."""
    for where, document in _documents(resource_type, props):
        try:
            parsed = statements(document)
        except UnreadableDocumentError as error:
            yield f"{where}: {error}: fix the JSON"
            continue
        for index, statement in enumerate(parsed or []):
            # Allow + NotAction is iam-no-wildcard-actions' finding already; one report per mistake.
            if not statement.allows() or statement.not_actions:
                continue
            changing = [action for action in GROUP_CHANGING_ACTIONS if statement.covers_action(action)]
            broad = [resource for resource in statement.resources if _every_group(resource)]
            if changing and broad:
                yield (
                    f"{where} Statement[{index}] allows {', '.join(changing)} on {broad[0]}: name the group "
                    "(arn:...:autoScalingGroup:*:autoScalingGroupName/<name>)"
                )


def _documents(resource_type: str, props: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    if resource_type == t.IAM_ROLE:
        inline = items(props, "inlinePolicies")
        for index, policy in enumerate([] if isinstance(inline, Unknown) else inline):
            yield f"inlinePolicies[{index}].policy", get(policy, "policy")
    else:
        yield "policy", get(props, "policy")


def _every_group(resource: str) -> bool:
    """True if the pattern would also match a group nobody named: `*`, `...autoScalingGroupName/*`, a
    wildcard (`*` or `?`) anywhere in the group's name (`trainstack-*`, `trainstack-dev-gp?`), or any
    wildcard in an ARN that does not end in a name. The `*` for the group's id before the name is what
    every group ARN in a policy has (the id changes when the group is replaced)."""
    if is_unknown(resource):
        return False
    resource = resource.strip()
    marker = "autoScalingGroupName/"
    if marker in resource:
        name = resource.split(marker, 1)[1]
        return fnmatchcase(_UNRELATED_GROUP, name) or "*" in name or "?" in name
    return "*" in resource or "?" in resource


POLICIES: list[Policy] = [
    stack_policy(
        "lambda-logs-encrypted",
        ["CloudWatch.16"],
        "Lambda functions log to a declared log group encrypted with a customer managed key.",
        lambda_logs_encrypted,
        Severity.MEDIUM,
        "aws.lambda_.Function(logging_config={'log_format': 'Text', 'log_group': group.name}) with "
        "aws.cloudwatch.LogGroup(kms_key_id=key.arn, retention_in_days=30)",
    ),
    resource_policy(
        "autoscaling-changes-scoped",
        ["IAM.21"],
        "Roles and policies that change Auto Scaling groups name the groups, never every group.",
        (t.IAM_POLICY, t.IAM_ROLE, *t.IAM_INLINE_POLICIES),
        group_changes_scoped,
        Severity.HIGH,
        '"Resource": "arn:aws:autoscaling:<region>:<account>:autoScalingGroup:*:autoScalingGroupName/<name>"',
    ),
]
