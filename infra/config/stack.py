"""The whole stack config: the keys and their defaults, read, validated and typed into one `StackConfig`."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from infra.config.groups import (
    PLACEMENT_STRATEGIES,
    GroupKeys,
    check_efa_types,
    check_group_purchase,
    check_group_size,
    parse_spot_fallback_minutes,
)
from infra.config.jobs import (
    check_default_job_fits,
    check_job_id_format,
    check_resume_from,
    load_training_config,
    load_user_job,
    parse_expected_hours,
)
from infra.config.measured import parse_measured_throughput
from infra.config.network import (
    SUBNET_IDS_EXAMPLE,
    VPC_ID_EXAMPLE,
    check_existing_vpc,
    check_network_isolation,
    check_ssh_cidrs,
    check_vpc_cidr,
)
from infra.config.pools import LEGACY_POOL, Pool, parse_pools, pool_group_name, refuse_single_group_keys
from infra.config.values import (
    AMI_ID,
    DEFAULT_AMI_PARAMETER,
    DEFAULTS,
    EMAIL,
    MEASURED_KEY,
    NAMESPACE,
    POOLS_KEY,
    PRICE,
    STRUCTURED_KEYS,
    Problems,
    StackConfigError,
    boolean,
    check_range,
    integer,
    string,
    string_list,
)
from infra.efa import all_support_efa
from trainstack_job.jobfile import JobSpec

# The stack-wide limit's ceiling: every look for work reads each slot object (one GET each).
MAX_CONCURRENT_JOBS = 256
# CloudWatch Logs accepts only these retention periods.
LOG_RETENTION_DAYS = (1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557,
                      2922, 3288, 3653)  # fmt: skip


@dataclass(frozen=True)
class StackConfig:
    """Everything the program needs from `Pulumi.<stack>.yaml`, validated and typed.

    The single group's fields (instance_types, instance_count, min_nodes, the purchase options,
    spot_fallback_minutes, placement_strategy) describe the stack's default pool: with trainstack:pools they
    are the first pool's. `pools` lists every pool."""

    project: str
    stack: str
    region: str
    instance_types: tuple[str, ...]
    instance_count: int
    spot_allocation_strategy: str
    on_demand_base_capacity: int
    on_demand_percentage_above_base: int
    spot_max_price: str
    ami_parameter: str
    ami_id: str
    root_volume_size_gb: int
    vpc_cidr: str
    private_subnets: bool
    ssh_ingress_cidrs: tuple[str, ...]
    alert_email: str
    monthly_budget_usd: int
    retain_data_on_destroy: bool
    noncurrent_version_days: int
    log_retention_days: int
    training_config: Path
    job: dict[str, Any]
    max_cost_usd: float | None
    max_consecutive_failures: int
    stall_timeout_minutes: int
    # FSBP CloudWatch.16's default: the network record is kept longer than the training logs.
    flow_log_retention_days: int = 365
    spot_fallback_minutes: int = 15
    expected_hours: float | None = None
    # A user's own job (trainstack:job): its validated spec and the folder bundled as its workdir.
    user_job: JobSpec | None = None
    user_job_dir: Path | None = None
    placement_strategy: str = ""
    min_nodes: int = 1
    # A job id (or "legacy") whose newest checkpoint this stack's job starts from; "" = from scratch.
    resume_from: str = ""
    # Declare the AWS FIS experiment template (and its role) that `trainstack drill` starts.
    drill: bool = False
    # Private subnets with no route out of the VPC, AWS APIs through interface endpoints, packages from the
    # stack's bucket (infra/network.py, infra/wheels.py); implies private_subnets, without a NAT gateway.
    network_isolation: bool = False
    # Declare the dev box's launch template and role (infra/devbox.py); no instance runs until `dev up`.
    dev_box: bool = False
    # trainstack:pools as declared (the first is the default pool); empty: the single group's keys define one.
    declared_pools: tuple[Pool, ...] = ()
    # At most this many jobs run at once across every pool (trainstack_job/slots.py); 0 = no stack-wide limit.
    max_concurrent_jobs: int = 0
    # Bring your own network: an existing VPC and private subnets of it ("" and (): the stack makes its own).
    vpc_id: str = ""
    subnet_ids: tuple[str, ...] = ()
    # With vpc_id: add the endpoints the VPC lacks instead of refusing the preview.
    create_vpc_endpoints: bool = False
    # trainstack:measuredThroughput: (instance type, samples/s of one model), which each weighted pool's
    # WeightedCapacity follows for the types it names (infra/fleet.py pool_weights); (): the shipped
    # estimate.
    measured_throughput: tuple[tuple[str, float], ...] = ()

    @property
    def existing_vpc(self) -> bool:
        return bool(self.vpc_id)

    @property
    def name(self) -> str:
        """Prefix for physical names that must be unique in the account and region."""
        return f"{self.project}-{self.stack}"

    @property
    def multi_node(self) -> bool:
        """Several instances train one job: their security group lets them reach each other."""
        return self.instance_count > 1

    @property
    def cluster_placement(self) -> bool:
        return self.placement_strategy == "cluster"

    @property
    def efa(self) -> bool:
        """An EFA on each instance: multi-node, every type takes one, and one subnet (EFA OS-bypass traffic
        stays within a subnet), which cluster placement guarantees."""
        return self.multi_node and self.cluster_placement and all_support_efa(self.instance_types)

    @property
    def pools(self) -> tuple[Pool, ...]:
        """Every pool, the default pool first: trainstack:pools, else the one the single group's keys
        define."""
        if self.declared_pools:
            return self.declared_pools
        return (
            Pool(
                name=LEGACY_POOL,
                group_name=pool_group_name(self.name, LEGACY_POOL),
                instance_types=self.instance_types,
                max_instances=self.instance_count,
                min_nodes=self.min_nodes,
                spot_allocation_strategy=self.spot_allocation_strategy,
                on_demand_base_capacity=self.on_demand_base_capacity,
                on_demand_percentage_above_base=self.on_demand_percentage_above_base,
                spot_max_price=self.spot_max_price,
                spot_fallback_minutes=self.spot_fallback_minutes,
                placement_group=self.cluster_placement,
                default=True,
                measured_throughput=_measured_for(self.instance_types, self.measured_throughput),
            ),
        )

    @property
    def default_pool(self) -> Pool:
        return self.pools[0]

    @property
    def group_name(self) -> str:
        """The default pool's Auto Scaling group, fixed so user-data and the IAM policy know it before it
        exists (`<project>-<stack>-gpu` for the single group)."""
        return self.default_pool.group_name

    @property
    def group_names(self) -> tuple[str, ...]:
        """Every pool's group, the default pool's first."""
        return tuple(pool.group_name for pool in self.pools)

    @property
    def dev_box_name(self) -> str:
        """The dev box's template, role and `trainstack:dev` tag value (trainstack/dev/instances.py)."""
        return f"{self.name}-dev"

    @property
    def log_group_name(self) -> str:
        return f"/{self.project}/{self.stack}"

    @property
    def flow_log_group_name(self) -> str:
        return f"/{self.project}/{self.stack}/vpc-flow-logs"

    @property
    def gpu_families(self) -> tuple[str, ...]:
        return tuple(sorted({t.split(".", 1)[0] for t in self.instance_types}))


