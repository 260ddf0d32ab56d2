"""The stack's resource policies: the key's (who may use and administer the CMK), the bucket's (TLS, SSE-KMS
with this key, submissions created never overwritten) and the alert topic's (who may publish)."""

from __future__ import annotations

from collections.abc import Sequence

from bootstrap.agent_config import Prefixes
from infra.iam.common import Document, doc, submitted_objects

# KMS actions a principal needs to use (not manage) the key; listed, never `kms:*` or `kms:Encrypt*`.
_KEY_USE = ["kms:Encrypt", "kms:Decrypt", "kms:ReEncryptFrom", "kms:ReEncryptTo", "kms:GenerateDataKey",
            "kms:GenerateDataKeyWithoutPlaintext", "kms:DescribeKey"]  # fmt: skip
# The account's administrators manage the key through IAM; this list replaces the usual `kms:*` so that
# no document grants every KMS action (KMS.1/KMS.2, IAM.21). PutKeyPolicy must stay: KMS refuses a key
# whose policy would lock its creator out. Grants are left to the one service that needs them.
_KEY_ADMIN = ["kms:DescribeKey", "kms:GetKeyPolicy", "kms:PutKeyPolicy", "kms:ListKeyPolicies",
              "kms:GetKeyRotationStatus", "kms:EnableKeyRotation", "kms:DisableKeyRotation",
              "kms:RotateKeyOnDemand", "kms:ListKeyRotations", "kms:ListResourceTags", "kms:TagResource",
              "kms:UntagResource", "kms:UpdateKeyDescription", "kms:EnableKey", "kms:DisableKey",
              "kms:ScheduleKeyDeletion", "kms:CancelKeyDeletion", "kms:CreateAlias", "kms:DeleteAlias",
              "kms:UpdateAlias", "kms:ListGrants"]  # fmt: skip


def key_policy(*, partition: str, account_id: str, region: str, log_group_arns_like: str) -> Document:
    """The CMK's key policy: this account's IAM decides who uses it; AWS services get exactly what they need.

    Services that write to encrypted destinations must be named here or they fail silently: EventBridge,
    Budgets and CloudWatch alarms publishing to the encrypted topic, CloudWatch Logs writing encrypted log
    groups, and Auto Scaling's service-linked role launching instances with encrypted root volumes.
    """
    root = f"arn:{partition}:iam::{account_id}:root"
    autoscaling_role = (
        f"arn:{partition}:iam::{account_id}:role/aws-service-role/autoscaling.amazonaws.com/"
        "AWSServiceRoleForAutoScaling"
    )
    same_account = {"StringEquals": {"aws:SourceAccount": account_id}}
    return doc(
        {
            "Sid": "AccountAdministersKeyThroughIam",
            "Effect": "Allow",
            "Principal": {"AWS": root},
            "Action": _KEY_ADMIN,
            "Resource": "*",
        },
        {
            "Sid": "AccountUsesKeyThroughIam",
            "Effect": "Allow",
            "Principal": {"AWS": root},
            "Action": _KEY_USE,
            "Resource": "*",
        },
        {
            # EBS needs a grant to use the key for a volume: `trainstack dev up` creates the dev box's
            # encrypted workspace and launches its encrypted root disk with the user's own credentials.
            "Sid": "AccountGrantsEbsTheKeyThroughIam",
            "Effect": "Allow",
            "Principal": {"AWS": root},
            "Action": "kms:CreateGrant",
            "Resource": "*",
            "Condition": {"Bool": {"kms:GrantIsForAWSResource": "true"}},
        },
        {
            "Sid": "CloudWatchLogsEncryptsThisStacksLogGroups",
            "Effect": "Allow",
            "Principal": {"Service": f"logs.{region}.amazonaws.com"},
            # DescribeKey carries no encryption context, so the condition below would never let it through.
            "Action": [action for action in _KEY_USE if action != "kms:DescribeKey"],
            "Resource": "*",
            # The context holds the log group's ARN as a plain string (IAM types the key as String).
            "Condition": {"StringLike": {"kms:EncryptionContext:aws:logs:arn": log_group_arns_like}},
        },
        {
            "Sid": "AlertSourcesPublishToTheEncryptedTopic",
            "Effect": "Allow",
            "Principal": {
                "Service": ["events.amazonaws.com", "budgets.amazonaws.com", "cloudwatch.amazonaws.com"]
            },
            "Action": ["kms:Decrypt", "kms:GenerateDataKey"],
            "Resource": "*",
            "Condition": same_account,
        },
        # The service-linked role is named by condition, not as a principal: KMS refuses a policy naming a
        # role that does not exist yet, and this role appears only when the account's first group is made.
        {
            "Sid": "AutoScalingLaunchesEncryptedVolumes",
            "Effect": "Allow",
            "Principal": {"AWS": "*"},
            "Action": _KEY_USE,
            "Resource": "*",
            "Condition": {
                "StringEquals": {"aws:PrincipalAccount": account_id},
                "ArnEquals": {"aws:PrincipalArn": autoscaling_role},
            },
        },
        {
            "Sid": "AutoScalingGrantsEbsTheKey",
            "Effect": "Allow",
            "Principal": {"AWS": "*"},
            "Action": "kms:CreateGrant",
            "Resource": "*",
            "Condition": {
                "StringEquals": {"aws:PrincipalAccount": account_id},
                "ArnEquals": {"aws:PrincipalArn": autoscaling_role},
                "Bool": {"kms:GrantIsForAWSResource": "true"},
            },
        },
    )


