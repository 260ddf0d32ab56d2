"""The trainstack Pulumi program: read the stack config, build one component per concern, export outputs."""

import sys
from pathlib import Path

# Pulumi runs this file as a script with infra/ on sys.path; the program imports `infra.*` and `bootstrap.*`.
_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

import pulumi  # noqa: E402
import pulumi_aws as aws  # noqa: E402

from bootstrap.agent_config import Prefixes  # noqa: E402
from infra.bundle import DEV_BOX_PACKAGES, build_bundle  # noqa: E402
from infra.config import load_stack_config  # noqa: E402
from infra.defaultjob import DefaultJob, DefaultJobArgs, submit_stack_job  # noqa: E402
from infra.devbox import DevBox, DevBoxArgs  # noqa: E402
from infra.drill import Drill, DrillArgs  # noqa: E402
from infra.fleet import resolve_image  # noqa: E402
from infra.identity import Identity, IdentityArgs  # noqa: E402
from infra.network import (  # noqa: E402
    Network,
    NetworkArgs,
    existing_network_zones,
    lookup_existing_network,
)
from infra.observability import Observability, ObservabilityArgs  # noqa: E402
from infra.placement import lookup_pool_zones  # noqa: E402
from infra.pools import POOLS_OUTPUT, DeclaredPool, PoolBaseline, declare_pool, pools_output  # noqa: E402
from infra.scheduler import Scheduler, SchedulerArgs  # noqa: E402
from infra.storage import Storage, StorageArgs  # noqa: E402
from infra.vendored_wheels import VendoredWheels  # noqa: E402
from infra.wheels import INSTANCE_LOCK, INSTANCE_WHEELS_DIR, vendored_wheels  # noqa: E402
from trainstack_job.contract import StackOutput  # noqa: E402

config = load_stack_config()
account_id = aws.get_caller_identity().account_id
partition = aws.get_partition().partition
# The stack's subnets cover every pool's zones; each pool's group launches into its own (infra/placement.py).
zones, pool_zones = lookup_pool_zones(config.pools, config.region, declared=bool(config.declared_pools))
# trainstack:vpcId: the given VPC and subnets, checked before anything is declared (refused at preview, one
# line per missing thing); the stack's zones are then the subnets' own.
existing_network = lookup_existing_network(config) if config.existing_vpc else None
if existing_network is not None:
    zones, pool_zones = existing_network_zones(existing_network, pool_zones)
image = resolve_image(config)
# The stack's default job (trainstack:job / trainingConfig): submitted to the queue below, never in user-data.
job = submit_stack_job(config)
# The agent's own code, no job's: a job's code travels in the job's own bundle.
agent_bundle = build_bundle()
prefixes = Prefixes()
tags = {"trainstack:project": config.project, "trainstack:stack": config.stack}

