"""Telling a customer managed KMS key from an AWS managed one (alias/aws/<service>), in any form."""

from __future__ import annotations

import re
from typing import Any

from .properties import is_unknown

# `alias/aws/sns`, `arn:aws:kms:us-east-1:111122223333:alias/aws/sns`: AWS owns these keys' policies,
# so the stack cannot decide who decrypts with them. Alias names are case-sensitive and `aws/` is reserved.
_AWS_MANAGED_ALIAS = re.compile(r"(?:^|:)alias/aws/")


def is_aws_managed_key(value: Any) -> bool:
    """True when a kmsKeyId-like value names an AWS managed key through its reserved alias."""
    return isinstance(value, str) and not is_unknown(value) and bool(_AWS_MANAGED_ALIAS.search(value.strip()))


def aws_managed_alias(value: str) -> str:
    """`alias/aws/sns` out of either form, for messages."""
    return value.strip()[value.strip().index("alias/aws/") :]