def load_stack_config() -> StackConfig:
    """Read the running stack's config (raw strings, as the Pulumi engine passes them) and validate it."""
    import pulumi  # only the program needs the engine; the CLI reads the schema through read_stack_config

    values = {**pulumi.runtime.get_config_env(), **pulumi.runtime.config.CONFIG.get()}
    region = pulumi.Config("aws").get("region") or ""
    return parse_stack_config(
        _own_keys(values), region=region, project=pulumi.get_project(), stack=pulumi.get_stack()
    )


def read_stack_config(
    values: Mapping[str, Any], *, project: str, stack: str, require_region: bool = True
) -> StackConfig:
    """The same schema without Pulumi's engine (the CLI has none): `values` are a stack's config as its
    `Pulumi.<stack>.yaml` or `pulumi config --json` holds them (`aws:region`, `trainstack:instanceCount`...),
    over Pulumi.yaml's defaults; every key is parsed and checked exactly as `pulumi preview` does.

    `require_region=False`: a missing `aws:region` is no problem here (the CLI's `--region` may stand for it);
    `StackConfig.region` is then "".
    """
    region = values.get("aws:region")
    if region is not None and not isinstance(region, str):
        problem = (
            f"aws:region: must be a string, got {region!r} (e.g. `pulumi config set aws:region us-east-1`)"
        )
        raise StackConfigError(f"stack '{stack}' config has 1 problem:\n  - {problem}", [problem])
    return parse_stack_config(
        _own_keys(values), region=region or "", project=project, stack=stack, require_region=require_region
    )


