"""What AWS services do for the stack: the capacity fallback function's role (read its group, switch its
purchase option, and the cost cap outside the instance), the scheduler function's role, and VPC flow logs'."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from bootstrap.agent_config import Prefixes
from infra.iam.common import Document, doc, via
from trainstack_job.jobs import CURRENT_JOB, JOB_RECORD
from trainstack_job.queue import QUEUE_PREFIX
from trainstack_job.slots import SLOTS_FOLDER

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
    lambdas/capacity_fallback/handler.py, tests/iam).
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
    return doc(*statements)


def cost_cap_keys(prefixes: Prefixes, pointer: str = CURRENT_JOB) -> tuple[str, str, str]:
    """The keys the cost cap reads (lambdas/capacity_fallback/handler.py CostCap): its pool's current-job
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
            "Condition": {"StringEquals": {"kms:ViaService": via(access.region, "s3", "sns")}},
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
    """The keys the scheduler reads (lambdas/scheduler/handler.py): the queue, each pool's lane pointers, the
    stack's run slots (maxConcurrentJobs), and of a job its record, ledger and cancel request."""
    prefixes = prefixes or Prefixes()
    jobs = prefixes.jobs
    return [
        f"{QUEUE_PREFIX}*",
        f"{prefixes.state}current-job*.json",
        f"{prefixes.state}{SLOTS_FOLDER}*",
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
    return doc(
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
            "Condition": {"StringEquals": {"kms:ViaService": via(region, "s3")}},
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
    return doc(
        {
            "Sid": "WriteFlowLogs",
            "Effect": "Allow",
            "Action": ["logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"],
            "Resource": [log_group_arn, f"{log_group_arn}:log-stream:*"],
        }
    )
