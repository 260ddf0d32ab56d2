"""IAM, KMS, S3 and SNS policy documents as pure functions of ARNs: data, tested without AWS or mocks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bootstrap.agent_config import Prefixes

Document = dict[str, Any]

# Actions that accept no resource ARN: AWS requires `"Resource": "*"` for them. Every use below names one
# of these, and tests/infra/test_policies.py checks that nothing else ever gets `*`.
RESOURCE_STAR_REQUIRED = frozenset(
    {
        "cloudwatch:PutMetricData",  # scoped by the cloudwatch:namespace condition instead
        "autoscaling:DescribeAutoScalingGroups",
        "autoscaling:DescribeAutoScalingInstances",
        "autoscaling:DescribeScalingActivities",  # the capacity fallback reads why launches failed
        "ec2:DescribeSpotPriceHistory",
        "pricing:GetProducts",  # an on-demand life's price (bootstrap/pricing.py)
    }
)
METRIC_NAMESPACE = "trainstack"

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


def _doc(*statements: Document) -> Document:
    return {"Version": "2012-10-17", "Statement": list(statements)}


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
    return _doc(
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
    return _doc(
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

    return _doc(
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


def instance_policy(
    *,
    bucket_arn: str,
    key_arn: str,
    topic_arn: str,
    log_group_arn: str,
    group_arn_pattern: str,
    prefixes: Prefixes | None = None,
) -> Document:
    """What an instance may do: this bucket's prefixes, this key, this topic, this log group, this group."""
    prefixes = prefixes or Prefixes()
    # code/: the bundle this config names, and a running job's pinned bundle from an earlier `pulumi up`.
    read_prefixes = [prefixes.data, prefixes.code]
    # jobs/: every job's own objects (an instance may continue another job, or start from one's checkpoint);
    # checkpoints/, results/, state/: the legacy job's, and state/ the stack's current-job pointer.
    write_prefixes = [prefixes.jobs, prefixes.checkpoints, prefixes.results, prefixes.state]
    return _doc(
        {
            "Sid": "ListOwnPrefixes",
            "Effect": "Allow",
            "Action": "s3:ListBucket",
            "Resource": bucket_arn,
            "Condition": {"StringLike": {"s3:prefix": [f"{p}*" for p in read_prefixes + write_prefixes]}},
        },
        {
            # s5cmd and the AWS CLI look the bucket's region up before they transfer.
            "Sid": "LocateBucket",
            "Effect": "Allow",
            "Action": "s3:GetBucketLocation",
            "Resource": bucket_arn,
        },
        {
            "Sid": "ReadDataAndCode",
            "Effect": "Allow",
            "Action": "s3:GetObject",
            "Resource": [f"{bucket_arn}/{p}*" for p in read_prefixes],
        },
        {
            "Sid": "ReadWriteJobsAndLegacyJob",
            "Effect": "Allow",
            "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"],
            "Resource": [f"{bucket_arn}/{p}*" for p in write_prefixes],
        },
        {
            "Sid": "UseStackKey",
            "Effect": "Allow",
            "Action": ["kms:Decrypt", "kms:GenerateDataKey", "kms:DescribeKey"],
            "Resource": key_arn,
        },
        {
            "Sid": "PublishAlerts",
            "Effect": "Allow",
            "Action": "sns:Publish",
            "Resource": topic_arn,
        },
        {
            "Sid": "WriteLogs",
            "Effect": "Allow",
            "Action": ["logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"],
            "Resource": [log_group_arn, f"{log_group_arn}:log-stream:*"],
        },
        {
            "Sid": "PublishGpuMetrics",
            "Effect": "Allow",
            "Action": "cloudwatch:PutMetricData",
            "Resource": "*",
            "Condition": {"StringEquals": {"cloudwatch:namespace": METRIC_NAMESPACE}},
        },
        {
            "Sid": "ScaleOwnGroup",
            "Effect": "Allow",
            "Action": [
                "autoscaling:SetDesiredCapacity",
                "autoscaling:CompleteLifecycleAction",
                "autoscaling:RecordLifecycleActionHeartbeat",
                "autoscaling:SetInstanceHealth",
                "autoscaling:TerminateInstanceInAutoScalingGroup",
            ],
            "Resource": group_arn_pattern,
        },
        {
            "Sid": "DescribeGroupsAndSpotPrices",
            "Effect": "Allow",
            "Action": sorted(RESOURCE_STAR_REQUIRED - {"cloudwatch:PutMetricData"}),
            "Resource": "*",
        },
    )


def autoscaling_group_arn(*, partition: str, region: str, account_id: str, group_name: str) -> str:
    """The group's ARN with its generated id left open: the name is fixed before the group exists."""
    return (
        f"arn:{partition}:autoscaling:{region}:{account_id}:autoScalingGroup:*:"
        f"autoScalingGroupName/{group_name}"
    )


# Auto Scaling's Describe* actions take no resource ARN; AWS requires `"Resource": "*"` for them.
CAPACITY_FALLBACK_DESCRIBE_ACTIONS = [
    "autoscaling:DescribeAutoScalingGroups",
    "autoscaling:DescribeScalingActivities",
]


def capacity_fallback_policy(*, group_arn: str, log_group_arn: str) -> Document:
    """The capacity fallback's role: read its group, change that group's purchase option, write its logs.

    No ec2:RunInstances, iam:PassRole or ec2:CreateTags: the function updates the instances distribution
    only and never names the launch template, and AWS checks those three only for a create or update that
    does (EC2 Auto Scaling User Guide, "Control Amazon EC2 launch template usage in Auto Scaling groups";
    infra/capacity_fallback/handler.py, tests/iam).
    """
    return _doc(
        {
            "Sid": "ReadTheGroup",
            "Effect": "Allow",
            "Action": CAPACITY_FALLBACK_DESCRIBE_ACTIONS,
            "Resource": "*",
        },
        {
            "Sid": "SwitchThisGroupsPurchaseOption",
            "Effect": "Allow",
            "Action": "autoscaling:UpdateAutoScalingGroup",
            "Resource": group_arn,
        },
        {
            "Sid": "WriteItsOwnLogs",
            "Effect": "Allow",
            "Action": ["logs:CreateLogStream", "logs:PutLogEvents"],
            "Resource": f"{log_group_arn}:*",
        },
    )


def flow_logs_policy(*, log_group_arn: str) -> Document:
    """What the VPC flow-logs service may do: write to its own log group only."""
    return _doc(
        {
            "Sid": "WriteFlowLogs",
            "Effect": "Allow",
            "Action": ["logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"],
            "Resource": [log_group_arn, f"{log_group_arn}:log-stream:*"],
        }
    )


def assume_role_policy(service: str, *, account_id: str | None = None) -> Document:
    """Trust policy letting one AWS service assume a role (optionally only on behalf of this account)."""
    statement: Document = {
        "Effect": "Allow",
        "Principal": {"Service": service},
        "Action": "sts:AssumeRole",
    }
    if account_id:
        statement["Condition"] = {"StringEquals": {"aws:SourceAccount": account_id}}
    return _doc(statement)


def actions_of(document: Document) -> Sequence[str]:
    """Every action a document names (for tests and the policy pack)."""
    found: list[str] = []
    for statement in document["Statement"]:
        action = statement.get("Action", [])
        found.extend([action] if isinstance(action, str) else action)
    return found
