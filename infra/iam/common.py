"""What the stack's policy documents share: their shape, `kms:ViaService` values, ARN patterns, the actions
that take no resource ARN, the keys a submission writes, and service trust policies."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bootstrap.agent_config import Prefixes
from trainstack_job.jobs import JOB_RECORD
from trainstack_job.queue import JOB_CODE_PREFIX, QUEUE_PREFIX

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
INSTANCE_DESCRIBE_ACTIONS = (
    "autoscaling:DescribeAutoScalingGroups",
    "autoscaling:DescribeAutoScalingInstances",
    "autoscaling:DescribeScalingActivities",  # the capacity fallback reads why launches failed
    "ec2:DescribeSpotPriceHistory",
    "pricing:GetProducts",  # an on-demand life's price (bootstrap/pricing.py)
)
# Actions that accept no resource ARN: AWS requires `"Resource": "*"` for them. Every use in infra/iam/ names
# one of these, and tests/infra/test_policies.py checks that nothing else ever gets `*`. The ssmmessages and
# ec2messages actions have no resource type (Service Authorization Reference); they act for the calling
# instance only.
RESOURCE_STAR_REQUIRED = frozenset(
    {
        "cloudwatch:PutMetricData",  # scoped by the cloudwatch:namespace condition instead
        *INSTANCE_DESCRIBE_ACTIONS,
        *SESSION_MANAGER_CHANNEL_ACTIONS,
        *SSM_AGENT_MESSAGE_ACTIONS,
    }
)
METRIC_NAMESPACE = "trainstack"


def doc(*statements: Document) -> Document:
    """A policy document of `statements`."""
    return {"Version": "2012-10-17", "Statement": list(statements)}


def via(region: str, *services: str) -> list[str]:
    """`kms:ViaService` values: the regional endpoints of the services that use the key for the caller."""
    return [f"{service}.{region}.amazonaws.com" for service in services]


def autoscaling_group_arn(*, partition: str, region: str, account_id: str, group_name: str) -> str:
    """The group's ARN with its generated id left open: the name is fixed before the group exists."""
    return (
        f"arn:{partition}:autoscaling:{region}:{account_id}:autoScalingGroup:*:"
        f"autoScalingGroupName/{group_name}"
    )


def submitted_objects(prefixes: Prefixes | None = None) -> list[str]:
    """The keys a submission writes (trainstack/run.py upload): a job's code, its record, its queue entry."""
    jobs = (prefixes or Prefixes()).jobs
    return [f"{JOB_CODE_PREFIX}*", f"{jobs}*/{JOB_RECORD}", f"{QUEUE_PREFIX}*"]


def assume_role_policy(service: str, *, account_id: str | None = None) -> Document:
    """Trust policy letting one AWS service assume a role (optionally only on behalf of this account)."""
    statement: Document = {
        "Effect": "Allow",
        "Principal": {"Service": service},
        "Action": "sts:AssumeRole",
    }
    if account_id:
        statement["Condition"] = {"StringEquals": {"aws:SourceAccount": account_id}}
    return doc(statement)


def actions_of(document: Document) -> Sequence[str]:
    """Every action a document names (for tests and the policy pack)."""
    found: list[str] = []
    for statement in document["Statement"]:
        action = statement.get("Action", [])
        found.extend([action] if isinstance(action, str) else action)
    return found