def bucket_policy(*, bucket_arn: str, key_arn: str) -> Document:
    """TLS only (S3.5), and no upload encrypted any other way than SSE-KMS with this stack's key (S3.17).

    Uploads that send no encryption header get the bucket default (this key), so clients need not know it.
    """
    objects = f"{bucket_arn}/*"
    return doc(
        {
            "Sid": "DenyInsecureTransport",
            "Effect": "Deny",
            "Principal": "*",
            "Action": "s3:*",
            "Resource": [bucket_arn, objects],
            "Condition": {"Bool": {"aws:SecureTransport": "false"}},
        },
        {
            "Sid": "DenyOtherEncryptionThanKms",
            "Effect": "Deny",
            "Principal": "*",
            "Action": "s3:PutObject",
            "Resource": objects,
            "Condition": {
                "StringNotEquals": {"s3:x-amz-server-side-encryption": "aws:kms"},
                "Null": {"s3:x-amz-server-side-encryption": "false"},
            },
        },
        {
            "Sid": "DenyOtherKmsKeys",
            "Effect": "Deny",
            "Principal": "*",
            "Action": "s3:PutObject",
            "Resource": objects,
            "Condition": {
                "ArnNotEquals": {"s3:x-amz-server-side-encryption-aws-kms-key-id": key_arn},
                "Null": {"s3:x-amz-server-side-encryption-aws-kms-key-id": "false"},
            },
        },
    )


def create_only_statements(
    *, bucket_arn: str, role_arns: Sequence[str], prefixes: Prefixes | None = None
) -> list[Document]:
    """A submitter is not root (SECURITY.md, "A submitter"): the stack's roles (the agent's, the job's, the
    dev box's) may only create a job's code, record and queue entry, never overwrite one (S3 refuses a write
    without If-None-Match: "Enforce conditional writes"), and never write or delete the environment's code,
    which the agent runs as root. The operator's own credentials (`pulumi up`, which writes `code/` and the
    default job) are not these roles; they administer the account anyway."""
    code = (prefixes or Prefixes()).code
    roles = {"ArnEquals": {"aws:PrincipalArn": list(role_arns)}}
    return [
        {
            "Sid": "SubmissionsAreCreatedNeverOverwritten",
            "Effect": "Deny",
            "Principal": "*",
            "Action": "s3:PutObject",
            "Resource": [f"{bucket_arn}/{key}" for key in submitted_objects(prefixes)],
            "Condition": {**roles, "Null": {"s3:if-none-match": "true"}},
        },
        {
            "Sid": "EnvironmentCodeOnlyFromTheOperator",
            "Effect": "Deny",
            "Principal": "*",
            "Action": ["s3:PutObject", "s3:DeleteObject", "s3:DeleteObjectVersion"],
            "Resource": f"{bucket_arn}/{code}*",
            "Condition": roles,
        },
    ]


def topic_policy(*, topic_arn: str, account_id: str, partition: str, region: str) -> Document:
    """Who may publish to the alert topic: this account's EventBridge rules, budgets and alarms only.

    The account's own principals need no statement here: in one account, their IAM policies suffice.
    """

    def service_may_publish(sid: str, service: str, source_arn: str) -> Document:
        # SourceAccount + SourceArn: the service acts for this account's own rules, budgets or alarms only.
        return {
            "Sid": sid,
            "Effect": "Allow",
            "Principal": {"Service": f"{service}.amazonaws.com"},
            "Action": "sns:Publish",
            "Resource": topic_arn,
            "Condition": {
                "StringEquals": {"aws:SourceAccount": account_id},
                "ArnLike": {"aws:SourceArn": source_arn},
            },
        }

    return doc(
        service_may_publish(
            "EventBridgeRulesPublish", "events", f"arn:{partition}:events:{region}:{account_id}:rule/*"
        ),
        service_may_publish("BudgetsPublish", "budgets", f"arn:{partition}:budgets::{account_id}:*"),
        service_may_publish(
            "CloudWatchAlarmsPublish",
            "cloudwatch",
            f"arn:{partition}:cloudwatch:{region}:{account_id}:alarm:*",
        ),
    )
