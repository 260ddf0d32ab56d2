"""At preview, values that only `pulumi up` will know never make a policy fail, nor hide a real gap."""

from __future__ import annotations

from typing import Any

import pytest
from pulumi_policy.proxy import UNKNOWN_ARRAY_VALUE, UNKNOWN_STRING_VALUE

from tests.policy.golden import BUCKET, KEY_ARN, VPC_ID, compliant_stack, named
from tests.policy.harness import Resource, check, evaluate

# What a first preview cannot know: IDs and ARNs of resources not yet created, and everything built from them.
_KNOWN_ONLY_AFTER_UP = (KEY_ARN, BUCKET, VPC_ID, "sg-1", "subnet-", "lt-1")


def _unknown_if_computed(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _unknown_if_computed(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_unknown_if_computed(item) for item in value]
    if isinstance(value, str) and any(marker in value for marker in _KNOWN_ONLY_AFTER_UP):
        return UNKNOWN_STRING_VALUE
    return value


def _as_first_preview(resources: list[Resource], *, with_dependencies: bool) -> list[Resource]:
    bucket_names = {str(r.props.get("bucket")): r.name for r in resources if r.type == "aws:s3/bucket:Bucket"}
    for resource in resources:
        configured_bucket = bucket_names.get(str(resource.props.get("bucket")))
        resource.props = _unknown_if_computed(resource.props)
        resource.props.pop("id", None)
        resource.depends_on = {}
        if with_dependencies:
            if configured_bucket and resource.name != configured_bucket:
                resource.depends_on["bucket"] = [configured_bucket]
            if "vpcId" in resource.props:
                resource.depends_on["vpcId"] = ["vpc"]
    return resources


@pytest.mark.parametrize("with_dependencies", [True, False], ids=["engine-dependencies", "no-dependencies"])
def test_first_preview_with_unknown_ids_and_documents_passes(with_dependencies: bool) -> None:
    resources = _as_first_preview(compliant_stack(), with_dependencies=with_dependencies)
    assert named(resources, "bucket-policy").props["policy"] == UNKNOWN_STRING_VALUE
    verdict = evaluate(resources)
    assert verdict.violations == []
    deferred = {(d.policy, d.resource) for d in verdict.deferred}
    assert ("ebs-encrypted-with-cmk", "launch-template") in deferred
    assert ("kms-no-decrypt-on-all-keys", "instance-policy") in deferred
    assert ("imdsv2-required", "launch-template") not in deferred, "httpTokens is known at preview"


def test_unknown_lists_and_nested_values_pass() -> None:
    resources = compliant_stack()
    named(resources, "group").props["vpcZoneIdentifiers"] = UNKNOWN_ARRAY_VALUE
    named(resources, "group").props["mixedInstancesPolicy"]["launchTemplate"]["overrides"] = (
        UNKNOWN_ARRAY_VALUE
    )
    named(resources, "launch-template").props["blockDeviceMappings"] = UNKNOWN_ARRAY_VALUE
    named(resources, "launch-template").props["metadataOptions"]["httpPutResponseHopLimit"] = (
        UNKNOWN_STRING_VALUE
    )
    named(resources, "launch-template").props["userData"] = UNKNOWN_STRING_VALUE
    named(resources, "instances").props["ingress"] = UNKNOWN_ARRAY_VALUE
    named(resources, "logs").props["retentionInDays"] = UNKNOWN_STRING_VALUE
    named(resources, "bucket-encryption").props["rules"] = UNKNOWN_ARRAY_VALUE
    named(resources, "instance-role").props["inlinePolicies"] = UNKNOWN_ARRAY_VALUE
    verdict = evaluate(resources)
    assert verdict.violations == []
    assert {d.policy for d in verdict.deferred} >= {
        "group-spans-zones-and-types",
        "ebs-encrypted-with-cmk",
        "imds-hop-limit-one",
        "no-secrets-in-user-data",
        "no-unrestricted-ingress",
        "log-group-retained-and-encrypted",
        "iam-no-wildcard-actions",
    }
    assert all("can't be known during preview" in d.message for d in verdict.deferred)


def test_unknown_ids_do_not_hide_a_missing_public_access_block() -> None:
    resources = _as_first_preview(compliant_stack(), with_dependencies=True)
    resources.remove(named(resources, "bucket-public-access"))
    violations = check(resources)
    assert [v.policy for v in violations] == ["s3-public-access-blocked"]
    assert violations[0].urn == named(resources, "bucket").urn


def test_a_configurer_for_another_bucket_does_not_count() -> None:
    resources = compliant_stack()
    resources.append(Resource("aws:s3/bucket:Bucket", "logs-bucket", {"bucket": "other", "id": "other"}))
    violations = check(resources)
    assert violations and all("'logs-bucket'" in v.message for v in violations)
    assert {v.policy for v in violations} == {
        "s3-public-access-blocked",
        "s3-tls-only",
        "s3-sse-kms",
        "s3-versioning-enabled",
        "s3-lifecycle-configured",
        "s3-access-logging",
    }


def test_subnet_ids_unknown_at_preview_still_count_as_two_zones() -> None:
    resources = compliant_stack()
    named(resources, "group").props["vpcZoneIdentifiers"] = [UNKNOWN_STRING_VALUE, UNKNOWN_STRING_VALUE]
    verdict = evaluate(resources)
    assert verdict.violations == [] and verdict.deferred == []
    named(resources, "group").props["vpcZoneIdentifiers"] = [UNKNOWN_STRING_VALUE]
    assert [v.policy for v in check(resources)] == ["group-spans-zones-and-types"]


@pytest.mark.parametrize("unknown", ["customerMasterKeySpec", "keyUsage"])
def test_a_key_spec_known_only_after_up_never_fails_the_rotation_rule_at_preview(unknown: str) -> None:
    """An asymmetric or HMAC key cannot rotate: with its spec or usage unknown, rotation is judged on `up`."""
    resources = compliant_stack()
    key = named(resources, "key").props
    key.update(enableKeyRotation=False, **{unknown: UNKNOWN_STRING_VALUE})
    assert [v.policy for v in check(resources)] == []
    key[unknown] = "SYMMETRIC_DEFAULT" if unknown == "customerMasterKeySpec" else "ENCRYPT_DECRYPT"
    assert [v.policy for v in check(resources)] == ["kms-key-rotation-enabled"], "known, it must rotate"
