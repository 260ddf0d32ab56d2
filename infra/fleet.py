"""Fleet: the agent's code bundle in S3, the launch template (DLAMI, IMDSv2, encrypted root), the spot group.

The launch template carries the agent's bootstrap only, never a job: jobs are submitted to the stack's queue
(infra/defaultjob.py, `trainstack run`), so a new job never rolls a template version."""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import pulumi
import pulumi_aws as aws

from bootstrap.agent_config import AgentConfig
from bootstrap.cloud_init import UserDataError, render_user_data
from infra.baseline import code_bundle_object, encrypted_root, metadata_options, primary_interface
from infra.bundle import CodeBundle
from infra.config import NAMESPACE, Pool, StackConfig, StackConfigError
from infra.efa import EfaTableError, efa_interfaces
from trainstack_job.throughput import pool_capacity_weights

# The agent completes this hook once its last upload is confirmed, so a scale-in never cuts one short.
LIFECYCLE_HOOK_NAME = "trainstack-drain"
LIFECYCLE_HEARTBEAT_SECONDS = 600
# The agent config's job id when it defines no job: the agent takes the queue's head.
NO_JOB = ""


def pool_weights(pool: Pool) -> dict[str, int] | None:
    """Each of the pool's types' WeightedCapacity (trainstack_job/throughput.py: expected throughput relative
    to the slowest type: trainstack:measuredThroughput's samples/s for the types it names, the shipped
    estimate scaled to them for the others, the shipped estimate alone without any), so
    price-capacity-optimized picks by price per unit of training, not per instance; None (no weights, a unit
    is an instance) for a pool that may hold more than one instance per job or more than one job at once.

    Why only there: AWS fulfils a desired capacity in units with whatever mix of types it finds cheapest per
    unit, so 4 units may be one instance of weight 4. A single-instance, single-lane pool only ever asks for 0
    or 1 unit, and its slowest type weighs 1: any one instance fulfils it, so one unit is exactly one instance
    and everything that sets its desired capacity (the scheduler, the agent, `trainstack run`) stays right
    unchanged. A multi-node job or a pool of lanes needs N instances: weights there would let AWS start fewer,
    heavier ones (or, asking N x the heaviest weight, more, lighter ones), so those pools stay unweighted.

    Infrastructure does not change silently from data: the measured figures come from the stack config (a
    reviewed diff, `trainstack weights --apply`), and `pulumi up` logs which weights they set."""
    weights = pool_capacity_weights(
        pool.instance_types, max_instances=pool.max_instances, max_jobs=pool.max_jobs, measured=pool.measured
    )
    if weights is not None:
        pulumi.log.info(weights_note(pool, weights))
    return weights


def weights_note(pool: Pool, weights: Mapping[str, int]) -> str:
    """One line for `pulumi up`: the pool's weights, each said to be measured or estimated."""
    measured = pool.measured
    each = ", ".join(
        f"{t} {weights[t]} ({'measured' if t in measured else 'estimated'})" for t in pool.instance_types
    )
    source = (
        "trainstack:measuredThroughput where measured, the shipped estimate scaled to it elsewhere"
        if measured
        else "the shipped estimate; `trainstack weights` shows what measured lives would set"
    )
    return f"pool {pool.name}: WeightedCapacity {each}; from {source}"


@dataclass(frozen=True)
class MachineImage:
    """The AMI every instance of this deployment boots, resolved once per `pulumi up`."""

    id: str
    root_device_name: str


def resolve_image(config: StackConfig) -> MachineImage:
    """The pinned AMI, else the one the SSM parameter names now.

    Resolved at deploy time rather than with `resolve:ssm:` at each launch: every life of a job (spot
    replacements included) then runs the same driver and PyTorch build, and a new AMI shows up as a
    reviewable change in `pulumi preview` instead of silently mid-job.
    """
    image_id = config.ami_id
    if not image_id:
        try:
            image_id = aws.ssm.get_parameter(name=config.ami_parameter).value
        # Pulumi reports a failed lookup as a plain Exception ("invoke of ... failed: ..."), nothing narrower.
        except Exception as exc:
            raise StackConfigError(
                f"{NAMESPACE}:amiParameter: cannot read SSM parameter {config.ami_parameter} "
                f"in {config.region} "
                f"({str(exc).splitlines()[0][:200]}); check the name with `trainstack doctor` or pin "
                f"{NAMESPACE}:amiId"
            ) from exc
    image = aws.ec2.get_ami(
        filters=[aws.ec2.GetAmiFilterArgs(name="image-id", values=[image_id])], include_deprecated=True
    )
    if image.architecture != "x86_64":
        key = "amiId" if config.ami_id else "amiParameter"
        raise StackConfigError(
            f"{NAMESPACE}:{key}: {image_id} is {image.architecture}; "
            "the GPU types allowed here are x86_64, so pick an x86_64 Deep Learning AMI"
        )
    return MachineImage(id=image_id, root_device_name=image.root_device_name)


