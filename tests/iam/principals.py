"""The policies the program declares, per principal, for one stack: built by the same functions the Pulumi
program calls (infra/iam/, infra/capacity.py). tests/infra/test_capacity.py runs the program under the
Pulumi mocks and checks that what it attaches to each role is exactly what these return for its ARNs.

The instance role carries two documents: the stack's instance policy and its own Session Manager policy
(no AWS managed policy is attached any more). Not modelled: the Lambda service's own writes to the
function's log group, SCPs and permission boundaries (the program declares none; an account's SCPs are
outside it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from infra.iam import common, machine_roles, resource_policies, service_roles
from tests.iam.evaluate import Caller
from tests.iam.requests import PARTITION, Stack

INSTANCE = "instance-role"  # bootstrap/aws.py's INSTANCE_PRINCIPAL: the agent on a training instance
CAPACITY_FALLBACK = "capacity-fallback"  # the Lambda function's role
CLI = "cli-user"  # the trainstack CLI: the user's own credentials
DEV = "dev-role"  # the dev box's role: its idle watcher (bootstrap/devbox/watcher.py)
SCHEDULER = "scheduler"  # the scheduler function's role (lambdas/scheduler/handler.py)

PRINCIPALS = (INSTANCE, CAPACITY_FALLBACK, CLI, DEV, SCHEDULER)


def group_pattern(stack: Stack) -> str:
    return common.autoscaling_group_arn(
        partition=PARTITION, region=stack.region, account_id=stack.account, group_name=stack.group_name
    )


def pool_group_patterns(stack: Stack) -> list[str]:
    """Every pool's group: the single group's, and any other pool's (`<stack>-gpu-<pool>`), as the instance
    role names each pool's group one by one in the program (infra/iam/machine_roles.py instance_policy)."""
    return [
        group_pattern(stack),
        common.autoscaling_group_arn(
            partition=PARTITION,
            region=stack.region,
            account_id=stack.account,
            group_name=f"{stack.group_name}-*",
        ),
    ]


def instance_policy(stack: Stack) -> dict[str, Any]:
    return machine_roles.instance_policy(
        bucket_arn=stack.bucket_arn,
        key_arn=stack.key_arn,
        topic_arn=stack.topic_arn,
        log_group_arn=stack.log_group_arn,
        group_arn_pattern=group_pattern(stack),
        job_role_arn=stack.job_role_arn,
    )


def dev_role_policy(stack: Stack) -> dict[str, Any]:
    return machine_roles.dev_role_policy(
        bucket_arn=stack.bucket_arn,
        key_arn=stack.key_arn,
        topic_arn=stack.topic_arn,
        region=stack.region,
        log_group_arn=stack.log_group_arn,
        group_arn_pattern=group_pattern(stack),
    )


def session_manager_policy(stack: Stack) -> dict[str, Any]:
    return machine_roles.session_manager_policy(
        partition=PARTITION, region=stack.region, account_id=stack.account
    )


def capacity_fallback_policy(stack: Stack, *, cost_cap: bool = True) -> dict[str, Any]:
    """The function's role; with `cost_cap` (a stack with trainstack:maxCostUsd, the check's model) it also
    reads the current job's ledger, scales the group to zero and publishes through the stack's key."""
    return service_roles.capacity_fallback_policy(
        group_arn=group_pattern(stack),
        log_group_arn=f"{stack.log_group_arn}/capacity-fallback",
        cost_cap=service_roles.CostCapAccess(
            bucket_arn=stack.bucket_arn, key_arn=stack.key_arn, topic_arn=stack.topic_arn, region=stack.region
        )
        if cost_cap
        else None,
    )


def caller(principal: str, stack: Stack) -> Caller:
    role = f"arn:{PARTITION}:iam::{stack.account}:role/{stack.name}"
    if principal == INSTANCE:
        return Caller(
            principal,
            stack.instance_role_arn,
            stack.account,
            [instance_policy(stack), session_manager_policy(stack)],
        )
    if principal == CAPACITY_FALLBACK:
        return Caller(
            principal, f"{role}-capacity-fallback", stack.account, [capacity_fallback_policy(stack)]
        )
    if principal == DEV:
        return Caller(
            principal,
            machine_roles.dev_role_arn(partition=PARTITION, account_id=stack.account, name=stack.name),
            stack.account,
            [dev_role_policy(stack), session_manager_policy(stack)],
        )
    if principal == SCHEDULER:
        document = service_roles.scheduler_policy(
            bucket_arn=stack.bucket_arn,
            key_arn=stack.key_arn,
            region=stack.region,
            group_arns=pool_group_patterns(stack),
            log_group_arn=f"{stack.log_group_arn}/scheduler",
        )
        return Caller(principal, f"{role}-scheduler", stack.account, [document])
    if principal == CLI:
        # The user's own identity policies are not the program's: only the resources' policies can refuse.
        return Caller(
            principal, f"arn:{PARTITION}:iam::{stack.account}:user/trainstack-user", stack.account, None
        )
    raise KeyError(f"unknown principal {principal!r}: known are {', '.join(PRINCIPALS)}")


def resource_policy(resource: str, stack: Stack) -> tuple[Mapping[str, Any] | None, bool]:
    """The policy the resource itself carries (bucket, key), and whether it is a key policy."""
    if resource == stack.bucket_arn or resource.startswith(f"{stack.bucket_arn}/"):
        document = resource_policies.bucket_policy(bucket_arn=stack.bucket_arn, key_arn=stack.key_arn)
        # The stack's roles create submissions only and never write the environment's code (the endpoint
        # Deny is left out: a recorded call has no VPC endpoint to judge).
        roles = [caller(INSTANCE, stack).arn, caller(DEV, stack).arn, stack.job_role_arn]
        document["Statement"].extend(
            resource_policies.create_only_statements(bucket_arn=stack.bucket_arn, role_arns=roles)
        )
        return document, False
    if resource == stack.key_arn:
        logs = f"arn:{PARTITION}:logs:{stack.region}:{stack.account}:log-group:/trainstack/{stack.name}*"
        return (
            resource_policies.key_policy(
                partition=PARTITION, account_id=stack.account, region=stack.region, log_group_arns_like=logs
            ),
            True,
        )
    if resource.startswith(f"arn:{PARTITION}:kms:"):
        return None, True  # another key: its policy is not the program's, so nothing allows it
    return None, False
