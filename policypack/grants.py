"""Effective permissions of identity policies: who may escalate, and who may read data, on what resources.

A statement is judged by what it grants, not how it is spelled: `iam:PassRole`, `iam:Pass*`, `iam:*Role`,
`*` and Allow+NotAction all grant iam:PassRole (Statement.covers_action); `*`, `arn:aws:iam::*:role/x` and
`...:role/trainstack-*` all reach roles nobody named (patterns.reaches_unnamed); and the documents judged are
every one a principal gets: aws.iam.Policy, inline policies (RolePolicy, UserPolicy, GroupPolicy, a role's
inlinePolicies) and AWS managed policies attached by ARN, whose documents patterns.py cannot see in the
stack and managed.py supplies.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from . import managed
from . import resource_types as t
from .documents import Statement, UnreadableDocumentError, statements
from .identity import MANAGED_POLICY_ATTACHERS, MANAGED_POLICY_PROPERTIES
from .patterns import (
    FUNCTION_ARN,
    LAUNCH_TEMPLATE_ARN,
    OBJECT_ARN,
    PARAMETER_ARN,
    POLICY_ARN,
    ROLE_ARN,
    SECRET_ARN,
    USER_ARN,
    Shape,
    has_wildcard,
    reaches_unnamed,
)
from .properties import Unknown, get, is_unknown, items

# Actions that hand their holder more power than it has: launching as another role (PassRole, AssumeRole),
# rewriting what the group launches (a launch template version with another role or user-data), rewriting
# IAM policies or credentials, replacing a function's code. Each on the resources it names, never more.
ESCALATION_ACTIONS: dict[str, Shape] = {
    "iam:PassRole": ROLE_ARN,
    "sts:AssumeRole": ROLE_ARN,
    "iam:AttachRolePolicy": ROLE_ARN,
    "iam:PutRolePolicy": ROLE_ARN,
    "iam:UpdateAssumeRolePolicy": ROLE_ARN,
    "iam:CreatePolicyVersion": POLICY_ARN,
    "iam:SetDefaultPolicyVersion": POLICY_ARN,
    "iam:AttachUserPolicy": USER_ARN,
    "iam:PutUserPolicy": USER_ARN,
    "iam:CreateAccessKey": USER_ARN,
    "iam:CreateLoginProfile": USER_ARN,
    "iam:UpdateLoginProfile": USER_ARN,
    "ec2:CreateLaunchTemplateVersion": LAUNCH_TEMPLATE_ARN,
    "ec2:ModifyLaunchTemplate": LAUNCH_TEMPLATE_ARN,
    "lambda:UpdateFunctionCode": FUNCTION_ARN,
}
# Actions that read (or overwrite) data and secrets: on the stack's bucket, parameter path or secrets only.
DATA_ACTIONS: dict[str, Shape] = {
    "s3:GetObject": OBJECT_ARN,
    "s3:GetObjectVersion": OBJECT_ARN,
    "s3:PutObject": OBJECT_ARN,
    "s3:DeleteObject": OBJECT_ARN,
    "ssm:GetParameter": PARAMETER_ARN,
    "ssm:GetParameters": PARAMETER_ARN,
    "ssm:GetParametersByPath": PARAMETER_ARN,
    "ssm:GetParameterHistory": PARAMETER_ARN,
    "secretsmanager:GetSecretValue": SECRET_ARN,
}
_FIX = {
    ROLE_ARN: "name the role ARNs, without wildcards, in Resource",
    POLICY_ARN: "name the policy ARNs, without wildcards, in Resource",
    USER_ARN: "name the user ARNs, without wildcards, in Resource",
    LAUNCH_TEMPLATE_ARN: "name the launch template ARNs, without wildcards, in Resource",
    FUNCTION_ARN: "name the function ARNs, without wildcards, in Resource",
    OBJECT_ARN: "name the bucket (arn:aws:s3:::<bucket>/<prefix>*) in Resource",
    PARAMETER_ARN: "name the parameter path (arn:...:parameter/trainstack/<stack>/*) in Resource",
    SECRET_ARN: "name the secrets (arn:...:secret:trainstack/<stack>/*) in Resource",
}
IDENTITY_DOCUMENT_CARRIERS = (t.IAM_POLICY, *t.IAM_INLINE_POLICIES, *MANAGED_POLICY_ATTACHERS)


def _documents(resource_type: str, props: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """(where, document) for every identity policy document the resource grants, AWS managed ones included."""
    if resource_type == t.IAM_ROLE:
        inline = items(props, "inlinePolicies")
        for index, policy in enumerate([] if isinstance(inline, Unknown) else inline):
            yield f"inlinePolicies[{index}].policy", get(policy, "policy")
    elif resource_type in (t.IAM_POLICY, *t.IAM_INLINE_POLICIES):
        yield "policy", get(props, "policy")
    prop = MANAGED_POLICY_PROPERTIES.get(resource_type)
    if prop is None:
        return
    arns = items(props, prop)
    for index, arn in enumerate([] if isinstance(arns, Unknown) else arns):
        if not isinstance(arn, str) or is_unknown(arn):
            continue
        document = managed.document(arn)
        if document is not None:
            where = f"{prop}[{index}]" if prop.endswith("Arns") else prop
            yield f"{where} (the AWS managed {managed.aws_managed_name(arn)})", document


def _allow_statements(resource_type: str, props: Mapping[str, Any]) -> Iterator[tuple[str, Statement]]:
    for where, document in _documents(resource_type, props):
        try:
            parsed = statements(document)
        except UnreadableDocumentError:
            continue  # iam-no-wildcard-actions says so: one report per mistake
        for index, statement in enumerate(parsed or []):
            if statement.allows():
                yield f"{where} Statement[{index}]", statement


def _grants(resource_type: str, props: Mapping[str, Any], actions: Mapping[str, Shape]) -> Iterator[str]:
    for where, statement in _allow_statements(resource_type, props):
        yield from _statement_grants(where, statement, actions)
        if actions is DATA_ACTIONS:
            yield from _decrypt_context_grants(where, statement)


# The encryption context SSM and Secrets Manager send KMS names the parameter or secret being decrypted: a
# condition on it is the decrypt's resource, judged as the read's own (secret_read_statements in infra).
_SECRET_CONTEXTS = {
    "kms:encryptioncontext:parameter_arn": PARAMETER_ARN,
    "kms:encryptioncontext:secretarn": SECRET_ARN,
}


def _decrypt_context_grants(where: str, statement: Statement) -> Iterator[str]:
    if not statement.covers_action("kms:Decrypt"):
        return
    for operator, block in statement.conditions.items():
        if operator.lower().removesuffix("ifexists") not in ("stringlike", "stringequals"):
            continue
        for key, values in block.items():
            shape = _SECRET_CONTEXTS.get(key.lower())
            broad = [
                v for v in values if shape is not None and not is_unknown(v) and reaches_unnamed(v, shape)
            ]
            if shape is not None and broad:
                yield f"{where} allows kms:Decrypt for {key} {broad[0].strip()}: {_FIX[shape]}"


def _statement_grants(where: str, statement: Statement, actions: Mapping[str, Shape]) -> Iterator[str]:
    """One line per kind of resource the statement reaches without naming it."""
    by_shape: dict[Shape, list[str]] = {}
    for action, shape in actions.items():
        if statement.covers_action(action):
            by_shape.setdefault(shape, []).append(action)
    for shape, covered in by_shape.items():
        if statement.not_resources:
            yield (
                f"{where} allows {', '.join(covered)} with NotResource, i.e. on every resource it does not "
                f"list: {_FIX[shape]}"
            )
            continue
        broad = [r for r in statement.resources if not is_unknown(r) and reaches_unnamed(r, shape)]
        if broad:
            yield f"{where} allows {', '.join(covered)} on {broad[0].strip()}: {_FIX[shape]}"


def no_escalation_on_unnamed_resources(
    resource_type: str, props: Mapping[str, Any], config: Mapping[str, Any]
) -> Iterator[str]:
    """CKV_AWS_286 / CKV_AWS_355: iam:PassRole, sts:AssumeRole, launch template versions, IAM policy and
    credential changes, function code: only on resources named exactly, however the action is spelled."""
    yield from _grants(resource_type, props, ESCALATION_ACTIONS)


def no_data_access_on_unnamed_resources(
    resource_type: str, props: Mapping[str, Any], config: Mapping[str, Any]
) -> Iterator[str]:
    """CKV_AWS_288 / CKV_AWS_355: objects, SSM parameters and secrets only in a named bucket, parameter
    path or secret path, however the action is spelled and whoever wrote the policy (AWS managed too)."""
    yield from _grants(resource_type, props, DATA_ACTIONS)


# What deletes the stack's data or opens it, or erases who did what: no role of the stack needs any of them
# (the operator administers the bucket, its policy, the logs and the trail with their own credentials).
TEARDOWN_ACTIONS = (
    "s3:DeleteBucket",
    "s3:PutBucketPolicy",
    "s3:DeleteBucketPolicy",
    "s3:PutBucketAcl",
    "s3:PutBucketPublicAccessBlock",
    "s3:PutEncryptionConfiguration",
    "s3:PutBucketVersioning",
    "s3:PutLifecycleConfiguration",
    "s3:PutBucketLogging",
    "s3:PutBucketOwnershipControls",
    "s3:PutBucketObjectLockConfiguration",
    "logs:DeleteLogGroup",
    "logs:DeleteLogStream",
    "logs:DeleteRetentionPolicy",
    "logs:PutRetentionPolicy",
    "logs:DisassociateKmsKey",
    "ec2:DeleteFlowLogs",
    "ec2:DeleteVpcEndpoints",
    "cloudtrail:StopLogging",
    "cloudtrail:DeleteTrail",
    "kms:ScheduleKeyDeletion",
    "kms:DisableKey",
    "kms:PutKeyPolicy",
)


def no_teardown_of_data_or_audit_trail(
    resource_type: str, props: Mapping[str, Any], config: Mapping[str, Any]
) -> Iterator[str]:
    """S3.6 / CloudWatch.16 / CloudTrail: no identity policy lets a principal delete or reopen a bucket (its
    policy, ACL, public access block, encryption, versioning, lifecycle, logging), delete or shorten logs and
    flow logs, stop a trail or retire a key, on any resource, its own stack's included. Named actions only:
    a wildcard action is iam-no-wildcard-actions' finding (one report per mistake)."""
    for where, statement in _allow_statements(resource_type, props):
        if statement.not_actions or any(has_wildcard(action) for action in statement.actions):
            continue
        covered = [action for action in TEARDOWN_ACTIONS if statement.covers_action(action)]
        if covered:
            yield (
                f"{where} allows {', '.join(covered)}, which deletes or reopens the stack's data or erases "
                "its "
                "audit trail: remove them (the operator's own credentials administer the bucket, logs and "
                "keys)"
            )
