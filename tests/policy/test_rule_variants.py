"""Policy config, legacy type tokens and encodings the rules must also understand."""

from __future__ import annotations

import base64
import gzip

from tests.policy.golden import compliant_stack, named
from tests.policy.harness import Resource, check


def _open_https(resources: list[Resource]) -> None:
    named(resources, "instances").props["ingress"].append(
        {"protocol": "tcp", "fromPort": 443, "toPort": 443, "cidrBlocks": ["0.0.0.0/0"]}
    )


def test_public_https_fails_by_default_and_passes_when_authorized_in_config() -> None:
    resources = compliant_stack()
    _open_https(resources)
    assert [v.policy for v in check(resources)] == ["no-unrestricted-ingress"]
    assert check(resources, {"no-unrestricted-ingress": {"authorizedPublicPorts": [443]}}) == []


def test_authorized_ports_never_cover_all_protocols() -> None:
    resources = compliant_stack()
    named(resources, "instances").props["ingress"].append(
        {"protocol": "-1", "fromPort": 0, "toPort": 0, "cidrBlocks": ["0.0.0.0/0"]}
    )
    assert check(resources, {"no-unrestricted-ingress": {"authorizedPublicPorts": [0, 443]}})


def test_minimum_log_retention_comes_from_config() -> None:
    resources = compliant_stack()
    violations = check(resources, {"log-group-retained-and-encrypted": {"minimumRetentionDays": 365}})
    assert [v.policy for v in violations] == ["log-group-retained-and-encrypted"]
    assert "at least 365" in violations[0].message


def test_deprecated_v2_bucket_tokens_are_checked_too() -> None:
    resources = compliant_stack()
    named(resources, "bucket").type = "aws:s3/bucketV2:BucketV2"
    named(resources, "bucket-versioning").type = "aws:s3/bucketVersioningV2:BucketVersioningV2"
    assert check(resources) == []
    resources.remove(named(resources, "bucket-versioning"))
    assert [v.policy for v in check(resources)] == ["s3-versioning-enabled"]


def test_gzipped_user_data_is_scanned() -> None:
    resources = compliant_stack()
    payload = gzip.compress(b"#!/bin/sh\nexport AWS_ACCESS_KEY_ID=AKIAIOSFODNN7EXAMPLE\n")
    named(resources, "launch-template").props["userData"] = base64.b64encode(payload).decode()
    assert [v.policy for v in check(resources)] == ["no-secrets-in-user-data"]


def test_public_subnets_without_nat_may_assign_public_ips() -> None:
    resources = compliant_stack()
    interfaces = named(resources, "launch-template").props["networkInterfaces"]
    assert interfaces[0]["associatePublicIpAddress"] == "true"
    assert check(resources) == []


def test_inline_bucket_settings_count_as_configuration() -> None:
    resources = [r for r in compliant_stack() if r.name not in ("bucket-versioning", "bucket-lifecycle")]
    bucket = named(resources, "bucket")
    bucket.props["versioning"] = {"enabled": True}
    bucket.props["lifecycleRules"] = [{"enabled": True, "noncurrentVersionExpiration": {"days": 30}}]
    assert check(resources) == []


def test_instance_from_a_launch_template_inherits_its_metadata_options() -> None:
    resources = compliant_stack()
    resources.append(
        Resource("aws:ec2/instance:Instance", "from-template", {"launchTemplate": {"id": "lt-1"}})
    )
    assert check(resources) == []


def test_secret_in_user_data_that_was_never_base64_encoded_is_found() -> None:
    resources = compliant_stack()
    named(resources, "launch-template").props["userData"] = "#!/bin/sh\npassword=hunter2hunter2\n"
    violations = check(resources)
    assert [v.policy for v in violations] == ["no-secrets-in-user-data"]
    assert "contains a password" in violations[0].message


def test_user_data_referring_to_secrets_by_name_is_not_a_secret() -> None:
    resources = compliant_stack()
    script = "#!/bin/sh\npassword=$(aws ssm get-parameter --name /job/db --with-decryption)\n"
    named(resources, "launch-template").props["userData"] = base64.b64encode(script.encode()).decode()
    assert check(resources) == []
