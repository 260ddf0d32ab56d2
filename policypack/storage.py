"""Checks on S3 buckets (each with the resources that configure it) and on KMS keys."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from pulumi_policy import PolicyResource, ReportViolation

from . import resource_types as t
from .documents import Statement, UnreadableDocumentError, statements
from .keys import is_aws_managed_key
from .properties import Unknown, as_bool, get, is_set, is_unknown, items
from .stack import Reference, configurers, describe, of_type, refers_to, require_configurer

_PUBLIC_ACCESS_FLAGS = ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls", "restrictPublicBuckets")
_KMS_ALGORITHMS = ("aws:kms", "aws:kms:dsse")


def _buckets(resources: Sequence[PolicyResource]) -> list[PolicyResource]:
    return of_type(resources, t.BUCKETS)


def public_access_blocked(
    resources: Sequence[PolicyResource], config: Mapping[str, Any], report: ReportViolation
) -> None:
    """S3.1 / S3.8: every bucket has a public access block with all four settings on."""
    for block in of_type(resources, [t.BUCKET_PUBLIC_ACCESS_BLOCK, t.ACCOUNT_PUBLIC_ACCESS_BLOCK]):
        off = _flags_off(block)
        if off:
            report(f"{describe(block)}: set {', '.join(off)} = true", block.urn)
    for bucket in _buckets(resources):
        require_configurer(
            resources,
            bucket,
            [t.BUCKET_PUBLIC_ACCESS_BLOCK],
            "bucket",
            problem=lambda block: (
                None if not _flags_off(block) else f"set {', '.join(_flags_off(block))} = true"
            ),
            missing="add an aws.s3.BucketPublicAccessBlock with all four block/ignore/restrict settings true",
            report=report,
        )


def _flags_off(block: PolicyResource) -> list[str]:
    return [
        flag
        for flag in _PUBLIC_ACCESS_FLAGS
        if not is_unknown(get(block.props, flag)) and as_bool(get(block.props, flag)) is not True
    ]


def tls_only(resources: Sequence[PolicyResource], config: Mapping[str, Any], report: ReportViolation) -> None:
    """S3.5: the bucket policy denies every request made without TLS (aws:SecureTransport = false)."""
    for bucket in _buckets(resources):
        inline = get(bucket.props, "policy")
        if is_unknown(inline) or (inline and _tls_problem(inline) is None):
            continue
        require_configurer(
            resources,
            bucket,
            [t.BUCKET_POLICY],
            "bucket",
            problem=lambda policy: _tls_problem(get(policy.props, "policy")),
            missing=(
                "add an aws.s3.BucketPolicy with a Deny of s3:* for Principal * when "
                '{"Bool": {"aws:SecureTransport": "false"}}'
            ),
            report=report,
        )


def _tls_problem(document: Any) -> str | None:
    try:
        parsed = statements(document)
    except UnreadableDocumentError as error:
        return f"its bucket policy is unreadable: {error}"
    if parsed is None or any(_denies_plain_http(statement) for statement in parsed):
        return None
    return (
        "its bucket policy lacks a Deny of s3:* for Principal * when "
        '{"Bool": {"aws:SecureTransport": "false"}}: add one'
    )


def _denies_plain_http(statement: Statement) -> bool:
    if not statement.denies() or "*" not in statement.principals:
        return False
    if not statement.covers_action("s3:GetObject") or not statement.covers_action("s3:PutObject"):
        return False
    for operator in ("Bool", "BoolIfExists"):
        values = statement.conditions.get(operator, {})
        for key, value in values.items():
            if key.lower() == "aws:securetransport" and "false" in [v.lower() for v in value]:
                return True
    return False


def sse_kms(resources: Sequence[PolicyResource], config: Mapping[str, Any], report: ReportViolation) -> None:
    """S3.17: default encryption is SSE-KMS with a customer managed key.

    A server access log bucket (the target of a BucketLogging) may use SSE-S3 instead: S3 log delivery
    does not support SSE-KMS default encryption on its target, so there SSE-S3 is the only choice.
    """
    for bucket in _buckets(resources):
        log_target = receives_access_logs(resources, bucket) is not Reference.NO
        inline = get(bucket.props, "serverSideEncryptionConfiguration", "rule")
        if inline is not None and _encryption_rule_problem(inline, log_target) is None:
            continue

        def problem(configuration: PolicyResource, log_target: bool = log_target) -> str | None:
            rules = items(configuration.props, "rules")
            if isinstance(rules, Unknown):
                return None
            problems = [_encryption_rule_problem(rule, log_target) for rule in rules]
            return None if any(p is None for p in problems) else (problems[0] or _NO_SSE_RULE)

        require_configurer(
            resources,
            bucket,
            t.BUCKET_ENCRYPTIONS,
            "bucket",
            problem=problem,
            missing=f"add an aws.s3.BucketServerSideEncryptionConfiguration: {_NO_SSE_RULE}",
            report=report,
        )


_NO_SSE_RULE = 'apply_server_side_encryption_by_default sse_algorithm="aws:kms" with kms_master_key_id'


def _encryption_rule_problem(rule: Any, log_target: bool = False) -> str | None:
    if is_unknown(rule):
        return None
    default = get(rule, "applyServerSideEncryptionByDefault")
    if is_unknown(default):
        return None
    algorithm = get(default, "sseAlgorithm")
    if log_target and algorithm == "AES256":
        return None
    if not is_unknown(algorithm) and algorithm not in _KMS_ALGORITHMS:
        return f'set sseAlgorithm = "aws:kms" (it is {algorithm})'
    key = get(default, "kmsMasterKeyId")
    if not is_set(key) or is_aws_managed_key(key):
        return "set kmsMasterKeyId to a customer managed KMS key (not the AWS managed aws/s3 key)"
    return None


def versioning_enabled(
    resources: Sequence[PolicyResource], config: Mapping[str, Any], report: ReportViolation
) -> None:
    """S3.14: versioning keeps every overwritten checkpoint and result recoverable."""
    for bucket in _buckets(resources):
        if _versioned(resources, bucket) is False:
            report(
                f"{describe(bucket)}: add an aws.s3.BucketVersioning with "
                'versioning_configuration status="Enabled"',
                bucket.urn,
            )


def _versioned(resources: Sequence[PolicyResource], bucket: PolicyResource) -> bool | None:
    """True/False, or None when it cannot be known before `up`."""
    inline = get(bucket.props, "versioning", "enabled")
    if as_bool(inline) is True or is_unknown(inline):
        return True if as_bool(inline) else None
    found = configurers(resources, bucket, t.BUCKET_VERSIONINGS, "bucket")
    statuses = [get(v.props, "versioningConfiguration", "status") for v in found.found]
    if any(status == "Enabled" for status in statuses):
        return True
    if any(is_unknown(status) for status in statuses) or found.maybe:
        return None
    return False


def lifecycle_configured(
    resources: Sequence[PolicyResource], config: Mapping[str, Any], report: ReportViolation
) -> None:
    """S3.13 / S3.10: a lifecycle configuration, one that expires old versions on a versioned bucket."""
    for bucket in _buckets(resources):
        versioned = _versioned(resources, bucket) is True
        inline = items(bucket.props, "lifecycleRules")
        if isinstance(inline, Unknown) or _inline_lifecycle_ok(inline, versioned):
            continue

        def problem(configuration: PolicyResource, versioned: bool = versioned) -> str | None:
            rules = items(configuration.props, "rules")
            if isinstance(rules, Unknown) or any(is_unknown(rule) for rule in rules):
                return None
            enabled = [
                rule
                for rule in rules
                if get(rule, "status") in ("Enabled", None) or is_unknown(get(rule, "status"))
            ]
            if not enabled:
                return f"enable a rule in {describe(configuration)}"
            if versioned and not any(_expires_old_versions(rule) for rule in enabled):
                return f"add noncurrent_version_expiration to an enabled rule in {describe(configuration)}"
            return None

        require_configurer(
            resources,
            bucket,
            t.BUCKET_LIFECYCLES,
            "bucket",
            problem=problem,
            missing=(
                "add an aws.s3.BucketLifecycleConfiguration (abort incomplete multipart uploads"
                + (", expire noncurrent versions)" if versioned else ")")
            ),
            report=report,
        )


def _inline_lifecycle_ok(rules: list[Any], versioned: bool) -> bool:
    enabled = [rule for rule in rules if as_bool(get(rule, "enabled")) is not False]
    return bool(enabled) and (not versioned or any(_expires_old_versions(rule) for rule in enabled))


def _expires_old_versions(rule: Any) -> bool:
    return is_set(get(rule, "noncurrentVersionExpiration")) or is_set(
        get(rule, "noncurrentVersionTransitions")
    )


def no_acls(resource_type: str, props: Mapping[str, Any], config: Mapping[str, Any]) -> Iterator[str]:
    """S3.12: access is granted by IAM and bucket policies only; ACLs are disabled (BucketOwnerEnforced)."""
    if resource_type in t.BUCKET_ACLS:
        acl = get(props, "acl")
        if is_set(get(props, "accessControlPolicy")) or (acl is not None and acl != "private"):
            yield "remove the ACL and grant access through IAM or the bucket policy"
    elif resource_type in t.BUCKETS:
        acl = get(props, "acl")
        if (acl is not None and not is_unknown(acl) and acl != "private") or is_set(get(props, "grants")):
            yield "remove acl/grants and grant access through IAM or the bucket policy"
    elif resource_type == t.BUCKET_OWNERSHIP_CONTROLS:
        ownership = get(props, "rule", "objectOwnership")
        if not is_unknown(ownership) and ownership != "BucketOwnerEnforced":
            yield f'set rule.objectOwnership = "BucketOwnerEnforced" (it is {ownership})'


def key_rotation_enabled(
    resource_type: str, props: Mapping[str, Any], config: Mapping[str, Any]
) -> Iterator[str]:
    """KMS.4: symmetric customer managed keys rotate yearly (or on their rotation period)."""
    spec = get(props, "customerMasterKeySpec")
    usage = get(props, "keyUsage")
    if is_unknown(spec) or is_unknown(usage):
        return  # whether the key can rotate at all is known on `up`, where the rule runs again
    if spec not in (None, "SYMMETRIC_DEFAULT") or usage not in (None, "ENCRYPT_DECRYPT"):
        return  # AWS can only rotate symmetric encryption keys
    rotation = get(props, "enableKeyRotation")
    if not is_unknown(rotation) and as_bool(rotation) is not True:
        yield "set enableKeyRotation = true"


def access_logging_enabled(
    resources: Sequence[PolicyResource], config: Mapping[str, Any], report: ReportViolation
) -> None:
    """S3.9: every bucket's requests are logged (server access logging) to another bucket.

    A bucket that itself receives access logs is exempt: logging it would log its own log deliveries
    (S3 recommends against it). Logging a bucket into itself is refused for the same reason.
    """
    for bucket in _buckets(resources):
        if receives_access_logs(resources, bucket) is not Reference.NO:
            continue
        inline_target = get(bucket.props, "logging", "targetBucket")
        if is_set(inline_target) and not _is_bucket(inline_target, bucket):
            continue

        def problem(logging: PolicyResource, bucket: PolicyResource = bucket) -> str | None:
            target = get(logging.props, "targetBucket")
            if not is_set(target):
                return f"set targetBucket on {describe(logging)}"
            if _is_bucket(target, bucket):
                return (
                    f"{describe(logging)} logs the bucket into itself (every delivery is logged again): "
                    "send the logs to a separate log bucket"
                )
            return None

        require_configurer(
            resources,
            bucket,
            t.BUCKET_LOGGINGS,
            "bucket",
            problem=problem,
            missing=(
                "add an aws.s3.BucketLogging with target_bucket=<a separate log bucket> "
                "(whose policy lets logging.s3.amazonaws.com write)"
            ),
            report=report,
        )


def receives_access_logs(resources: Sequence[PolicyResource], bucket: PolicyResource) -> Reference:
    """Is `bucket` the target of another bucket's server access logging? UNKNOWN while IDs are unknown."""
    answer = Reference.NO
    for logging in of_type(resources, t.BUCKET_LOGGINGS):
        if refers_to(logging, "bucket", bucket) is Reference.YES:
            continue  # a bucket logging into itself is not a log bucket; access_logging_enabled says so
        reference = refers_to(logging, "targetBucket", bucket)
        if reference is Reference.YES:
            return Reference.YES
        if reference is Reference.UNKNOWN:
            answer = Reference.UNKNOWN
    for source in _buckets(resources):
        target = get(source.props, "logging", "targetBucket")
        if source.urn != bucket.urn and is_set(target) and _is_bucket(target, bucket):
            return Reference.YES
    # Its own policy says so too: a bucket that lets S3 log delivery write is a log bucket even while no
    # BucketLogging (or one in another stack) points at it.
    documents = [get(bucket.props, "policy")]
    found = configurers(resources, bucket, [t.BUCKET_POLICY], "bucket")
    documents += [get(policy.props, "policy") for policy in found.found]
    for document in documents:
        try:
            parsed = statements(document)
        except UnreadableDocumentError:
            continue
        if parsed is None:
            answer = Reference.UNKNOWN
        elif any(_lets_log_delivery_write(statement) for statement in parsed):
            return Reference.YES
    return answer


_LOG_DELIVERY = "logging.s3.amazonaws.com"


def _lets_log_delivery_write(statement: Statement) -> bool:
    return (
        statement.allows()
        and _LOG_DELIVERY in statement.principals
        and statement.covers_action("s3:PutObject")
    )


def _is_bucket(value: Any, bucket: PolicyResource) -> bool:
    if is_unknown(value):
        return False
    names = [get(bucket.props, key) for key in ("bucket", "id")]
    return str(value) in [str(name) for name in names if name is not None and not is_unknown(name)]