storage = Storage(
    "storage",
    StorageArgs(
        name=config.name,
        partition=partition,
        account_id=account_id,
        region=config.region,
        log_group_prefix=config.log_group_name,
        noncurrent_version_days=config.noncurrent_version_days,
        retain_data_on_destroy=config.retain_data_on_destroy,
        tags=tags,
    ),
)
network = Network(
    "network",
    NetworkArgs(
        name=config.name,
        region=config.region,
        account_id=account_id,
        vpc_cidr=config.vpc_cidr,
        zones=zones,
        private_subnets=config.private_subnets,
        ssh_ingress_cidrs=list(config.ssh_ingress_cidrs),
        kms_key_arn=storage.key.arn,
        flow_log_group_name=config.flow_log_group_name,
        flow_log_retention_days=config.flow_log_retention_days,
        bucket_arn=storage.bucket.arn,
        peer_traffic=any(pool.multi_node for pool in config.pools),
        network_isolation=config.network_isolation,
        tags=tags,
        existing=existing_network,
    ),
)
observability = Observability(
    "observability",
    ObservabilityArgs(
        name=config.name,
        stack=config.stack,
        region=config.region,
        partition=partition,
        account_id=account_id,
        kms_key_arn=storage.key.arn,
        log_group_name=config.log_group_name,
        log_retention_days=config.log_retention_days,
        group_name=config.group_name,
        alert_email=config.alert_email,
        monthly_budget_usd=config.monthly_budget_usd,
        tags=tags,
        pools=config.pools,
    ),
)
identity = Identity(
    "identity",
    IdentityArgs(
        name=config.name,
        partition=partition,
        region=config.region,
        account_id=account_id,
        bucket_arn=storage.bucket.arn,
        kms_key_arn=storage.key.arn,
        topic_arn=observability.topic.arn,
        log_group_arn=observability.log_group.arn,
        group_name=config.group_name,
        tags=tags,
        # Every pool's instances run as this one role: it may scale and drain each pool's group.
        group_names=config.group_names,
    ),
)
# Only with trainstack:devBox on: the dev box's template and role (`trainstack dev up` starts the instance).
dev_box = (
    DevBox(
        "devbox",
        DevBoxArgs(
            config=config,
            image=image,
            # The agent's packages plus the CLI's: `trainstack run` on the box; the job group's stays as is.
            bundle=build_bundle(packages=DEV_BOX_PACKAGES),
            bucket_name=storage.bucket.bucket,
            partition=partition,
            account_id=account_id,
            bucket_arn=storage.bucket.arn,
            kms_key_arn=storage.key.arn,
            topic_arn=observability.topic.arn,
            log_group_arn=observability.log_group.arn,
            security_group_id=network.security_group.id,
            # The box's `trainstack` reads these by default (/etc/trainstack/stack-outputs.json).
            stack_outputs={
                StackOutput.REGION.value: config.region,
                StackOutput.BUCKET_NAME.value: storage.bucket.bucket,
                StackOutput.DATA_PREFIX.value: prefixes.data,
                StackOutput.CODE_PREFIX.value: prefixes.code,
                StackOutput.STATE_PREFIX.value: prefixes.state,
                StackOutput.JOBS_PREFIX.value: prefixes.jobs,
                StackOutput.GROUP_NAME.value: config.group_name,
                StackOutput.INSTANCE_COUNT.value: config.instance_count,
                StackOutput.INSTANCE_TYPES.value: list(config.instance_types),
                POOLS_OUTPUT: pools_output(config.pools),
                StackOutput.LOG_GROUP_NAME.value: config.log_group_name,
                StackOutput.TOPIC_ARN.value: observability.topic.arn,
                StackOutput.KMS_KEY_ARN.value: storage.key.arn,
                StackOutput.DEV_BOX_NAME.value: config.dev_box_name,
            },
            tags=tags,
        ),
    )
    if config.dev_box
    else None
)
# The bucket refuses the instances' roles (the agent's, the job's, the dev box's) outside their S3 endpoint.
storage.attach_bucket_policy(
    instance_endpoint_id=network.s3_endpoint_id,
    instance_principal_arns=[identity.role.arn, identity.job_role.arn]
    + ([dev_box.role.arn] if dev_box is not None else []),
    prefixes=prefixes,
)
if config.network_isolation:
    # No PyPI from inside: the locked boot-time wheels (checked at preview, infra/config/) go to the bucket.
    VendoredWheels(
        "wheels",
        bucket=storage.bucket.bucket,
        wheels=vendored_wheels(INSTANCE_LOCK, INSTANCE_WHEELS_DIR),
        tags=tags,
    )


def submit_default_job(agent_bundle_object: aws.s3.BucketObjectv2) -> list[pulumi.Resource]:
    """The stack's default job in the queue; the group waits for its entry (infra/fleet.py before_group)."""
    default_job = DefaultJob(
        "default-job",
        DefaultJobArgs(
            submission=job,
            bucket_name=storage.bucket.bucket,
            kms_key_arn=storage.key.arn,
            code_prefix=prefixes.code,
            agent_bundle=agent_bundle,
            agent_bundle_object=agent_bundle_object,
            tags=tags,
        ),
    )
    return [default_job.entry_object]


baseline = PoolBaseline(
    config=config,
    image=image,
    bundle=agent_bundle,
    partition=partition,
    account_id=account_id,
    bucket_name=storage.bucket.bucket,
    bucket_arn=storage.bucket.arn,
    kms_key_arn=storage.key.arn,
    topic_arn=observability.topic.arn,
    instance_profile_arn=identity.instance_profile.arn,
    job_role_arn=identity.job_role_arn,
    security_group_id=network.security_group.id,
    subnet_ids=network.subnet_ids,
    zones=zones,
    tags=tags,
)
# One call per pool, the default pool first: it declares the agent's bundle, which every pool boots, and its
# group waits for the stack's default job (the others start at zero).
pools: list[DeclaredPool] = []
for pool in config.pools:
    pools.append(
        declare_pool(
            pool,
            baseline,
            zones=pool_zones[pool.name],
            bundle_object=pools[0].fleet.bundle_object if pools else None,
            before_group=submit_default_job if pool.default else None,
        )
    )
