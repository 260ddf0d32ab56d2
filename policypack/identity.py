"""Checks on IAM: no wildcard actions, no decrypt on every KMS key, no AWS managed admin policies."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from . import resource_types as t
from .documents import Statement, UnreadableDocumentError, is_wildcard_action, statements
from .patterns import KEY_ARN, matches_shape
from .properties import Unknown, get, is_unknown, items

_DECRYPT_ACTIONS = ("kms:Decrypt", "kms:ReEncryptFrom")


def _documents(resource_type: str, props: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """(where, document) for each IAM policy document the resource carries."""
    if resource_type == t.IAM_ROLE:
        inline = items(props, "inlinePolicies")
        for index, policy in enumerate([] if isinstance(inline, Unknown) else inline):
            yield f"inlinePolicies[{index}].policy", get(policy, "policy")
    else:
        yield "policy", get(props, "policy")


def _allow_statements(resource_type: str, props: Mapping[str, Any]) -> Iterator[tuple[str, Statement]]:
    for where, document in _documents(resource_type, props):
        try:
            parsed = statements(document)
        except UnreadableDocumentError as error:
            raise _UnreadableError(f"{where}: {error}") from error
        for index, statement in enumerate(parsed or []):
            if statement.allows():
                yield f"{where} Statement[{index}]", statement


class _UnreadableError(Exception):
    """A document of the resource is not valid policy JSON; the message names which."""


def no_wildcard_actions(
    resource_type: str, props: Mapping[str, Any], config: Mapping[str, Any]
) -> Iterator[str]:
    """IAM.1 / IAM.21: Allow statements name their actions: no `*` or `?` pattern, no Allow+NotAction.

    Policy config `allowedActionPatterns` (default none) lists patterns a stack has reviewed and accepts.
    """
    allowed = [str(pattern) for pattern in config.get("allowedActionPatterns", [])]
    try:
        for where, statement in _allow_statements(resource_type, props):
            if statement.not_actions:
                yield f"{where} allows NotAction (everything else): list the actions it needs instead"
            wildcards = [action for action in statement.actions if is_wildcard_action(action, allowed)]
            if wildcards:
                yield f"{where} allows {', '.join(wildcards)}: list the actions it needs instead"
    except _UnreadableError as error:
        yield f"{error}: fix the JSON"


def no_decrypt_on_all_keys(
    resource_type: str, props: Mapping[str, Any], config: Mapping[str, Any]
) -> Iterator[str]:
    """KMS.1 / KMS.2: kms:Decrypt and kms:ReEncryptFrom are granted on named keys, never on all keys."""
    try:
        for where, statement in _allow_statements(resource_type, props):
            actions = [action for action in _DECRYPT_ACTIONS if statement.covers_action(action)]
            if not actions:
                continue
            if statement.not_resources:
                yield (
                    f"{where} allows {', '.join(actions)} with NotResource, which is every KMS key it does "
                    "not list: name the key ARNs in Resource"
                )
            elif any(_all_keys(resource) for resource in statement.resources):
                yield f"{where} allows {', '.join(actions)} on every KMS key: name the key ARNs in Resource"
    except _UnreadableError as error:
        yield f"{error}: fix the JSON"


def _all_keys(resource: str) -> bool:
    """True when a Resource pattern grants keys it does not name: it has a `*` or `?` and matches some KMS
    key's ARN. Every spelling counts (`*`, `arn:aws:kms:*`, `arn:aws:kms:<region>:<account>:*`,
    `...:key/*`, `arn:*:kms:*:*:key/*`, a wildcard in the region or account, `key/????...`); a named key, an
    alias (Decrypt is authorised on keys, never on aliases) and a wildcard over another service's ARNs
    pass."""
    if is_unknown(resource):
        return False
    pattern = resource.strip()
    return ("*" in pattern or "?" in pattern) and _matches_a_key_arn(pattern)


def _matches_a_key_arn(pattern: str) -> bool:
    """Whether an IAM Resource pattern matches at least one KMS key ARN,
    arn:<partition>:kms:<region>:<account>:key/<key id> (the exact matcher lives in patterns.py and judges
    the other resource wildcards too)."""
    return matches_shape(pattern, KEY_ARN)


# AWS managed policies that hand over a whole service or the account: AdministratorAccess (and its
# -Amplify/-AWSElasticBeanstalk variants), PowerUserAccess, job-function/*Administrator, and every
# *FullAccess policy (IAMFullAccess, AmazonS3FullAccess, AWSLambda_FullAccess, ...).
_AWS_MANAGED_POLICY = re.compile(r"^arn:aws[a-z-]*:iam::aws:policy/(?:[\w+=,.@-]+/)*(?P<name>[\w+=,.@-]+)$")
_BROAD_POLICY_NAME = re.compile(r"(?i)administrator|poweruser|fullaccess")
# The property of each resource type that attaches managed policies by ARN (one ARN or a list).
MANAGED_POLICY_PROPERTIES = {
    t.IAM_ROLE: "managedPolicyArns",
    t.ROLE_POLICY_ATTACHMENT: "policyArn",
    t.USER_POLICY_ATTACHMENT: "policyArn",
    t.GROUP_POLICY_ATTACHMENT: "policyArn",
    t.POLICY_ATTACHMENT: "policyArn",
    t.ROLE_POLICY_ATTACHMENTS_EXCLUSIVE: "policyArns",
    t.USER_POLICY_ATTACHMENTS_EXCLUSIVE: "policyArns",
    t.GROUP_POLICY_ATTACHMENTS_EXCLUSIVE: "policyArns",
}
MANAGED_POLICY_ATTACHERS = tuple(MANAGED_POLICY_PROPERTIES)


def broad_aws_managed_policy(arn: str) -> str | None:
    """The policy's name when `arn` is an AWS managed admin, power-user or *FullAccess policy, else None."""
    match = _AWS_MANAGED_POLICY.match(arn.strip())
    if match and _BROAD_POLICY_NAME.search(match.group("name")):
        return match.group("name")
    return None


def no_admin_managed_policies(
    resource_type: str, props: Mapping[str, Any], config: Mapping[str, Any]
) -> Iterator[str]:
    """IAM.1 / CIS 1.16 / CKV_AWS_274: no AWS managed admin or *FullAccess policy is attached.

    The documents of AWS managed policies are not in the stack, so iam-no-wildcard-actions never sees their
    `*`: an attachment of AdministratorAccess is judged by its ARN instead.
    """
    prop = MANAGED_POLICY_PROPERTIES.get(resource_type)
    if prop is None:
        return
    arns = items(props, prop)
    for index, arn in enumerate([] if isinstance(arns, Unknown) else arns):
        if not isinstance(arn, str) or is_unknown(arn):
            continue
        name = broad_aws_managed_policy(arn)
        if name:
            where = f"{prop}[{index}]" if prop.endswith("Arns") else prop
            yield (
                f"{where} attaches the AWS managed {name}, which grants far more than one stack needs: "
                "attach a policy that names the actions and resources it needs"
            )