@dataclass
class FleetArgs:
    config: StackConfig
    image: MachineImage
    bundle: CodeBundle
    bucket_name: pulumi.Input[str]
    kms_key_arn: pulumi.Input[str]
    topic_arn: pulumi.Input[str]
    log_group_name: str
    instance_profile_arn: pulumi.Input[str]
    security_group_id: pulumi.Input[str]
    subnet_ids: list[pulumi.Output[str]]
    tags: dict[str, str] = field(default_factory=dict)
    # The role the agent narrows to the job's own credentials (infra/identity.py); None = the job gets none.
    job_role_arn: str | None = None
    # Given the agent's bundle object, what the group must wait for: the stack's default job in the queue
    # (infra/defaultjob.py). A first instance that booted before its job was queued would find the queue
    # empty and scale the group to zero, and the job would never run.
    before_group: Callable[[aws.s3.BucketObjectv2], Sequence[pulumi.Resource]] | None = None
    # The pool this fleet is (infra/pools.py); None: the config's default pool.
    pool: Pool | None = None
    # The agent's bundle object when another pool's fleet declared it already (one object per key): this
    # fleet's group waits for it instead of declaring a second.
    bundle_object: aws.s3.BucketObjectv2 | None = None

    @property
    def the_pool(self) -> Pool:
        return self.pool if self.pool is not None else self.config.default_pool


