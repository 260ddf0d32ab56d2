"""Storage: the stack's KMS key, the one bucket holding data, code, checkpoints, results and state, and the
log bucket recording every request made to it (S3 server access logging)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_aws as aws

from bootstrap.agent_config import Prefixes
from infra.iam import resource_policies
from trainstack_job.contract import StackOutput

# The bucket's access log (FSBP S3.9): who read or wrote which object, when, from where. Kept a year, like
# the VPC flow logs; log objects are written once, so old versions only ever come from deletes.
ACCESS_LOG_PREFIX = "s3-access/"
ACCESS_LOG_DAYS = 365
_ACCESS_LOG_NONCURRENT_DAYS = 7
_LOG_DELIVERY = "logging.s3.amazonaws.com"


def access_log_bucket_policy(
    *, log_bucket_arn: str, source_bucket_arn: str, account_id: str
) -> dict[str, Any]:
    """TLS only (S3.5); S3 log delivery may write under ACCESS_LOG_PREFIX for this account's bucket only.

    The confused-deputy guard AWS documents for log delivery: aws:SourceAccount and aws:SourceArn.
    """
    return {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Sid": "DenyInsecureTransport",
                "Effect": "Deny",
                "Principal": "*",
                "Action": "s3:*",
                "Resource": [log_bucket_arn, f"{log_bucket_arn}/*"],
                "Condition": {"Bool": {"aws:SecureTransport": "false"}},
            },
            {
                "Sid": "S3ServerAccessLogDelivery",
                "Effect": "Allow",
                "Principal": {"Service": _LOG_DELIVERY},
                "Action": "s3:PutObject",
                "Resource": f"{log_bucket_arn}/{ACCESS_LOG_PREFIX}*",
                "Condition": {
                    "StringEquals": {"aws:SourceAccount": account_id},
                    "ArnLike": {"aws:SourceArn": source_bucket_arn},
                },
            },
        ],
    }


def instance_endpoint_statement(
    *, bucket_arn: str, instance_endpoint_id: str, instance_principal_arns: Sequence[str]
) -> dict[str, Any]:
    """Deny the instance role (and any role of the instances) everything on the bucket unless the request
    comes through the stack's own S3 gateway endpoint: stolen instance credentials are useless elsewhere.

    Scoped by aws:PrincipalArn, so the user's own credentials (`trainstack data push`, the CLI, Pulumi) and
    the capacity Lambda, none of which run in the VPC, are untouched; every instance, of a multi-node job
    too, reaches S3 through the one endpoint on its subnets' route tables.
    """
    return {
        "Sid": "DenyInstanceRoleOutsideTheVpcEndpoint",
        "Effect": "Deny",
        "Principal": "*",
        "Action": "s3:*",
        "Resource": [bucket_arn, f"{bucket_arn}/*"],
        "Condition": {
            "ArnEquals": {"aws:PrincipalArn": list(instance_principal_arns)},
            "StringNotEquals": {"aws:SourceVpce": instance_endpoint_id},
        },
    }


def data_bucket_policy(
    *,
    bucket_arn: str,
    key_arn: str,
    instance_endpoint_id: str,
    instance_principal_arns: Sequence[str],
    prefixes: Prefixes | None = None,
) -> dict[str, Any]:
    """TLS and this stack's key only (resource_policies.bucket_policy); the instances through their endpoint
    only; the stack's roles create submissions and never write the environment's code
    (resource_policies.create_only_statements)."""
    document = resource_policies.bucket_policy(bucket_arn=bucket_arn, key_arn=key_arn)
    document["Statement"].extend(
        resource_policies.create_only_statements(
            bucket_arn=bucket_arn, role_arns=instance_principal_arns, prefixes=prefixes
        )
    )
    document["Statement"].append(
        instance_endpoint_statement(
            bucket_arn=bucket_arn,
            instance_endpoint_id=instance_endpoint_id,
            instance_principal_arns=instance_principal_arns,
        )
    )
    return document


@dataclass
class StorageArgs:
    name: str
    partition: str
    account_id: str
    region: str
    log_group_prefix: str
    noncurrent_version_days: int
    retain_data_on_destroy: bool
    tags: dict[str, str]


class Storage(pulumi.ComponentResource):
    """A rotating CMK and a private, versioned, TLS-only, SSE-KMS bucket with a lifecycle."""

    key: aws.kms.Key
    bucket: aws.s3.Bucket
    access_log_bucket: aws.s3.Bucket

    def __init__(self, name: str, args: StorageArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("trainstack:storage:Storage", name, None, opts)
        self._args = args
        # Retained on destroy together: a kept bucket is useless without its key, and unsafe without its
        # policy and public-access block, so those stay too. Everything else that bills goes.
        self._keep = pulumi.ResourceOptions(parent=self, retain_on_delete=args.retain_data_on_destroy)
        self.key = self._create_key(name)
        self.bucket = aws.s3.Bucket(
            f"{name}-bucket",
            bucket_prefix=f"{args.name}-",
            force_destroy=not args.retain_data_on_destroy,
            tags=args.tags,
            opts=self._keep,
        )
        self._lock_down_bucket(name)
        self.access_log_bucket = self._create_access_log_bucket(name)
        self.register_outputs(
            {
                "key_arn": self.key.arn,
                StackOutput.BUCKET_NAME.value: self.bucket.bucket,
                "access_log_bucket_name": self.access_log_bucket.bucket,
            }
        )

    def _create_key(self, name: str) -> aws.kms.Key:
        args = self._args
        log_groups = (
            f"arn:{args.partition}:logs:{args.region}:{args.account_id}:log-group:{args.log_group_prefix}*"
        )
        key = aws.kms.Key(
            f"{name}-key",
            description=f"{args.name}: encrypts the bucket, logs, alert topic and instance volumes",
            enable_key_rotation=True,
            deletion_window_in_days=7,
            policy=json.dumps(
                resource_policies.key_policy(
                    partition=args.partition,
                    account_id=args.account_id,
                    region=args.region,
                    log_group_arns_like=log_groups,
                )
            ),
            tags=args.tags,
            opts=self._keep,
        )
        aws.kms.Alias(
            f"{name}-key-alias",
            name=f"alias/{args.name}",
            target_key_id=key.key_id,
            opts=pulumi.ResourceOptions(parent=self),
        )
        return key

    def _lock_down_bucket(self, name: str) -> None:
        bucket = self.bucket.id
        block = aws.s3.BucketPublicAccessBlock(
            f"{name}-public-access-block",
            bucket=bucket,
            block_public_acls=True,
            block_public_policy=True,
            ignore_public_acls=True,
            restrict_public_buckets=True,
            opts=self._keep,
        )
        aws.s3.BucketOwnershipControls(
            f"{name}-ownership",
            bucket=bucket,
            rule=aws.s3.BucketOwnershipControlsRuleArgs(object_ownership="BucketOwnerEnforced"),
            opts=self._keep,
        )
        aws.s3.BucketVersioning(
            f"{name}-versioning",
            bucket=bucket,
            versioning_configuration=aws.s3.BucketVersioningVersioningConfigurationArgs(status="Enabled"),
            opts=self._keep,
        )
        aws.s3.BucketServerSideEncryptionConfiguration(
            f"{name}-encryption",
            bucket=bucket,
            rules=[
                aws.s3.BucketServerSideEncryptionConfigurationRuleArgs(
                    apply_server_side_encryption_by_default=aws.s3.BucketServerSideEncryptionConfigurationRuleApplyServerSideEncryptionByDefaultArgs(
                        sse_algorithm="aws:kms",
                        kms_master_key_id=self.key.arn,
                    ),
                    # One KMS call per bucket session instead of per object: far cheaper for many small files.
                    bucket_key_enabled=True,
                )
            ],
            opts=self._keep,
        )
        aws.s3.BucketLifecycleConfiguration(
            f"{name}-lifecycle",
            bucket=bucket,
            rules=[
                aws.s3.BucketLifecycleConfigurationRuleArgs(
                    id="abort-incomplete-uploads",
                    status="Enabled",
                    filter=aws.s3.BucketLifecycleConfigurationRuleFilterArgs(prefix=""),
                    abort_incomplete_multipart_upload=aws.s3.BucketLifecycleConfigurationRuleAbortIncompleteMultipartUploadArgs(
                        days_after_initiation=1
                    ),
                ),
                aws.s3.BucketLifecycleConfigurationRuleArgs(
                    id="expire-old-versions",
                    status="Enabled",
                    filter=aws.s3.BucketLifecycleConfigurationRuleFilterArgs(prefix=""),
                    noncurrent_version_expiration=aws.s3.BucketLifecycleConfigurationRuleNoncurrentVersionExpirationArgs(
                        noncurrent_days=self._args.noncurrent_version_days
                    ),
                    # Deleted checkpoints leave delete markers behind; clean them once their versions expire.
                    expiration=aws.s3.BucketLifecycleConfigurationRuleExpirationArgs(
                        expired_object_delete_marker=True
                    ),
                ),
            ],
            opts=self._keep,
        )
        self._name = name
        self._public_access_block = block

    def attach_bucket_policy(
        self,
        *,
        instance_endpoint_id: pulumi.Input[str],
        instance_principal_arns: Sequence[pulumi.Input[str]],
        prefixes: Prefixes | None = None,
    ) -> aws.s3.BucketPolicy:
        """The data bucket's policy, once the network and the instance role exist (data_bucket_policy).

        Separate from the constructor because the S3 endpoint's own policy names this bucket: the bucket comes
        first, then the network, then this policy naming the endpoint.
        """
        # After the public-access block: S3 rejects a policy while the block is still being applied.
        return aws.s3.BucketPolicy(
            f"{self._name}-policy",
            bucket=self.bucket.id,
            policy=pulumi.Output.all(
                self.bucket.arn, self.key.arn, instance_endpoint_id, *instance_principal_arns
            ).apply(
                lambda values: json.dumps(
                    data_bucket_policy(
                        bucket_arn=values[0],
                        key_arn=values[1],
                        instance_endpoint_id=values[2],
                        instance_principal_arns=values[3:],
                        prefixes=prefixes,
                    )
                )
            ),
            opts=pulumi.ResourceOptions.merge(
                self._keep, pulumi.ResourceOptions(depends_on=[self._public_access_block])
            ),
        )

    def _create_access_log_bucket(self, name: str) -> aws.s3.Bucket:
        """A log bucket only S3 log delivery writes to, then server access logging of the bucket into it.

        SSE-S3, not the stack's key: S3 log delivery does not support SSE-KMS default encryption on its
        target bucket. No logging of its own (it would log its own deliveries), no Object Lock (log
        delivery refuses such targets); otherwise as locked down as the data bucket.
        """
        args = self._args
        logs = aws.s3.Bucket(
            f"{name}-access-logs",
            bucket_prefix=f"{args.name}-logs-",
            force_destroy=not args.retain_data_on_destroy,
            tags=args.tags,
            opts=self._keep,
        )
        block = aws.s3.BucketPublicAccessBlock(
            f"{name}-access-logs-public-access-block",
            bucket=logs.id,
            block_public_acls=True,
            block_public_policy=True,
            ignore_public_acls=True,
            restrict_public_buckets=True,
            opts=self._keep,
        )
        aws.s3.BucketOwnershipControls(
            f"{name}-access-logs-ownership",
            bucket=logs.id,
            rule=aws.s3.BucketOwnershipControlsRuleArgs(object_ownership="BucketOwnerEnforced"),
            opts=self._keep,
        )
        aws.s3.BucketVersioning(
            f"{name}-access-logs-versioning",
            bucket=logs.id,
            versioning_configuration=aws.s3.BucketVersioningVersioningConfigurationArgs(status="Enabled"),
            opts=self._keep,
        )
        aws.s3.BucketServerSideEncryptionConfiguration(
            f"{name}-access-logs-encryption",
            bucket=logs.id,
            rules=[
                aws.s3.BucketServerSideEncryptionConfigurationRuleArgs(
                    apply_server_side_encryption_by_default=aws.s3.BucketServerSideEncryptionConfigurationRuleApplyServerSideEncryptionByDefaultArgs(
                        sse_algorithm="AES256"
                    ),
                )
            ],
            opts=self._keep,
        )
        aws.s3.BucketLifecycleConfiguration(
            f"{name}-access-logs-lifecycle",
            bucket=logs.id,
            rules=[
                aws.s3.BucketLifecycleConfigurationRuleArgs(
                    id="expire-access-logs",
                    status="Enabled",
                    filter=aws.s3.BucketLifecycleConfigurationRuleFilterArgs(prefix=""),
                    expiration=aws.s3.BucketLifecycleConfigurationRuleExpirationArgs(days=ACCESS_LOG_DAYS),
                    noncurrent_version_expiration=aws.s3.BucketLifecycleConfigurationRuleNoncurrentVersionExpirationArgs(
                        noncurrent_days=_ACCESS_LOG_NONCURRENT_DAYS
                    ),
                    abort_incomplete_multipart_upload=aws.s3.BucketLifecycleConfigurationRuleAbortIncompleteMultipartUploadArgs(
                        days_after_initiation=1
                    ),
                ),
            ],
            opts=self._keep,
        )
        policy = aws.s3.BucketPolicy(
            f"{name}-access-logs-policy",
            bucket=logs.id,
            policy=pulumi.Output.all(logs.arn, self.bucket.arn).apply(
                lambda arns: json.dumps(
                    access_log_bucket_policy(
                        log_bucket_arn=arns[0], source_bucket_arn=arns[1], account_id=args.account_id
                    )
                )
            ),
            opts=pulumi.ResourceOptions.merge(self._keep, pulumi.ResourceOptions(depends_on=[block])),
        )
        # After the policy: until it exists, S3 cannot deliver and would drop the first logs.
        aws.s3.BucketLogging(
            f"{name}-access-logging",
            bucket=self.bucket.id,
            target_bucket=logs.id,
            target_prefix=ACCESS_LOG_PREFIX,
            # Keys partitioned by the time of the request: s3-access/<account>/<region>/<bucket>/YYYY/MM/DD/.
            target_object_key_format=aws.s3.BucketLoggingTargetObjectKeyFormatArgs(
                partitioned_prefix=aws.s3.BucketLoggingTargetObjectKeyFormatPartitionedPrefixArgs(
                    partition_date_source="EventTime"
                )
            ),
            opts=pulumi.ResourceOptions.merge(self._keep, pulumi.ResourceOptions(depends_on=[policy])),
        )
        return logs
