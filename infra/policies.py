"""IAM, KMS, S3 and SNS policy documents as pure functions of ARNs: data, tested without AWS or mocks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bootstrap.agent_config import Prefixes
from bootstrap.devbox.heartbeat import DEV_PREFIX
from trainstack_job.datasets import DATASETS_PREFIX
from trainstack_job.jobs import CURRENT_JOB, JOB_RECORD
from trainstack_job.queue import JOB_CODE_PREFIX, QUEUE_PREFIX
from trainstack_job.secret_refs import SECRETS_ROOT

Document = dict[str, Any]

# What the SSM agent needs for Session Manager, and nothing of AmazonSSMManagedInstanceCore's rest (that
# policy also grants ssm:GetParameter(s), GetDocument, ListAssociations, PutInventory... on `*`, so any
# code on the instance could read every SSM parameter in the region). Systems Manager User Guide, "Step 2:
# Verify or add instance permissions for Session Manager" / "Create a custom IAM instance profile for
# Session Manager": ssm:UpdateInstanceInformation and the four ssmmessages channel actions; the
# ec2messages actions are those the same guide lists for the SSM agent's message delivery (it falls back
# to them when ssmmessages is unavailable, and older agents use them to register).
SESSION_MANAGER_CHANNEL_ACTIONS = (
    "ssmmessages:CreateControlChannel",
    "ssmmessages:CreateDataChannel",
    "ssmmessages:OpenControlChannel",
    "ssmmessages:OpenDataChannel",
)
SSM_AGENT_MESSAGE_ACTIONS = (
    "ec2messages:AcknowledgeMessage",
    "ec2messages:DeleteMessage",
    "ec2messages:FailMessage",
    "ec2messages:GetEndpoint",
    "ec2messages:GetMessages",
    "ec2messages:SendReply",
)
# Describe calls the agent makes that take no resource ARN.
_INSTANCE_DESCRIBE_ACTIONS = (
    "autoscaling:DescribeAutoScalingGroups",
    "autoscaling:DescribeAutoScalingInstances",
    "autoscaling:DescribeScalingActivities",  # the capacity fallback reads why launches failed
    "ec2:DescribeSpotPriceHistory",
    "pricing:GetProducts",  # an on-demand life's price (bootstrap/pricing.py)
)
# Actions that accept no resource ARN: AWS requires `"Resource": "*"` for them. Every use below names one
# of these, and tests/infra/test_policies.py checks that nothing else ever gets `*`. The ssmmessages and
# ec2messages actions have no resource type (Service Authorization Reference); they act for the calling
# instance only.
RESOURCE_STAR_REQUIRED = frozenset(
    {
        "cloudwatch:PutMetricData",  # scoped by the cloudwatch:namespace condition instead
        *_INSTANCE_DESCRIBE_ACTIONS,
        *SESSION_MANAGER_CHANNEL_ACTIONS,
        *SSM_AGENT_MESSAGE_ACTIONS,
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


def _via(region: str, *services: str) -> list[str]:
    """`kms:ViaService` values: the regional endpoints of the services that use the key for the caller."""
    return [f"{service}.{region}.amazonaws.com" for service in services]


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


def submitted_objects(prefixes: Prefixes | None = None) -> list[str]:
    """The keys a submission writes (trainstack/run.py upload): a job's code, its record, its queue entry."""
    jobs = (prefixes or Prefixes()).jobs
    return [f"{JOB_CODE_PREFIX}*", f"{jobs}*/{JOB_RECORD}", f"{QUEUE_PREFIX}*"]


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
    group_arn_pattern: str | list[str],
    prefixes: Prefixes | None = None,
    job_role_arn: str | None = None,
) -> Document:
    """What an instance may do: this bucket's prefixes, this key, this topic, this log group, this stack's
    groups (`group_arn_pattern`: one ARN, or a list of them with trainstack:pools: every pool's instances
    share the role), and (with `job_role_arn`) take the stack's job role to hand its job narrower
    credentials."""
    prefixes = prefixes or Prefixes()
    _, _, region = secret_arn_patterns(log_group_arn)
    # code/: the bundle this config names, and a running job's pinned bundle from an earlier `pulumi up`;
    # job-code/: the code a `trainstack run` job was submitted with (run as the job's user, never as root);
    # datasets/: the named datasets a job may train on (their manifests are under state/).
    read_prefixes = [prefixes.data, prefixes.code, JOB_CODE_PREFIX, DATASETS_PREFIX]
    # jobs/: every job's own objects (an instance may continue another job, or start from one's checkpoint);
    # checkpoints/, results/, state/: the legacy job's, and state/ the stack's current-job pointer.
    write_prefixes = [prefixes.jobs, prefixes.checkpoints, prefixes.results, prefixes.state]
    statements: list[Document] = [
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
            # The job queue (bootstrap/jobbinding.py): the agent lists and reads the entries to take the next
            # job, and writes (once, If-None-Match) the entry of the job its own agent config defines.
            # Nothing on an instance deletes an entry.
            "Sid": "ListTheJobQueue",
            "Effect": "Allow",
            "Action": "s3:ListBucket",
            "Resource": bucket_arn,
            "Condition": {"StringLike": {"s3:prefix": [f"{QUEUE_PREFIX}*"]}},
        },
        {
            "Sid": "ReadAndSubmitQueueEntries",
            "Effect": "Allow",
            "Action": ["s3:GetObject", "s3:PutObject"],
            "Resource": f"{bucket_arn}/{QUEUE_PREFIX}*",
        },
        {
            # Only S3 (SSE-KMS objects) and SNS (the encrypted topic) use the key for the instance; nothing on
            # it calls KMS itself, so no DescribeKey and no direct Decrypt. CloudWatch Logs encrypts with its
            # own service principal (key policy), and secrets are decrypted through SSM or Secrets Manager
            # by the statements below.
            "Sid": "UseStackKeyThroughS3AndSns",
            "Effect": "Allow",
            "Action": ["kms:Decrypt", "kms:GenerateDataKey"],
            "Resource": key_arn,
            "Condition": {"StringEquals": {"kms:ViaService": _via(region, "s3", "sns")}},
        },
        *secret_read_statements(key_arn=key_arn, log_group_arn=log_group_arn),
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
                # A pool running several jobs at once: an instance serving a job is protected from scale-in.
                "autoscaling:SetInstanceProtection",
                "autoscaling:TerminateInstanceInAutoScalingGroup",
            ],
            "Resource": group_arn_pattern,
        },
        {
            "Sid": "DescribeGroupsAndSpotPrices",
            "Effect": "Allow",
            "Action": sorted(_INSTANCE_DESCRIBE_ACTIONS),
            "Resource": "*",
        },
    ]
    if job_role_arn:
        # The agent assumes the job role with a session policy naming its own job (bootstrap/jobuser.py):
        # the job never sees these instance credentials (IMDS is firewalled from its user).
        statements.append(
            {
                "Sid": "AssumeTheJobRole",
                "Effect": "Allow",
                "Action": "sts:AssumeRole",
                "Resource": job_role_arn,
            }
        )
    return _doc(*statements)


