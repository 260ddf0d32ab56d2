"""Checks on IAM policy documents: no wildcard actions, no decrypt on every KMS key."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from . import resource_types as t
from .documents import Statement, UnreadableDocumentError, is_wildcard_action, statements
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
    """IAM.1 / IAM.21: Allow statements name their actions; no `*`, `service:*` or Allow+NotAction."""
    try:
        for where, statement in _allow_statements(resource_type, props):
            if statement.not_actions:
                yield f"{where} allows NotAction (everything else): list the actions it needs instead"
            wildcards = [action for action in statement.actions if is_wildcard_action(action)]
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
            if actions and any(_all_keys(resource) for resource in statement.resources):
                yield f"{where} allows {', '.join(actions)} on every KMS key: name the key ARNs in Resource"
    except _UnreadableError as error:
        yield f"{error}: fix the JSON"


def _all_keys(resource: str) -> bool:
    if is_unknown(resource):
        return False
    resource = resource.strip()
    return resource == "*" or resource.startswith("arn:aws:kms:*") or resource.endswith(":key/*")
