"""kms-no-decrypt-on-all-keys: every spelling of "all keys" (or of "keys nobody named") in an IAM policy's
Resource fails; a named key, an alias and another service's ARNs pass. A rule that knew only `*` and
`...:key/*` let `arn:aws:kms:us-east-1:123456789012:*` through: a Decrypt on every key of the account."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.policy.golden import KEY_ARN, compliant_stack, named
from tests.policy.harness import check

RULE = "kms-no-decrypt-on-all-keys"
KEY_ID = "1234abcd-12ab-34cd-56ef-1234567890ab"

ALL_KEYS = [
    "*",
    " * ",
    "arn:*",
    "arn:aws:*",
    "arn:aws:kms:*",
    "arn:aws:kms:*:*:*",
    "arn:aws:kms:us-east-1:*",
    "arn:aws:kms:us-east-1:123456789012:*",  # the false negative the old rule had
    "arn:aws:kms:us-east-1:123456789012:key/*",
    "arn:aws:kms:us-east-1:123456789012:key*",
    "arn:aws:kms:us-east-1:123456789012:k*",
    "arn:*:kms:*:*:key/*",
    "arn:aws-cn:kms:*:*:key/*",
    "arn:aws:km?:*",
    "*:key/*",
    "ARN:AWS:KMS:*",
    # A wildcard in the region or the account: the same key id in every region or every account.
    f"arn:aws:kms:*:123456789012:key/{KEY_ID}",
    f"arn:aws:kms:us-east-1:*:key/{KEY_ID}",
    f"arn:aws:kms:us-east-?:123456789012:key/{KEY_ID}",
    f"arn:aws:kms:us-east-1:12345678901?:key/{KEY_ID}",
    # Part of the key id: several keys, none of them named.
    "arn:aws:kms:us-east-1:123456789012:key/mrk-*",
    f"arn:aws:kms:us-east-1:123456789012:key/{KEY_ID[:-1]}?",
    "arn:aws:kms:us-east-1:123456789012:key/????????-????-????-????-????????????",
]

NAMED = [
    KEY_ARN,
    f"arn:aws:kms:us-west-2:210987654321:key/{KEY_ID}",
    "arn:aws:kms:eu-west-1:123456789012:key/mrk-1234abcd12ab34cd56ef1234567890ab",
    "arn:aws-us-gov:kms:us-gov-west-1:123456789012:key/" + KEY_ID,
    # Aliases: Decrypt is authorised on the key, so an alias (even a pattern of aliases) grants no key.
    "arn:aws:kms:us-east-1:123456789012:alias/trainstack-dev",
    "arn:aws:kms:us-east-1:123456789012:alias/*",
    "alias/trainstack-dev",
    # Another service's resources: a wildcard there grants no KMS key.
    "arn:aws:s3:::trainstack-bucket/*",
    "arn:aws:sns:*:*:*",
]


def _with_statement(statement: dict[str, Any]) -> list[Any]:
    resources = compliant_stack()
    named(resources, "instance-inline").props["policy"] = json.dumps(
        {"Version": "2012-10-17", "Statement": [statement]}
    )
    return resources


@pytest.mark.parametrize("action", ["kms:Decrypt", "kms:ReEncryptFrom"])
@pytest.mark.parametrize("resource", ALL_KEYS)
def test_every_spelling_of_all_keys_fails(resource: str, action: str) -> None:
    statement = {"Effect": "Allow", "Action": action, "Resource": [KEY_ARN, resource]}
    violations = check(_with_statement(statement))
    assert [v.policy for v in violations] == [RULE], resource
    assert f"allows {action} on every KMS key" in violations[0].message


@pytest.mark.parametrize("resource", NAMED)
def test_named_keys_aliases_and_other_services_pass(resource: str) -> None:
    statement = {"Effect": "Allow", "Action": ["kms:Decrypt", "kms:ReEncryptFrom"], "Resource": resource}
    assert check(_with_statement(statement)) == [], resource


def test_a_decrypt_on_all_keys_in_a_deny_or_for_another_action_is_not_a_grant_of_decrypt() -> None:
    deny = {"Effect": "Deny", "Action": "kms:Decrypt", "Resource": "arn:aws:kms:us-east-1:123456789012:*"}
    assert check(_with_statement(deny)) == []
    describe = {"Effect": "Allow", "Action": "kms:DescribeKey", "Resource": KEY_ARN}
    assert check(_with_statement(describe)) == []


def test_not_resource_grants_every_key_it_does_not_list() -> None:
    statement = {"Effect": "Allow", "Action": "kms:Decrypt", "NotResource": KEY_ARN}
    violations = check(_with_statement(statement))
    assert [v.policy for v in violations] == [RULE]
    assert "NotResource" in violations[0].message