def session_manager_policy(*, partition: str, region: str, account_id: str) -> Document:
    """Session Manager and the SSM agent, nothing more: replaces the AWS managed AmazonSSMManagedInstanceCore,
    whose ssm:GetParameter(s), GetDocument, ListAssociations... on `*` let any process on the instance read
    every SSM parameter in the region. No session logging to S3 or CloudWatch and no session KMS encryption
    are configured, so neither s3:GetEncryptionConfiguration nor kms:Decrypt is needed (Systems Manager User
    Guide, "Create a custom IAM instance profile for Session Manager")."""
    return _doc(
        {
            # The one SSM action with a resource type: this account's instances in this region.
            "Sid": "RegisterWithSystemsManager",
            "Effect": "Allow",
            "Action": "ssm:UpdateInstanceInformation",
            "Resource": f"arn:{partition}:ec2:{region}:{account_id}:instance/*",
        },
        {
            "Sid": "SessionManagerChannels",
            "Effect": "Allow",
            "Action": list(SESSION_MANAGER_CHANNEL_ACTIONS),
            "Resource": "*",
        },
        {
            "Sid": "SsmAgentMessages",
            "Effect": "Allow",
            "Action": list(SSM_AGENT_MESSAGE_ACTIONS),
            "Resource": "*",
        },
    )


# What a job's credentials may never write, whatever its session policy says: the stack's state (the
# current-job pointer, the data manifest, the legacy ledger) and every job's state (ledger, cost, crash
# counter, lease, standby) and record. The agent writes them with the instance role only.
JOB_DENIED_WRITE_ACTIONS = ["s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"]
JOB_LOG_STREAM_SOURCE = "job"


