"""Checks on where alerts and logs go: SNS topics and CloudWatch log groups."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from .keys import aws_managed_alias, is_aws_managed_key
from .properties import as_int, get, is_set, is_unknown


def topic_encrypted(resource_type: str, props: Mapping[str, Any], config: Mapping[str, Any]) -> Iterator[str]:
    """SNS.1: topics are encrypted at rest with a customer managed KMS key (the stack's own, not AWS's).

    An AWS managed key (alias/aws/sns, by alias or alias ARN) encrypts too, but its key policy is AWS's:
    the stack can neither limit who decrypts nor let EventBridge, Budgets and alarms publish.
    """
    key = get(props, "kmsMasterKeyId")
    if not is_set(key):
        yield "set kmsMasterKeyId to a customer managed KMS key"
    elif is_aws_managed_key(key):
        yield f"set kmsMasterKeyId to the stack's customer managed KMS key, not {aws_managed_alias(key)}"


def log_group_retained_and_encrypted(
    resource_type: str, props: Mapping[str, Any], config: Mapping[str, Any]
) -> Iterator[str]:
    """CloudWatch.16 (retention) and CMK encryption: logs neither vanish early nor cost forever.

    Policy config `minimumRetentionDays` (default 1) raises the floor; Security Hub's default is 365.
    """
    minimum = int(config.get("minimumRetentionDays", 1))
    raw = get(props, "retentionInDays")
    days = as_int(raw)
    if not is_unknown(raw) and (days is None or days < max(minimum, 1)):
        yield f"set retentionInDays to at least {max(minimum, 1)} (0 or unset keeps logs and cost forever)"
    if not is_set(get(props, "kmsKeyId")):
        yield "set kmsKeyId to a customer managed KMS key"