fleet = pools[0].fleet
# One function for every pool: raises a pool's desired capacity to what its waiting jobs need (never lowers).
scheduler = Scheduler(
    "scheduler",
    SchedulerArgs(
        name=config.name,
        stack=config.stack,
        partition=partition,
        region=config.region,
        account_id=account_id,
        pools=config.pools,
        bucket_name=storage.bucket.bucket,
        bucket_arn=storage.bucket.arn,
        kms_key_arn=storage.key.arn,
        log_group_name=f"{config.log_group_name}/scheduler",
        log_retention_days=config.log_retention_days,
        max_concurrent_jobs=config.max_concurrent_jobs,
        depends_on=[p.fleet.group for p in pools],
        tags=tags,
    ),
)
drill = (
    Drill(
        "drill",
        DrillArgs(
            name=config.name,
            project=config.project,
            stack=config.stack,
            partition=partition,
            region=config.region,
            account_id=account_id,
            group_name=config.group_name,
            tags=tags,
        ),
    )
    if config.drill
    else None
)

pulumi.export(StackOutput.REGION.value, config.region)
pulumi.export(StackOutput.BUCKET_NAME.value, storage.bucket.bucket)
pulumi.export(StackOutput.DATA_PREFIX.value, prefixes.data)
pulumi.export(StackOutput.CODE_PREFIX.value, prefixes.code)
pulumi.export(StackOutput.CHECKPOINTS_PREFIX.value, prefixes.checkpoints)
pulumi.export(StackOutput.RESULTS_PREFIX.value, prefixes.results)
pulumi.export(StackOutput.STATE_PREFIX.value, prefixes.state)
pulumi.export(StackOutput.JOBS_PREFIX.value, prefixes.jobs)
pulumi.export(StackOutput.JOB_ID.value, job.job_id)
pulumi.export(
    StackOutput.DATA_UPLOAD_COMMAND.value,
    storage.bucket.bucket.apply(lambda bucket: f"aws s3 sync ./dataset s3://{bucket}/{prefixes.data}"),
)
pulumi.export(StackOutput.GROUP_NAME.value, fleet.group.name)
pulumi.export(StackOutput.INSTANCE_COUNT.value, config.instance_count)
pulumi.export(StackOutput.MAX_CONCURRENT_JOBS.value, config.max_concurrent_jobs)
pulumi.export(StackOutput.INSTANCE_TYPES.value, list(config.instance_types))
# Every pool (the single group's is `default`): name -> group_name, instance_types, max_instances, default.
pulumi.export(POOLS_OUTPUT, pools_output(config.pools, {p.pool.name: p.fleet.group.name for p in pools}))
pulumi.export(StackOutput.LOG_GROUP_NAME.value, observability.log_group.name)
pulumi.export(StackOutput.TOPIC_ARN.value, observability.topic.arn)
pulumi.export(StackOutput.KMS_KEY_ARN.value, storage.key.arn)
pulumi.export(
    StackOutput.DASHBOARD_URL.value,
    f"https://{config.region}.console.aws.amazon.com/cloudwatch/home?region={config.region}"
    f"#dashboards:name={observability.dashboard_name}",
)
pulumi.export(
    StackOutput.SSM_SESSION_COMMAND.value,
    f"aws ssm start-session --region {config.region} --target $(aws autoscaling describe-auto-scaling-groups "
    f"--region {config.region} --auto-scaling-group-names {config.group_name} "
    "--query 'AutoScalingGroups[0].Instances[0].InstanceId' --output text)",
)
# Only with trainstack:drill on: `trainstack drill` reads its absence as "not enabled".
if drill is not None:
    pulumi.export(StackOutput.DRILL_TEMPLATE_ID.value, drill.template.id)
# Only with trainstack:devBox on: `trainstack dev` reads their absence as "not enabled".
if dev_box is not None:
    pulumi.export(StackOutput.DEV_TEMPLATE_ID.value, dev_box.launch_template.id)
    pulumi.export(StackOutput.DEV_BOX_NAME.value, config.dev_box_name)
    pulumi.export(StackOutput.DEV_SUBNET_IDS.value, network.subnet_ids)
    pulumi.export(StackOutput.DEV_INSTANCE_PROFILE_ARN.value, dev_box.instance_profile.arn)
    pulumi.export(StackOutput.DEV_TEMPLATE_VERSION.value, dev_box.launch_template.latest_version)