def job_role_arn(*, partition: str, account_id: str, name: str) -> str:
    """The stack's job role: its name is fixed by the stack, so the ARN is known before the role exists."""
    return f"arn:{partition}:iam::{account_id}:role/{name}-job"


def job_role_trust_policy(*, partition: str, account_id: str, instance_role_arn: str) -> Document:
    """Only the stack's instance role may take the job role.

    The account is the principal and the instance role a condition (as in the key policy) rather than the
    role's ARN as principal: IAM pins a role principal to the role's unique id, so a replaced instance role
    would silently lose the trust; `aws:PrincipalArn` keeps matching by name.
    """
    return _doc(
        {
            "Sid": "TheStacksInstancesTakeTheJobRole",
            "Effect": "Allow",
            "Principal": {"AWS": f"arn:{partition}:iam::{account_id}:root"},
            "Action": "sts:AssumeRole",
            "Condition": {"ArnEquals": {"aws:PrincipalArn": instance_role_arn}},
        }
    )


def job_role_policy(
    *, bucket_arn: str, key_arn: str, region: str, log_group_arn: str, prefixes: Prefixes | None = None
) -> Document:
    """The most any job of this stack may do; the agent narrows it to one job with a session policy
    (bootstrap/jobuser.py job_session_policy): `jobs/<job-id>/` read-write, its dataset read, its log stream.

    Here every job's prefix is allowed (the role is per stack, the job id per `pulumi up`), and the state
    every job's agent keeps is denied explicitly, so no session policy can ever widen a job into it.
    """
    prefixes = prefixes or Prefixes()
    jobs, data, state = prefixes.jobs, prefixes.data, prefixes.state
    # The default dataset and the named ones (`trainstack data push --name`); the session narrows to one.
    datasets = DATASETS_PREFIX
    return _doc(
        {
            "Sid": "ListJobsAndData",
            "Effect": "Allow",
            "Action": "s3:ListBucket",
            "Resource": bucket_arn,
            "Condition": {"StringLike": {"s3:prefix": [f"{jobs}*", f"{data}*", f"{datasets}*"]}},
        },
        {
            "Sid": "ReadData",
            "Effect": "Allow",
            "Action": "s3:GetObject",
            "Resource": [f"{bucket_arn}/{data}*", f"{bucket_arn}/{datasets}*"],
        },
        {
            "Sid": "ReadWriteJobs",
            "Effect": "Allow",
            "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"],
            "Resource": f"{bucket_arn}/{jobs}*",
        },
        {
            "Sid": "NeverTheAgentsState",
            "Effect": "Deny",
            "Action": JOB_DENIED_WRITE_ACTIONS,
            "Resource": [
                f"{bucket_arn}/{state}*",
                f"{bucket_arn}/{jobs}*/state/*",
                f"{bucket_arn}/{jobs}*/job.json",
                # The checkpoint pointer carries the lease's fencing token: a job that could write it could
                # fake losing its own lease (the session policy denies it too, per job).
                f"{bucket_arn}/{jobs}*/checkpoints/latest.json",
            ],
        },
        {
            # Objects are SSE-KMS with the stack's key; only through S3, never a direct KMS call.
            "Sid": "UseStackKeyThroughS3",
            "Effect": "Allow",
            "Action": ["kms:Decrypt", "kms:GenerateDataKey"],
            "Resource": key_arn,
            "Condition": {"StringEquals": {"kms:ViaService": f"s3.{region}.amazonaws.com"}},
        },
        {
            # Its own stream, `<job-id>/<instance-id>/job`: never the agent's `agent` or `trainer` streams.
            "Sid": "WriteOwnLogStream",
            "Effect": "Allow",
            "Action": ["logs:CreateLogStream", "logs:PutLogEvents"],
            "Resource": f"{log_group_arn}:log-stream:*/{JOB_LOG_STREAM_SOURCE}",
        },
    )


def secret_arn_patterns(log_group_arn: str) -> tuple[str, str, str]:
    """The stack's own secrets path as ARN patterns: (SSM parameters `/trainstack/<stack>/*`, Secrets Manager
    secrets `trainstack/<stack>/*`, the region), read off the stack's log group `/trainstack/<stack>`
    (infra/config.py log_group_name): its ARN carries the partition, region, account and stack, so every
    caller of instance_policy gets the path without a new argument. The agent and the CLI build the same
    path from the stack's name (bootstrap/secrets.py; tests/infra/test_secrets_iam.py pins that they
    agree)."""
    head, _, group = log_group_arn.partition(":log-group:")
    _, partition, _, region, account = head.split(":")
    stack = group.split(":")[0].rstrip("/").rsplit("/", 1)[-1]
    return (
        f"arn:{partition}:ssm:{region}:{account}:parameter/{SECRETS_ROOT}/{stack}/*",
        f"arn:{partition}:secretsmanager:{region}:{account}:secret:{SECRETS_ROOT}/{stack}/*",
        region,
    )