def _own_keys(values: Mapping[str, Any]) -> dict[str, Any]:
    """The `trainstack:` keys without their namespace; a key set to null counts as not set."""
    prefix = f"{NAMESPACE}:"
    return {
        key[len(prefix) :]: value
        for key, value in values.items()
        if key.startswith(prefix) and value is not None
    }


def parse_stack_config(
    raw: Mapping[str, Any], *, region: str, project: str, stack: str, require_region: bool = True
) -> StackConfig:
    """Validate raw values (strings, or already typed); raise one message listing every problem."""
    problems = Problems()
    for key in raw:
        if key not in DEFAULTS and key not in STRUCTURED_KEYS:
            close = difflib.get_close_matches(key, [*DEFAULTS, *STRUCTURED_KEYS], n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(DEFAULTS)}"
            problems.lines.append(
                f"{NAMESPACE}:{key}: unknown key, {hint} "
                f"(remove it with `pulumi config rm {NAMESPACE}:{key}`)"
            )
    if not region and require_region:
        problems.lines.append("aws:region: required (e.g. `pulumi config set aws:region us-east-1`)")

    def value(key: str, parse: Callable[[Any], Any], example: str) -> Any:
        if key not in raw:
            return DEFAULTS[key]
        try:
            return parse(raw[key])
        except (TypeError, ValueError) as exc:
            problems.add(key, str(exc), example)
            return DEFAULTS[key]

    instance_types = tuple(value("instanceTypes", string_list, '\'["g6.xlarge","g5.xlarge"]\''))
    instance_count = value("instanceCount", integer, "1")
    min_nodes = value("minNodes", integer, "1")
    strategy = value("spotAllocationStrategy", string, "price-capacity-optimized")
    on_demand_base = value("onDemandBaseCapacity", integer, "0")
    on_demand_pct = value("onDemandPercentageAboveBase", integer, "0")
    spot_max_price = value("spotMaxPrice", string, "0.50").strip()
    ami_parameter = value("amiParameter", string, DEFAULT_AMI_PARAMETER).strip()
    ami_id = value("amiId", string, "ami-0123456789abcdef0").strip()
    root_gb = value("rootVolumeSizeGb", integer, "150")
    vpc_cidr = value("vpcCidr", string, "10.42.0.0/16").strip()
    private_subnets = value("privateSubnets", boolean, "false")
    ssh_cidrs = tuple(value("sshIngressCidrs", string_list, "'[\"203.0.113.7/32\"]'"))
    alert_email = value("alertEmail", string, "ml-team@example.com").strip()
    budget = value("monthlyBudgetUsd", integer, "100")
    max_concurrent = value("maxConcurrentJobs", integer, "4")
    retain = value("retainDataOnDestroy", boolean, "true")
    noncurrent_days = value("noncurrentVersionDays", integer, "30")
    log_days = value("logRetentionDays", integer, "30")
    flow_log_days = value("flowLogRetentionDays", integer, "365")
    training_config = value("trainingConfig", string, "training/configs/default.yaml").strip()
    job_file = value("job", string, "examples/charlm/job.yaml").strip()
    max_cost_text = value("maxCostUsd", string, "25").strip()
    max_failures = value("maxConsecutiveFailures", integer, "3")
    stall_minutes = value("stallTimeoutMinutes", integer, "30")
    fallback_minutes = parse_spot_fallback_minutes(value("spotFallbackMinutes", integer, "15"), problems)
    expected_hours = parse_expected_hours(value("expectedHours", string, "24").strip(), problems)
    placement_strategy = value("placementStrategy", string, "cluster").strip()
    resume_from = value("resumeFrom", string, "default-1a2b3c4d").strip()
    drill = value("drill", boolean, "true")
    network_isolation = value("networkIsolation", boolean, "true")
    dev_box = value("devBox", boolean, "true")
    vpc_id = value("vpcId", string, VPC_ID_EXAMPLE).strip()
    subnet_ids = tuple(value("subnetIds", string_list, SUBNET_IDS_EXAMPLE))
    create_vpc_endpoints = value("createVpcEndpoints", boolean, "false")
    check_existing_vpc(vpc_id, subnet_ids, create_vpc_endpoints, problems)
    # networkIsolation puts the instances in private subnets (without a NAT gateway), whatever privateSubnets;
    # so does an existing VPC: its subnets must be private (checked at preview), so no public address either.
    private_subnets = bool(private_subnets or network_isolation or vpc_id)

    declared_pools: tuple[Pool, ...] = ()
    # Empty (unset, [] or ""): the single group's keys define the stack's one pool.
    pools_given = POOLS_KEY in raw and not (
        raw[POOLS_KEY] == [] or (isinstance(raw[POOLS_KEY], str) and raw[POOLS_KEY].strip() in ("", "[]"))
    )
    if pools_given:
        single_group = {
            "instanceTypes": list(instance_types),
            "instanceCount": instance_count,
            "minNodes": min_nodes,
            "spotAllocationStrategy": strategy,
            "onDemandBaseCapacity": on_demand_base,
            "onDemandPercentageAboveBase": on_demand_pct,
            "spotMaxPrice": spot_max_price,
            "spotFallbackMinutes": fallback_minutes,
            "placementStrategy": placement_strategy,
        }
        declared_pools = parse_pools(
            raw[POOLS_KEY], problems, stack_name=f"{project}-{stack}", private_subnets=private_subnets
        )
        refuse_single_group_keys(raw, single_group, problems)
    else:
        group = GroupKeys()
        check_group_size(instance_types, instance_count, min_nodes, group, problems)
        if placement_strategy not in PLACEMENT_STRATEGIES:
            problems.add(
                "placementStrategy",
                f"unknown strategy {placement_strategy!r}; use '' (none) or cluster (one AZ, multi-node "
                "jobs)",
                "cluster",
            )
        if isinstance(instance_count, int) and instance_count > 1 and placement_strategy == "cluster":
            check_efa_types(instance_types, private_subnets, problems)
        check_group_purchase(
            instance_count, strategy, on_demand_base, on_demand_pct, spot_max_price, group, problems
        )
    pools_parsed = not pools_given or bool(declared_pools)
    offered = (
        {t for pool in declared_pools for t in pool.instance_types} if pools_given else set(instance_types)
    )
    measured = parse_measured_throughput(raw.get(MEASURED_KEY), problems, offered if pools_parsed else None)
    declared_pools = tuple(
        replace(pool, measured_throughput=_measured_for(pool.instance_types, measured))
        for pool in declared_pools
    )
    if ami_id and not AMI_ID.match(ami_id):
        problems.add("amiId", f"{ami_id!r} is not an AMI id", "ami-0123456789abcdef0")
    if ami_id and ami_parameter != DEFAULT_AMI_PARAMETER:
        problems.add(
            "amiId",
            "both a pinned amiId and a custom amiParameter are set; keep one "
            f"(or `pulumi config rm {NAMESPACE}:amiParameter`)",
            "''",
        )
    if not ami_parameter.startswith("/"):
        problems.add("amiParameter", f"{ami_parameter!r} is not an SSM parameter path", DEFAULT_AMI_PARAMETER)
    check_range(
        problems, "rootVolumeSizeGb", root_gb, 100, 16384, "150",
        "the Deep Learning AMI's image and the job's data and checkpoints need at least 100 GB",
    )  # fmt: skip
    check_vpc_cidr(vpc_cidr, problems)
    check_ssh_cidrs(ssh_cidrs, problems)
    if alert_email and not EMAIL.match(alert_email):
        problems.add("alertEmail", f"{alert_email!r} is not an e-mail address", "ml-team@example.com")
    check_range(
        problems, "maxConcurrentJobs", max_concurrent, 0, MAX_CONCURRENT_JOBS, "4",
        "jobs running at once across every pool; 0 = no limit beyond each pool's maxJobs",
    )  # fmt: skip
    if isinstance(budget, int) and budget <= 0:
        problems.add("monthlyBudgetUsd", f"must be a positive number of USD, got {budget}", "100")
    check_range(problems, "noncurrentVersionDays", noncurrent_days, 1, 3650, "30", "old object versions kept")
    if log_days not in LOG_RETENTION_DAYS:
        problems.add(
            "logRetentionDays",
            f"{log_days!r} is not a CloudWatch Logs retention period "
            f"({', '.join(map(str, LOG_RETENTION_DAYS))})",
            "30",
        )
    if flow_log_days not in LOG_RETENTION_DAYS:
        problems.add(
            "flowLogRetentionDays",
            f"{flow_log_days!r} is not a CloudWatch Logs retention period "
            f"({', '.join(map(str, LOG_RETENTION_DAYS))})",
            "365",
        )
    training_path, job = load_training_config(training_config, problems)
    user_job, user_job_dir = load_user_job(job_file, problems) if job_file else (None, None)
    if pools_given:
        # Until jobs are placed on pools, any pool's agent may take the stack's default job from the queue.
        for index, pool in enumerate(declared_pools):
            check_default_job_fits(
                job, user_job, pool.max_instances, pool.min_nodes, GroupKeys.of_pool(index), problems
            )
    else:
        check_default_job_fits(job, user_job, instance_count, min_nodes, GroupKeys(), problems)
    if network_isolation:
        check_network_isolation(ssh_cidrs, user_job, user_job_dir, problems)
    if resume_from and not problems.lines:
        check_resume_from(resume_from, training_path, job, user_job, user_job_dir, problems)
    elif resume_from:
        check_job_id_format(resume_from, problems)
    max_cost: float | None = None
    if max_cost_text:
        if PRICE.match(max_cost_text) and float(max_cost_text) > 0:
            max_cost = float(max_cost_text)
        else:
            problems.add(
                "maxCostUsd", f"{max_cost_text!r} is not a positive USD amount; empty = no cap", "25"
            )
    check_range(problems, "maxConsecutiveFailures", max_failures, 1, 100, "3", "crash-loop guard")
    check_range(problems, "stallTimeoutMinutes", stall_minutes, 1, 24 * 60, "30", "stall watchdog")

    if problems.lines:
        count = len(problems.lines)
        header = f"stack '{stack}' config has {count} problem{'s' if count > 1 else ''}:"
        raise StackConfigError(
            "\n".join([header, *(f"  - {line}" for line in problems.lines)]), problems.lines
        )
    if declared_pools:
        # The single group's fields describe the default pool (the CLI's doctor, estimate and prices read
        # them).
        first = declared_pools[0]
        instance_types, instance_count, min_nodes = first.instance_types, first.max_instances, first.min_nodes
        strategy, spot_max_price = first.spot_allocation_strategy, first.spot_max_price
        on_demand_base, on_demand_pct = first.on_demand_base_capacity, first.on_demand_percentage_above_base
        fallback_minutes = first.spot_fallback_minutes
        placement_strategy = "cluster" if first.placement_group else ""
    return StackConfig(
        project=project,
        stack=stack,
        region=region,
        instance_types=instance_types,
        instance_count=instance_count,
        spot_allocation_strategy=strategy,
        on_demand_base_capacity=on_demand_base,
        on_demand_percentage_above_base=on_demand_pct,
        spot_max_price=spot_max_price,
        ami_parameter=ami_parameter,
        ami_id=ami_id,
        root_volume_size_gb=root_gb,
        vpc_cidr=vpc_cidr,
        private_subnets=private_subnets,
        ssh_ingress_cidrs=ssh_cidrs,
        alert_email=alert_email,
        monthly_budget_usd=budget,
        retain_data_on_destroy=retain,
        noncurrent_version_days=noncurrent_days,
        log_retention_days=log_days,
        flow_log_retention_days=flow_log_days,
        training_config=training_path,
        job=job,
        max_cost_usd=max_cost,
        max_consecutive_failures=max_failures,
        stall_timeout_minutes=stall_minutes,
        spot_fallback_minutes=fallback_minutes,
        expected_hours=expected_hours,
        user_job=user_job,
        user_job_dir=user_job_dir,
        placement_strategy=placement_strategy,
        min_nodes=min_nodes,
        resume_from=resume_from,
        drill=drill,
        network_isolation=network_isolation,
        dev_box=dev_box,
        declared_pools=declared_pools,
        max_concurrent_jobs=max_concurrent if isinstance(max_concurrent, int) else 0,
        vpc_id=vpc_id,
        subnet_ids=subnet_ids,
        create_vpc_endpoints=create_vpc_endpoints,
        measured_throughput=measured,
    )


def _measured_for(
    instance_types: tuple[str, ...], measured: tuple[tuple[str, float], ...]
) -> tuple[tuple[str, float], ...]:
    """trainstack:measuredThroughput's entries for one pool's types."""
    return tuple((t, speed) for t, speed in measured if t in instance_types)
