"""A policy document written as an object (as TypeScript programs may: `policy: {Statement: [...]}`), with
one field an output of another resource (`"Resource": bucket.arn`): the engine marks that value unknown at
preview. Every rule that reads documents (policypack/documents.py) defers it to `up`; before the fix the
pack crashed on it (`'Unknown' object is not iterable`)."""

from __future__ import annotations

import pytest
from pulumi_policy.proxy import UNKNOWN_STRING_VALUE

from tests.policy.golden import compliant_stack, named
from tests.policy.harness import evaluate


@pytest.mark.parametrize("field", ["Resource", "Action", "Effect", "Principal", "Condition", "NotResource"])
def test_a_statement_field_known_only_after_up_in_a_document_given_as_an_object_is_deferred(
    field: str,
) -> None:
    """`"Resource": bucket.arn` in a policy written as an object (as TypeScript programs may): the engine
    marks that one value unknown at preview. The document is judged on `up`, never a crash of the pack."""
    statement = {"Effect": "Allow", "Action": "kms:Decrypt", "Resource": "*", field: UNKNOWN_STRING_VALUE}
    resources = compliant_stack()
    named(resources, "instance-role").props["inlinePolicies"] = [
        {"name": "x", "policy": {"Version": "2012-10-17", "Statement": [statement]}}
    ]
    verdict = evaluate(resources)
    assert verdict.violations == []
    assert ("kms-no-decrypt-on-all-keys", "instance-role") in [
        (d.policy, d.resource) for d in verdict.deferred
    ]