def secret_read_statements(*, key_arn: str, log_group_arn: str) -> list[Document]:
    """The job's `secrets:` (bootstrap/secrets.py): read this stack's path only, and decrypt with the stack's
    key only through SSM or Secrets Manager, for a value under that path (the encryption context each service
    sends names the parameter or secret). Never `ssm:GetParameter*` or `secretsmanager:*` on `*`."""
    parameters, secrets, region = secret_arn_patterns(log_group_arn)
    return [
        {
            "Sid": "ReadOwnSecretParameters",
            "Effect": "Allow",
            "Action": ["ssm:GetParameter", "ssm:GetParameters"],
            "Resource": parameters,
        },
        {
            "Sid": "ReadOwnSecrets",
            "Effect": "Allow",
            "Action": "secretsmanager:GetSecretValue",
            "Resource": secrets,
        },
        {
            "Sid": "DecryptOwnParametersThroughSsm",
            "Effect": "Allow",
            "Action": "kms:Decrypt",
            "Resource": key_arn,
            "Condition": {
                "StringEquals": {"kms:ViaService": f"ssm.{region}.amazonaws.com"},
                "StringLike": {"kms:EncryptionContext:PARAMETER_ARN": parameters},
            },
        },
        {
            "Sid": "DecryptOwnSecretsThroughSecretsManager",
            "Effect": "Allow",
            "Action": "kms:Decrypt",
            "Resource": key_arn,
            "Condition": {
                "StringEquals": {"kms:ViaService": f"secretsmanager.{region}.amazonaws.com"},
                "StringLike": {"kms:EncryptionContext:SecretARN": secrets},
            },
        },
    ]


def dev_role_arn(*, partition: str, account_id: str, name: str) -> str:
    """The dev box's role: named by the stack, so the bucket policy can name it before it exists."""
    return f"arn:{partition}:iam::{account_id}:role/{name}-dev"


