"""The identity documents of the roles whose credentials run the stack's code: the instance role's, the job
role's (its trust and its most), the dev box's, and the Session Manager policy the instance and the dev box
share."""

from __future__ import annotations

from bootstrap.agent_config import Prefixes
from bootstrap.devbox.heartbeat import DEV_PREFIX
from infra.iam.common import (
    INSTANCE_DESCRIBE_ACTIONS,
    METRIC_NAMESPACE,
    SESSION_MANAGER_CHANNEL_ACTIONS,
    SSM_AGENT_MESSAGE_ACTIONS,
    Document,
    doc,
    submitted_objects,
    via,
)
from trainstack_job.datasets import DATASETS_PREFIX
from trainstack_job.jobs import JOB_RECORD
from trainstack_job.queue import JOB_CODE_PREFIX, QUEUE_PREFIX
from trainstack_job.secret_refs import SECRETS_ROOT


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
            "Condition": {"StringEquals": {"kms:ViaService": via(region, "s3", "sns")}},
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
            "Action": sorted(INSTANCE_DESCRIBE_ACTIONS),
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
    return doc(*statements)


def session_manager_policy(*, partition: str, region: str, account_id: str) -> Document:
    """Session Manager and the SSM agent, nothing more: replaces the AWS managed AmazonSSMManagedInstanceCore,
    whose ssm:GetParameter(s), GetDocument, ListAssociations... on `*` let any process on the instance read
    every SSM parameter in the region. No session logging to S3 or CloudWatch and no session KMS encryption
    are configured, so neither s3:GetEncryptionConfiguration nor kms:Decrypt is needed (Systems Manager User
    Guide, "Create a custom IAM instance profile for Session Manager")."""
    return doc(
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
    return doc(
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
    return doc(
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
    (infra/config/ log_group_name): its ARN carries the partition, region, account and stack, so every
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
    return doc(
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
            "Condition": {"StringEquals": {"kms:ViaService": via(region, "s3", "sns")}},
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
