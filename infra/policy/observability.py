"""Checks on where alerts and logs go: SNS topics and CloudWatch log groups."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from .properties import as_int, get, is_set, is_unknown

_AWS_MANAGED_SNS_KEY = "alias/aws/sns"


def topic_encrypted(resource_type: str, props: Mapping[str, Any], config: Mapping[str, Any]) -> Iterator[str]:
    """SNS.1: topics are encrypted at rest with a customer managed KMS key."""
    key = get(props, "kmsMasterKeyId")
    if not is_set(key):
        yield "set kmsMasterKeyId to a customer managed KMS key"
    elif key == _AWS_MANAGED_SNS_KEY:
        yield "set kmsMasterKeyId to a customer managed KMS key, not alias/aws/sns"


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