class Fleet(pulumi.ComponentResource):
    """One pool's launch template and its all-spot, multi-type, multi-zone group (and the agent's bundle, for
    the first pool); with user-data rendered for that pool."""

    pool: Pool
    bundle_object: aws.s3.BucketObjectv2
    launch_template: aws.ec2.LaunchTemplate
    placement_group: aws.ec2.PlacementGroup | None
    group: aws.autoscaling.Group

    def __init__(self, name: str, args: FleetArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("trainstack:fleet:Fleet", name, None, opts)
        self._name = name
        self._args = args
        self._child = pulumi.ResourceOptions(parent=self)
        config, pool = args.config, args.the_pool
        self.pool = pool
        bundle_key = args.bundle.key()
        # The agent's own code (no job's): content-addressed, so a change of trainstack's code is a new key,
        # hence new user-data and a new template version; a job's code never is. Retained when a later
        # `pulumi up` replaces it: a job started on this code keeps it, and the built-in trainer's jobs name
        # it in their records (docs/internals.md, "Binding a life to its job"). Declared once, by the first
        # pool's fleet; every pool boots the same bundle.
        self.bundle_object = args.bundle_object or code_bundle_object(
            name,
            bucket=args.bucket_name,
            bundle=args.bundle,
            kms_key_arn=args.kms_key_arn,
            tags=args.tags,
            parent=self,
        )
        user_data = pulumi.Output.all(args.bucket_name, args.topic_arn).apply(
            lambda values: _user_data(
                agent_config(
                    config,
                    bucket=values[0],
                    topic_arn=values[1],
                    log_group=args.log_group_name,
                    bundle=args.bundle,
                    job_role_arn=args.job_role_arn,
                    pool=pool,
                ),
                bundle_key,
                args.bundle.sha256,
            )
        )
        self.launch_template = self._create_launch_template(user_data)
        self.placement_group = self._create_placement_group() if pool.placement_group else None
        waits = list(args.before_group(self.bundle_object)) if args.before_group is not None else []
        if args.bundle_object is not None:
            waits.append(args.bundle_object)
        self.group = self._create_group(waits)
        self.register_outputs(
            {
                "group_name": self.group.name,
                "launch_template_id": self.launch_template.id,
                "bundle_key": self.bundle_object.key,
            }
        )

    def _create_launch_template(self, user_data: pulumi.Input[str]) -> aws.ec2.LaunchTemplate:
        args, config, pool = self._args, self._args.config, self.pool
        instance_tags = {**args.tags, "Name": pool.group_name}
        return aws.ec2.LaunchTemplate(
            f"{self._name}-launch-template",
            name=pool.group_name,
            description=pool.suffixed(f"{config.name}: GPU training instances", ", pool "),
            image_id=args.image.id,
            iam_instance_profile=aws.ec2.LaunchTemplateIamInstanceProfileArgs(arn=args.instance_profile_arn),
            network_interfaces=self._network_interfaces(),
            metadata_options=metadata_options(),
            block_device_mappings=[
                encrypted_root(args.image.root_device_name, config.root_volume_size_gb, args.kms_key_arn)
            ],
            user_data=user_data,
            update_default_version=True,
            tag_specifications=[
                aws.ec2.LaunchTemplateTagSpecificationArgs(resource_type=kind, tags=instance_tags)
                for kind in ("instance", "volume", "network-interface")
            ],
            tags=args.tags,
            opts=self._child,
        )

    def _network_interfaces(self) -> list[aws.ec2.LaunchTemplateNetworkInterfaceArgs]:
        """The primary interface; on a multi-node EFA cluster, one EFA per network card (infra/efa.py)."""
        args, config, pool = self._args, self._args.config, self.pool
        if not pool.efa:
            return [primary_interface(args.security_group_id, private_subnets=config.private_subnets)]
        try:
            interfaces = efa_interfaces(pool.instance_types)
        # Preview refuses these first (infra/config/); here too, never a half-built template.
        except EfaTableError as exc:
            raise StackConfigError(f"{NAMESPACE}:instanceTypes: {exc}") from exc
        several = len(interfaces) > 1
        return [
            aws.ec2.LaunchTemplateNetworkInterfaceArgs(
                device_index=interface.device_index,
                network_card_index=interface.network_card_index,
                interface_type=interface.interface_type,
                security_groups=[args.security_group_id],
                # EC2 refuses AssociatePublicIpAddress with several interfaces (and would assign none): those
                # clusters run in private subnets (preview requires it), the primary's address is private.
                associate_public_ip_address=(
                    None if several else "false" if config.private_subnets else "true"
                )
                if interface.network_card_index == 0
                else None,
                delete_on_termination="true",
            )
            for interface in interfaces
        ]

    def _create_placement_group(self) -> aws.ec2.PlacementGroup:
        return aws.ec2.PlacementGroup(
            f"{self._name}-placement",
            # Close together in one AZ for the job's collectives; such capacity is scarcer, spot included.
            strategy="cluster",
            tags=self._args.tags,
            opts=self._child,
        )

    def _create_group(self, waits: list[pulumi.Resource]) -> aws.autoscaling.Group:
        args, pool = self._args, self.pool
        # A cluster placement group lives in one AZ, so the group gets that AZ's subnet only.
        subnet_ids = args.subnet_ids[:1] if self.placement_group else args.subnet_ids
        weights = pool_weights(pool) or {}
        # A weighted group's sizes count units: room for the same instances as unweighted, each the heaviest.
        heaviest = max(weights.values(), default=1)
        return aws.autoscaling.Group(
            f"{self._name}-group",
            # A fixed name: the user-data and the instance policy must name the group before it exists.
            name=pool.group_name,
            min_size=0,
            # One above the job's count: capacity rebalancing launches the replacement BEFORE it terminates
            # the at-risk instance, and a group at its maximum may hold that launch back (EC2 Auto Scaling
            # user guide, "Capacity Rebalancing behavior"). The extra instance waits as the job's warm
            # standby or leaves (docs/internals.md, "Jobs, the lease and the standby"); desired stays put.
            max_size=pool.max_size * heaviest,
            # The default pool starts with the stack's default job; any other pool at zero until it is given
            # work (nothing places a job on a pool yet: a pool's agent takes the queue's head).
            desired_capacity=pool.max_instances if pool.default else 0,
            vpc_zone_identifiers=subnet_ids,
            placement_group=self.placement_group.name if self.placement_group else None,
            capacity_rebalance=True,
            mixed_instances_policy=aws.autoscaling.GroupMixedInstancesPolicyArgs(
                instances_distribution=aws.autoscaling.GroupMixedInstancesPolicyInstancesDistributionArgs(
                    on_demand_base_capacity=pool.on_demand_base_capacity,
                    on_demand_percentage_above_base_capacity=pool.on_demand_percentage_above_base,
                    spot_allocation_strategy=pool.spot_allocation_strategy,
                    spot_max_price=pool.spot_max_price,
                ),
                launch_template=aws.autoscaling.GroupMixedInstancesPolicyLaunchTemplateArgs(
                    launch_template_specification=aws.autoscaling.GroupMixedInstancesPolicyLaunchTemplateLaunchTemplateSpecificationArgs(
                        launch_template_id=self.launch_template.id,
                        version=self.launch_template.latest_version.apply(str),
                    ),
                    overrides=[
                        aws.autoscaling.GroupMixedInstancesPolicyLaunchTemplateOverrideArgs(
                            instance_type=t,
                            weighted_capacity=str(weights[t]) if weights else None,
                        )
                        for t in pool.instance_types
                    ],
                ),
            ),
            initial_lifecycle_hooks=[
                aws.autoscaling.GroupInitialLifecycleHookArgs(
                    name=LIFECYCLE_HOOK_NAME,
                    lifecycle_transition="autoscaling:EC2_INSTANCE_TERMINATING",
                    heartbeat_timeout=LIFECYCLE_HEARTBEAT_SECONDS,
                    default_result="CONTINUE",
                )
            ],
            health_check_type="EC2",
            health_check_grace_period=300,
            # Spot capacity may take a while; `pulumi up` must not hang or fail waiting for it.
            wait_for_capacity_timeout="0",
            # Destroy must not wait out the drain hook on instances that have nothing left to save.
            force_delete=True,
            enabled_metrics=[
                aws.autoscaling.Metric.GROUP_DESIRED_CAPACITY,
                aws.autoscaling.Metric.GROUP_IN_SERVICE_INSTANCES,
                aws.autoscaling.Metric.GROUP_TOTAL_INSTANCES,
            ],
            metrics_granularity="1Minute",
            tags=[
                aws.autoscaling.GroupTagArgs(key=key, value=value, propagate_at_launch=True)
                for key, value in {**args.tags, "Name": pool.group_name}.items()
            ],
            opts=pulumi.ResourceOptions(
                parent=self,
                depends_on=waits,
                # The instance sets desired capacity to 0 when the job ends; a later `pulumi up` must not
                # start it again. Restart a job with `trainstack` (or by setting desired capacity) instead.
                ignore_changes=["desired_capacity"],
            ),
        )


def _user_data(config: AgentConfig, bundle_key: str, bundle_sha256: str) -> str:
    """The base64 user-data; over EC2's 16 KB is a stack error naming the cause, not a crash."""
    try:
        text = render_user_data(config, bundle_key=bundle_key, bundle_sha256=bundle_sha256)
    except UserDataError as exc:
        raise StackConfigError(f"{NAMESPACE}: launch template user-data: {exc}") from exc
    return base64.b64encode(text.encode()).decode()


def agent_config(
    config: StackConfig,
    *,
    bucket: str,
    topic_arn: str,
    log_group: str,
    bundle: CodeBundle | None = None,
    job_role_arn: str | None = None,
    pool: Pool | None = None,
) -> AgentConfig:
    """The agent's config for one pool of this stack (default: the default pool): the one `bootstrap/`
    definition, filled from the stack's and the pool's (its group, its instances per job, EFA).

    It defines no job (`job_id: ""`, no `job`/`user_job`): the agent takes its jobs from the stack's queue,
    the stack's default job included (infra/defaultjob.py). Without `bundle` the config names no bundle
    (tests, by hand). A pool other than the default carries its name (`pool`), so its instances take only
    its jobs; the default pool's config names none and renders as before pools (docs/internals.md, "Pools").
    """
    pool = pool if pool is not None else config.default_pool
    return AgentConfig(
        region=config.region,
        bucket=bucket,
        group_name=pool.group_name,
        topic_arn=topic_arn,
        log_group=log_group,
        stack=config.stack,
        gpu_required=True,
        stall_minutes=float(config.stall_timeout_minutes),
        max_consecutive_failures=config.max_consecutive_failures,
        max_cost_usd=config.max_cost_usd,
        instance_count=pool.max_instances,
        min_nodes=pool.min_nodes,
        root_volume_gb=config.root_volume_size_gb,
        efa=pool.efa,
        lifecycle_hook=LIFECYCLE_HOOK_NAME,
        job={},
        user_job=None,
        job_id=NO_JOB,
        job_name="",
        resume_from=None,
        bundle_key=bundle.key() if bundle else "",
        bundle_sha256=bundle.sha256 if bundle else "",
        job_role_arn=job_role_arn,
        pool="" if pool.default else pool.name,
        lanes=pool.max_jobs,
        max_concurrent_jobs=config.max_concurrent_jobs,
    )
