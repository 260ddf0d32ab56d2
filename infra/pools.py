"""Pools: one call declares one pool's resources (its launch template and Auto Scaling group, and its capacity
function when on) over the baseline every pool shares (network, bucket, key, roles, topic, log group).

The single group's pool (trainstack's keys before pools; infra/config/ LEGACY_POOL) keeps the Pulumi names
and AWS names it always had: `fleet`, `capacity`, `<project>-<stack>-gpu`. Any other pool's carry its name:
`fleet-<pool>`, `capacity-<pool>`, `<project>-<stack>-gpu-<pool>` (docs/internals.md, "Pools")."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_aws as aws

from infra.bundle import CodeBundle
from infra.capacity import CapacityFallback, CapacityFallbackArgs, declared
from infra.config import Pool, StackConfig
from infra.fleet import Fleet, FleetArgs, MachineImage
from trainstack_job.contract import StackOutput
from trainstack_job.jobs import pointer_name

# The stack output naming every pool.
POOLS_OUTPUT = StackOutput.POOLS.value


@dataclass
class PoolBaseline:
    """What every pool shares: the stack's config, image, agent bundle, bucket, key, topic, logs, roles and
    network."""

    config: StackConfig
    image: MachineImage
    bundle: CodeBundle
    partition: str
    account_id: str
    bucket_name: pulumi.Input[str]
    bucket_arn: pulumi.Input[str]
    kms_key_arn: pulumi.Input[str]
    topic_arn: pulumi.Input[str]
    instance_profile_arn: pulumi.Input[str]
    security_group_id: pulumi.Input[str]
    # The stack's subnets and the zone each is in, in the same order.
    subnet_ids: list[pulumi.Output[str]]
    zones: list[str]
    job_role_arn: str | None = None
    tags: dict[str, str] = field(default_factory=dict)


@dataclass
class DeclaredPool:
    pool: Pool
    fleet: Fleet
    # None when neither the spot fallback (the pool's spotFallbackMinutes) nor the cost cap is on.
    capacity: CapacityFallback | None


def declare_pool(
    pool: Pool,
    baseline: PoolBaseline,
    *,
    zones: Sequence[str],
    bundle_object: aws.s3.BucketObjectv2 | None = None,
    before_group: Callable[[aws.s3.BucketObjectv2], Sequence[pulumi.Resource]] | None = None,
) -> DeclaredPool:
    """One pool: its fleet (launch template, group, placement group) in `zones` (the pool's among the
    stack's), and its capacity function. `bundle_object`: the agent's bundle a first pool declared (None:
    this pool declares it); `before_group`: what the group waits for (the default pool: the stack's default
    job)."""
    config = baseline.config
    fleet = Fleet(
        pool.suffixed("fleet"),
        FleetArgs(
            config=config,
            image=baseline.image,
            bundle=baseline.bundle,
            bucket_name=baseline.bucket_name,
            kms_key_arn=baseline.kms_key_arn,
            topic_arn=baseline.topic_arn,
            log_group_name=config.log_group_name,
            instance_profile_arn=baseline.instance_profile_arn,
            job_role_arn=baseline.job_role_arn,
            security_group_id=baseline.security_group_id,
            subnet_ids=[
                subnet
                for subnet, zone in zip(baseline.subnet_ids, baseline.zones, strict=True)
                if zone in zones
            ],
            tags=baseline.tags,
            before_group=before_group,
            pool=pool,
            bundle_object=bundle_object,
        ),
    )
    capacity = None
    # The same function enforces the cost cap from outside the instance: declared when either is on.
    if declared(pool.spot_fallback_minutes, config.max_cost_usd):
        capacity = CapacityFallback(
            pool.suffixed("capacity"),
            CapacityFallbackArgs(
                name=config.name,
                stack=config.stack,
                partition=baseline.partition,
                region=config.region,
                account_id=baseline.account_id,
                group_name=pool.group_name,
                fallback_minutes=pool.spot_fallback_minutes,
                spot_on_demand_percentage=pool.on_demand_percentage_above_base,
                kms_key_arn=baseline.kms_key_arn,
                log_group_name=pool.suffixed(f"{config.log_group_name}/capacity-fallback", "/"),
                log_retention_days=config.log_retention_days,
                depends_on=[fleet.group],
                tags=baseline.tags,
                max_cost_usd=config.max_cost_usd,
                bucket_name=baseline.bucket_name,
                bucket_arn=baseline.bucket_arn,
                topic_arn=baseline.topic_arn,
                pool="" if pool.legacy else pool.name,
                pointer=pointer_name("" if pool.default else pool.name),
            ),
        )
    return DeclaredPool(pool=pool, fleet=fleet, capacity=capacity)


def pools_output(
    pools: Sequence[Pool], group_names: Mapping[str, pulumi.Input[str]] | None = None
) -> dict[str, dict[str, Any]]:
    """The `pools` stack output: pool name -> its group (`group_names`: the groups' own outputs, so the value
    waits for them; else the fixed names), instance types and maximum size; `default` marks the pool the
    stack's default job starts on, which `group_name`, `instance_count` and `instance_types` describe."""
    return {
        pool.name: {
            "group_name": (group_names or {}).get(pool.name, pool.group_name),
            "instance_types": list(pool.instance_types),
            "max_instances": pool.max_instances,
            "default": pool.default,
            "max_jobs": pool.max_jobs,
        }
        for pool in pools
    }