def dev_role_policy(
    *,
    bucket_arn: str,
    key_arn: str,
    topic_arn: str,
    region: str,
    log_group_arn: str,
    group_arn_pattern: str,
    prefixes: Prefixes | None = None,
) -> Document:
    """What the dev box may do (infra/devbox.py): read the datasets and the code, read/write its `dev/`
    folder, e-mail the stack's topic when it stops itself, and submit and follow jobs as `trainstack run
    --outputs /etc/trainstack/stack-outputs.json` does on the box (its job code, record and queue entry,
    created only, never overwritten: the bucket policy's create_only_statements; read the jobs' records,
    state, checkpoint pointer and metrics summary, and their logs; wake a group at zero). Never the
    environment's code (`code/`: the agent runs it as root), a job's checkpoints or result files, any EC2
    action (the box stops its own bill with `shutdown`), nor the job role."""
    prefixes = prefixes or Prefixes()
    data, code, jobs, state = prefixes.data, prefixes.code, prefixes.jobs, prefixes.state
    listable = [data, DATASETS_PREFIX, code, JOB_CODE_PREFIX, jobs, QUEUE_PREFIX, state, DEV_PREFIX]
    readable = [
        f"{p}*" for p in (data, DATASETS_PREFIX, code, JOB_CODE_PREFIX, QUEUE_PREFIX, state, DEV_PREFIX)
    ]
    # Of a job's own objects: what `trainstack jobs/status/follow` shows, never its weights or result files.
    readable += [
        f"{jobs}*/{JOB_RECORD}",
        f"{jobs}*/state/*",
        f"{jobs}*/checkpoints/latest.json",
        f"{jobs}*/results/metrics.json",
    ]
    return _doc(
        {
            "Sid": "ListDataCodeJobsAndDev",
            "Effect": "Allow",
            "Action": "s3:ListBucket",
            "Resource": bucket_arn,
            "Condition": {"StringLike": {"s3:prefix": [f"{p}*" for p in listable]}},
        },
        {
            "Sid": "LocateBucket",
            "Effect": "Allow",
            "Action": "s3:GetBucketLocation",
            "Resource": bucket_arn,
        },
        {
            "Sid": "ReadDataCodeAndJobs",
            "Effect": "Allow",
            "Action": "s3:GetObject",
            "Resource": [f"{bucket_arn}/{p}" for p in readable],
        },
        {
            "Sid": "OwnDevFolder",
            "Effect": "Allow",
            "Action": ["s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"],
            "Resource": f"{bucket_arn}/{DEV_PREFIX}*",
        },
        {
            # trainstack/run.py upload: the job's code, its record, then its queue entry (If-None-Match).
            "Sid": "SubmitJobs",
            "Effect": "Allow",
            "Action": "s3:PutObject",
            "Resource": [f"{bucket_arn}/{p}" for p in submitted_objects(prefixes)],
        },
        {
            # Objects are SSE-KMS and the topic is encrypted with the stack's key: only through S3 and SNS.
            "Sid": "UseStackKeyThroughS3AndSns",
            "Effect": "Allow",
            "Action": ["kms:Decrypt", "kms:GenerateDataKey"],
            "Resource": key_arn,
            "Condition": {"StringEquals": {"kms:ViaService": _via(region, "s3", "sns")}},
        },
        {
            "Sid": "EmailWhenStoppingIdle",
            "Effect": "Allow",
            "Action": "sns:Publish",
            "Resource": topic_arn,
        },
        {
            "Sid": "FollowJobLogs",
            "Effect": "Allow",
            "Action": ["logs:FilterLogEvents", "logs:GetLogEvents", "logs:DescribeLogStreams"],
            "Resource": [log_group_arn, f"{log_group_arn}:log-stream:*"],
        },
        {
            # A job submitted to a group at zero wakes it (trainstack/run.py wake_group): desired capacity
            # only; naming a launch template would also need ec2:RunInstances and iam:PassRole, not granted.
            "Sid": "WakeTheJobGroup",
            "Effect": "Allow",
            "Action": "autoscaling:UpdateAutoScalingGroup",
            "Resource": group_arn_pattern,
        },
        {
            # The group's size, and why its launches fail (`trainstack jobs`: "no instance for 12 min").
            # Describe calls name no resource: "*" is the only resource AWS accepts.
            "Sid": "ReadTheJobGroup",
            "Effect": "Allow",
            "Action": ["autoscaling:DescribeAutoScalingGroups", "autoscaling:DescribeScalingActivities"],
            "Resource": "*",
        },
        {
            # `python3 -m bootstrap.gpumetrics` on the box: `trainstack top --dev`'s numbers. PutMetricData
            # takes no resource ARN; the namespace condition keeps it to trainstack's metrics.
            "Sid": "PublishHostMetrics",
            "Effect": "Allow",
            "Action": "cloudwatch:PutMetricData",
            "Resource": "*",
            "Condition": {"StringEquals": {"cloudwatch:namespace": METRIC_NAMESPACE}},
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


@dataclass(frozen=True)
class CostCapAccess:
    """What the capacity function reads and tells for the cost cap: the stack's bucket, key and topic."""

    bucket_arn: str
    key_arn: str
    topic_arn: str
    region: str
    prefixes: Prefixes = field(default_factory=Prefixes)
    # The current-job pointer of the function's pool (trainstack_job.jobs.pointer_name).
    pointer: str = CURRENT_JOB


def capacity_fallback_policy(
    *, group_arn: str, log_group_arn: str, cost_cap: CostCapAccess | None = None
) -> Document:
    """The capacity fallback's role: read its group, change that group's purchase option, write its logs.

    No ec2:RunInstances, iam:PassRole or ec2:CreateTags: the function updates the instances distribution
    only and never names the launch template, and AWS checks those three only for a create or update that
    does (EC2 Auto Scaling User Guide, "Control Amazon EC2 launch template usage in Auto Scaling groups";
    infra/capacity_fallback/handler.py, tests/iam).
    """
    statements: list[Document] = [
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
    ]
    if cost_cap is not None:
        statements += _cost_cap_statements(group_arn, cost_cap)
    return _doc(*statements)


def cost_cap_keys(prefixes: Prefixes, pointer: str = CURRENT_JOB) -> tuple[str, str, str]:
    """The keys the cost cap reads (infra/capacity_fallback/handler.py CostCap): its pool's current-job
    pointer (`pointer`: trainstack_job.jobs.pointer_name), any job's ledger, the legacy job's ledger."""
    return (
        f"{prefixes.state}{pointer}",
        f"{prefixes.jobs}*/state/ledger.json",
        f"{prefixes.state}ledger.json",
    )


def _cost_cap_statements(group_arn: str, access: CostCapAccess) -> list[Document]:
    """The cost cap outside the instance: read the current job's ledger, scale the group to zero, say so.

    Reads exactly two keys per job: the stack's pointer and the ledger it names (and the legacy job's ledger),
    and may list exactly those keys, nothing else; nothing is written. The listing is what makes a missing
    ledger (a new job before its first instance) NoSuchKey rather than AccessDenied: S3 tells a caller that
    a key is missing only if it may s3:ListBucket with that key as `s3:prefix` (S3 API reference, GetObject,
    "Permissions"). KMS only through S3 (the ledger is SSE-KMS) and SNS (the topic is encrypted: a publisher
    needs kms:GenerateDataKey and kms:Decrypt on its key).
    """
    bucket = access.bucket_arn
    keys = cost_cap_keys(access.prefixes, access.pointer)
    return [
        {
            "Sid": "ReadTheCurrentJobsLedger",
            "Effect": "Allow",
            "Action": "s3:GetObject",
            "Resource": [f"{bucket}/{key}" for key in keys],
        },
        {
            "Sid": "KnowAMissingLedgerIsMissing",
            "Effect": "Allow",
            "Action": "s3:ListBucket",
            "Resource": bucket,
            "Condition": {"StringLike": {"s3:prefix": list(keys)}},
        },
        {
            "Sid": "UseStackKeyThroughS3AndSns",
            "Effect": "Allow",
            "Action": ["kms:Decrypt", "kms:GenerateDataKey"],
            "Resource": access.key_arn,
            "Condition": {"StringEquals": {"kms:ViaService": _via(access.region, "s3", "sns")}},
        },
        {
            "Sid": "StopTheGroupAtTheCap",
            "Effect": "Allow",
            "Action": "autoscaling:SetDesiredCapacity",
            "Resource": group_arn,
        },
        {
            "Sid": "SayWhy",
            "Effect": "Allow",
            "Action": "sns:Publish",
            "Resource": access.topic_arn,
        },
    ]


def scheduler_reads(prefixes: Prefixes | None = None) -> list[str]:
    """The keys the scheduler reads (infra/scheduler_fn/handler.py): the queue, each pool's lane pointers, and
    of a job its record, ledger and cancel request."""
    prefixes = prefixes or Prefixes()
    jobs = prefixes.jobs
    return [
        f"{QUEUE_PREFIX}*",
        f"{prefixes.state}current-job*.json",
        f"{jobs}*/{JOB_RECORD}",
        f"{jobs}*/state/ledger.json",
        f"{jobs}*/state/cancel.json",
    ]


def scheduler_policy(
    *,
    bucket_arn: str,
    key_arn: str,
    region: str,
    group_arns: Sequence[str],
    log_group_arn: str,
    prefixes: Prefixes | None = None,
) -> Document:
    """The scheduler's role: read the queue and the jobs' state, raise its pools' desired capacities, write
    its logs. Nothing is written to the bucket; no launch template is named (SetDesiredCapacity only: no
    ec2:RunInstances or iam:PassRole is checked for it). The listing (the queue's, and each read key as
    `s3:prefix`) makes a missing ledger NoSuchKey rather than AccessDenied."""
    keys = scheduler_reads(prefixes)
    return _doc(
        {
            "Sid": "ReadTheQueueAndTheJobsState",
            "Effect": "Allow",
            "Action": "s3:GetObject",
            "Resource": [f"{bucket_arn}/{key}" for key in keys],
        },
        {
            "Sid": "ListTheQueueAndKnowAMissingObjectIsMissing",
            "Effect": "Allow",
            "Action": "s3:ListBucket",
            "Resource": bucket_arn,
            "Condition": {"StringLike": {"s3:prefix": keys}},
        },
        {
            "Sid": "DecryptThroughS3",
            "Effect": "Allow",
            "Action": "kms:Decrypt",
            "Resource": key_arn,
            "Condition": {"StringEquals": {"kms:ViaService": _via(region, "s3")}},
        },
        {
            "Sid": "ReadThePools",
            "Effect": "Allow",
            "Action": "autoscaling:DescribeAutoScalingGroups",
            "Resource": "*",
        },
        {
            "Sid": "RaiseThePoolsCapacity",
            "Effect": "Allow",
            "Action": "autoscaling:SetDesiredCapacity",
            "Resource": list(group_arns),
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
