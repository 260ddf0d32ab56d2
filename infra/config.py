"""The stack's configuration: one typed, validated `StackConfig`, every problem named by its key."""

from __future__ import annotations

import contextlib
import difflib
import ipaddress
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from infra import wheels as vendored
from infra.bundle import BundleError, job_files
from infra.efa import EfaTableError, all_support_efa, efa_interfaces, unknown_efa_types
from infra.jobdef import define_job
from infra.submission import training_config_problems
from trainstack_job.jobfile import JobSpec, JobSpecError, load_job_spec
from trainstack_job.jobs import LEGACY_JOB_ID, JobIdError, check_job_id
from trainstack_job.text import not_utf8

REPO_ROOT = Path(__file__).resolve().parent.parent
NAMESPACE = "trainstack"

# The Deep Learning AMI (OSS NVIDIA driver, PyTorch, Ubuntu 24.04, x86_64): python at /opt/pytorch/bin/python,
# instance-store NVMe mounted at /opt/dlami/nvme.
DEFAULT_AMI_PARAMETER = (
    "/aws/service/deeplearning/ami/x86_64/oss-nvidia-driver-gpu-pytorch-2.9-ubuntu-24.04/latest/ami-id"
)

# The one place the defaults live; Pulumi.yaml repeats them for the CLI and a test keeps the two equal.
# Nodes one job trains on: the c10d rendezvous and one S3 ledger are sized for tens, not thousands.
MAX_NODES = 64
DEFAULTS: dict[str, Any] = {
    "instanceTypes": ["g6.xlarge", "g5.xlarge", "g6e.xlarge", "g4dn.xlarge"],
    "instanceCount": 1,
    "minNodes": 1,
    "spotAllocationStrategy": "price-capacity-optimized",
    "onDemandBaseCapacity": 0,
    "onDemandPercentageAboveBase": 0,
    "spotMaxPrice": "",
    "amiParameter": DEFAULT_AMI_PARAMETER,
    "amiId": "",
    "rootVolumeSizeGb": 150,
    "vpcCidr": "10.42.0.0/16",
    "privateSubnets": False,
    "sshIngressCidrs": [],
    "alertEmail": "",
    "monthlyBudgetUsd": 100,
    "retainDataOnDestroy": True,
    "noncurrentVersionDays": 30,
    "logRetentionDays": 30,
    "flowLogRetentionDays": 365,
    "trainingConfig": "training/configs/default.yaml",
    "job": "",
    "maxCostUsd": "",
    "maxConsecutiveFailures": 3,
    "stallTimeoutMinutes": 30,
    "spotFallbackMinutes": 15,
    "expectedHours": "",
    "placementStrategy": "",
    "resumeFrom": "",
    "drill": False,
    "networkIsolation": False,
    "devBox": False,
    "maxConcurrentJobs": 0,
}

# trainstack:pools (docs/internals.md, "Pools"): a list of mappings, so no entry of DEFAULTS (Pulumi.yaml's
# typed schema has no type for a list of objects, and Pulumi passes such a value to the program as JSON).
# Unset or empty: today's single-group keys above define the stack's one pool, named LEGACY_POOL.
POOLS_KEY = "pools"
STRUCTURED_KEYS = (POOLS_KEY,)
# The pool the single-group keys define. A declared pool of this name keeps that group's resources and names
# (the Auto Scaling group `<project>-<stack>-gpu`, the Pulumi names `fleet`, `capacity`...), so a stack moving
# its single group into trainstack:pools with the same settings diffs to nothing.
LEGACY_POOL = "default"
# Each pool is an Auto Scaling group, a launch template and (when on) its capacity function, alarm and rules.
MAX_POOLS = 8
# The most jobs one pool runs at once: each is a pointer that every instance of the pool reads for work.
MAX_JOBS_PER_POOL = 64
# The stack-wide limit's ceiling: every look for work reads each slot object (one GET each).
MAX_CONCURRENT_JOBS = 256
# A pool's name is part of AWS names of at most 64 characters (its capacity function's role and rules).
POOL_NAME = re.compile(r"^[a-z](?:[a-z0-9-]{0,14}[a-z0-9])?$")
# A pool's keys with their defaults (None: required). The purchase and placement keys mirror the single
# group's: instanceCount is a pool's maxInstances, placementStrategy "cluster" its placementGroup true.
POOL_DEFAULTS: dict[str, Any] = {
    "name": None,
    "instanceTypes": None,
    "maxInstances": None,
    "minNodes": 1,
    "spotAllocationStrategy": "price-capacity-optimized",
    "onDemandBaseCapacity": 0,
    "onDemandPercentageAboveBase": 0,
    "spotMaxPrice": "",
    "spotFallbackMinutes": 15,
    "placementGroup": False,
    # Jobs the pool runs at once, each on its own instance (with its standby): its lanes.
    "maxJobs": 1,
}
# The single group's keys: with trainstack:pools each pool has its own, and these must stay at their defaults.
SINGLE_GROUP_KEYS = (
    "instanceTypes",
    "instanceCount",
    "minNodes",
    "spotAllocationStrategy",
    "onDemandBaseCapacity",
    "onDemandPercentageAboveBase",
    "spotMaxPrice",
    "spotFallbackMinutes",
    "placementStrategy",
)
POOLS_EXAMPLE = (
    '\'[{"name":"default","instanceTypes":["g6.xlarge","g5.xlarge"],"maxInstances":1},'
    '{"name":"big","instanceTypes":["g6e.12xlarge","g6.12xlarge"],"maxInstances":2}]\''
)

# Instance families with NVIDIA GPUs that the x86_64 Deep Learning AMI boots on.
NVIDIA_FAMILIES: dict[str, str] = {
    "g4dn": "T4",
    "g5": "A10G",
    "g6": "L4",
    "g6e": "L40S",
    "gr6": "L4",
    "g7e": "RTX PRO 6000",
    "p3": "V100",
    "p3dn": "V100",
    "p4d": "A100",
    "p4de": "A100",
    "p5": "H100",
    "p5e": "H200",
    "p5en": "H200",
    "p6-b200": "B200",
    "p6-b300": "B300",
}
# Families a user may reasonably try that this stack cannot run, with the reason they are refused.
REFUSED_FAMILIES: dict[str, str] = {
    "g5g": "Graviton (arm64) with T4G; the x86_64 Deep Learning AMI does not boot on it",
    "p6e-gb200": "Grace (arm64) superchip; the x86_64 Deep Learning AMI does not boot on it",
    "g4ad": "AMD Radeon GPU, not NVIDIA; CUDA does not run on it",
    "g3": "M60 GPU, no longer supported by current NVIDIA drivers",
    "g3s": "M60 GPU, no longer supported by current NVIDIA drivers",
    "p2": "K80 GPU, no longer supported by current NVIDIA drivers",
    "g6f": "fractional L4 GPU, not supported by the Deep Learning AMI's driver",
}
SPOT_ALLOCATION_STRATEGIES = (
    "price-capacity-optimized",
    "capacity-optimized",
    "capacity-optimized-prioritized",
    "lowest-price",
)
# "" = no placement group; "cluster" = a cluster placement group (one AZ) for multi-node jobs.
PLACEMENT_STRATEGIES = ("", "cluster")
# CloudWatch Logs accepts only these retention periods.
LOG_RETENTION_DAYS = (1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557,
                      2922, 3288, 3653)  # fmt: skip

_INSTANCE_TYPE = re.compile(r"^(?P<family>[a-z][a-z0-9-]*?)\.(?P<size>[a-z0-9-]+)$")
_AMI_ID = re.compile(r"^ami-[0-9a-f]{8}([0-9a-f]{9})?$")
_EMAIL = re.compile(r"^[^@\s]+@[^@\s]+\.[A-Za-z]{2,}$")
_PRICE = re.compile(r"^\d+(\.\d+)?$")


if TYPE_CHECKING:
    from pulumi import RunError as _ConfigRunError
else:
    try:
        # Under `pulumi up`/`preview` the engine prints a RunError's message without a stack trace.
        from pulumi import RunError as _ConfigRunError
    except ImportError:  # the ops CLI's base install (boto3, pyyaml, rich) reads the config without Pulumi
        _ConfigRunError = RuntimeError


class StackConfigError(_ConfigRunError):
    """The stack config is invalid; the message lists every bad key, why, and a valid example.

    `problems` holds the same lines one by one (`trainstack:<key>: <why> (e.g. ...)`), for the CLI to print
    each on its own line with the file it read.
    """

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = problems if problems is not None else [message]


def pool_group_name(stack_name: str, pool: str) -> str:
    """A pool's Auto Scaling group (and launch template): fixed, so user-data and IAM name it before it
    exists. The single group's pool keeps the name it always had."""
    return f"{stack_name}-gpu" if pool == LEGACY_POOL else f"{stack_name}-gpu-{pool}"


@dataclass(frozen=True)
class Pool:
    """One Auto Scaling group of the stack (trainstack:pools, or the single group's keys): what it launches
    and how it buys it. Every pool shares the stack's network, bucket, key, roles, topic and log group."""

    name: str
    # `pool_group_name(<project>-<stack>, name)`: the group's and its launch template's name.
    group_name: str
    instance_types: tuple[str, ...]
    # The group's most instances for one job (the single group's instanceCount); the group's MaxSize is one
    # more (infra/fleet.py: capacity rebalancing's replacement).
    max_instances: int
    min_nodes: int = 1
    spot_allocation_strategy: str = "price-capacity-optimized"
    on_demand_base_capacity: int = 0
    on_demand_percentage_above_base: int = 0
    spot_max_price: str = ""
    spot_fallback_minutes: int = 15
    # A cluster placement group (one AZ) for a multi-node job's instances.
    placement_group: bool = False
    # The stack's default pool (the first): it starts with the stack's default job at `pulumi up`, and the
    # outputs the CLI reads today (group_name, instance_count, instance_types) describe it. Every other pool
    # starts at zero.
    default: bool = True
    # Jobs the pool runs at once (its lanes, docs/internals.md "Several jobs at once in one pool"); each
    # single-instance job has its instance and its warm standby. 1 = one job at a time, as before.
    max_jobs: int = 1

    @property
    def max_size(self) -> int:
        """The group's MaxSize: each job's instances plus one (its standby, or capacity rebalancing's
        replacement, launched before the at-risk instance goes), for each job it runs at once."""
        return self.max_jobs * (self.max_instances + 1)

    @property
    def multi_node(self) -> bool:
        return self.max_instances > 1

    @property
    def efa(self) -> bool:
        """An EFA on each instance: multi-node, in a placement group (one subnet), every type takes one."""
        return self.multi_node and self.placement_group and all_support_efa(self.instance_types)

    @property
    def legacy(self) -> bool:
        """The single group's pool: its resources keep the names they had before pools."""
        return self.name == LEGACY_POOL

    def suffixed(self, base: str, separator: str = "-") -> str:
        """`base` for the single group's pool, else `base<separator><pool>`: the pool's names of a kind."""
        return base if self.legacy else f"{base}{separator}{self.name}"


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


class _Problems:
    """Collects every problem so the user fixes them all in one round."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, key: str, why: str, example: str, fix_key: str | None = None) -> None:
        """One line: the key, why, and the `pulumi config set` command that fixes it (`fix_key`, else `key`);
        a key inside a pool (`pools[1].maxInstances`) is set with `--path`."""
        fix_key = fix_key or key
        target = (
            f"--path '{NAMESPACE}:{fix_key}'"
            if "[" in fix_key or "." in fix_key
            else f"{NAMESPACE}:{fix_key}"
        )
        self.lines.append(f"{NAMESPACE}:{key}: {why} (e.g. `pulumi config set {target} {example}`)")


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
    problems = _Problems()
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

    instance_types = tuple(value("instanceTypes", _string_list, '\'["g6.xlarge","g5.xlarge"]\''))
    instance_count = value("instanceCount", _integer, "1")
    min_nodes = value("minNodes", _integer, "1")
    strategy = value("spotAllocationStrategy", _string, "price-capacity-optimized")
    on_demand_base = value("onDemandBaseCapacity", _integer, "0")
    on_demand_pct = value("onDemandPercentageAboveBase", _integer, "0")
    spot_max_price = value("spotMaxPrice", _string, "0.50").strip()
    ami_parameter = value("amiParameter", _string, DEFAULT_AMI_PARAMETER).strip()
    ami_id = value("amiId", _string, "ami-0123456789abcdef0").strip()
    root_gb = value("rootVolumeSizeGb", _integer, "150")
    vpc_cidr = value("vpcCidr", _string, "10.42.0.0/16").strip()
    private_subnets = value("privateSubnets", _boolean, "false")
    ssh_cidrs = tuple(value("sshIngressCidrs", _string_list, "'[\"203.0.113.7/32\"]'"))
    alert_email = value("alertEmail", _string, "ml-team@example.com").strip()
    budget = value("monthlyBudgetUsd", _integer, "100")
    max_concurrent = value("maxConcurrentJobs", _integer, "4")
    retain = value("retainDataOnDestroy", _boolean, "true")
    noncurrent_days = value("noncurrentVersionDays", _integer, "30")
    log_days = value("logRetentionDays", _integer, "30")
    flow_log_days = value("flowLogRetentionDays", _integer, "365")
    training_config = value("trainingConfig", _string, "training/configs/default.yaml").strip()
    job_file = value("job", _string, "examples/charlm/job.yaml").strip()
    max_cost_text = value("maxCostUsd", _string, "25").strip()
    max_failures = value("maxConsecutiveFailures", _integer, "3")
    stall_minutes = value("stallTimeoutMinutes", _integer, "30")
    fallback_minutes = _spot_fallback_minutes(value("spotFallbackMinutes", _integer, "15"), problems)
    expected_hours = _expected_hours(value("expectedHours", _string, "24").strip(), problems)
    placement_strategy = value("placementStrategy", _string, "cluster").strip()
    resume_from = value("resumeFrom", _string, "default-1a2b3c4d").strip()
    drill = value("drill", _boolean, "true")
    network_isolation = value("networkIsolation", _boolean, "true")
    dev_box = value("devBox", _boolean, "true")
    # networkIsolation puts the instances in private subnets (without a NAT gateway), whatever privateSubnets.
    private_subnets = bool(private_subnets or network_isolation)

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
        declared_pools = _parse_pools(
            raw[POOLS_KEY], problems, stack_name=f"{project}-{stack}", private_subnets=private_subnets
        )
        _refuse_single_group_keys(raw, single_group, problems)
    else:
        group = _GroupKeys()
        _check_group_size(instance_types, instance_count, min_nodes, group, problems)
        if placement_strategy not in PLACEMENT_STRATEGIES:
            problems.add(
                "placementStrategy",
                f"unknown strategy {placement_strategy!r}; use '' (none) or cluster (one AZ, multi-node "
                "jobs)",
                "cluster",
            )
        if isinstance(instance_count, int) and instance_count > 1 and placement_strategy == "cluster":
            _check_efa_types(instance_types, private_subnets, problems)
        _check_group_purchase(
            instance_count, strategy, on_demand_base, on_demand_pct, spot_max_price, group, problems
        )
    if ami_id and not _AMI_ID.match(ami_id):
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
    _check_range(
        problems, "rootVolumeSizeGb", root_gb, 100, 16384, "150",
        "the Deep Learning AMI's image and the job's data and checkpoints need at least 100 GB",
    )  # fmt: skip
    _check_vpc_cidr(vpc_cidr, problems)
    _check_ssh_cidrs(ssh_cidrs, problems)
    if alert_email and not _EMAIL.match(alert_email):
        problems.add("alertEmail", f"{alert_email!r} is not an e-mail address", "ml-team@example.com")
    _check_range(
        problems, "maxConcurrentJobs", max_concurrent, 0, MAX_CONCURRENT_JOBS, "4",
        "jobs running at once across every pool; 0 = no limit beyond each pool's maxJobs",
    )  # fmt: skip
    if isinstance(budget, int) and budget <= 0:
        problems.add("monthlyBudgetUsd", f"must be a positive number of USD, got {budget}", "100")
    _check_range(
        problems, "noncurrentVersionDays", noncurrent_days, 1, 3650, "30", "old object versions kept"
    )
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
    training_path, job = _load_training_config(training_config, problems)
    user_job, user_job_dir = _load_user_job(job_file, problems) if job_file else (None, None)
    if pools_given:
        # Until jobs are placed on pools, any pool's agent may take the stack's default job from the queue.
        for index, pool in enumerate(declared_pools):
            _check_default_job_fits(
                job, user_job, pool.max_instances, pool.min_nodes, _GroupKeys.of_pool(index), problems
            )
    else:
        _check_default_job_fits(job, user_job, instance_count, min_nodes, _GroupKeys(), problems)
    if network_isolation:
        _check_network_isolation(ssh_cidrs, user_job, user_job_dir, problems)
    if resume_from and not problems.lines:
        _check_resume_from(resume_from, training_path, job, user_job, user_job_dir, problems)
    elif resume_from:
        _check_job_id_format(resume_from, problems)
    max_cost: float | None = None
    if max_cost_text:
        if _PRICE.match(max_cost_text) and float(max_cost_text) > 0:
            max_cost = float(max_cost_text)
        else:
            problems.add(
                "maxCostUsd", f"{max_cost_text!r} is not a positive USD amount; empty = no cap", "25"
            )
    _check_range(problems, "maxConsecutiveFailures", max_failures, 1, 100, "3", "crash-loop guard")
    _check_range(problems, "stallTimeoutMinutes", stall_minutes, 1, 24 * 60, "30", "stall watchdog")

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
    )


def _check_job_id_format(resume_from: str, problems: _Problems) -> bool:
    if resume_from == LEGACY_JOB_ID:
        return True
    try:
        check_job_id(resume_from, "resumeFrom")
    except JobIdError:
        problems.add(
            "resumeFrom",
            f"{resume_from!r} is not a job id (lowercase letters, digits and dashes, e.g. default-1a2b3c4d, "
            "or legacy for the stack's checkpoints from before jobs); `trainstack jobs` lists them",
            "default-1a2b3c4d",
        )
        return False
    return True


def _check_resume_from(
    resume_from: str,
    training_path: Path,
    job: dict[str, Any],
    user_job: JobSpec | None,
    user_job_dir: Path | None,
    problems: _Problems,
) -> None:
    """A job id (or legacy) other than this job's own: a job cannot start from its own checkpoints."""
    if not _check_job_id_format(resume_from, problems):
        return
    own = define_job(
        trainer_config=job,
        training_config_path=training_path,
        user_job=user_job,
        user_job_dir=user_job_dir,
        resume_from=resume_from,
    )
    if own.job_id == resume_from:
        problems.add(
            "resumeFrom",
            f"{resume_from!r} is this stack's own job; name the earlier job to start from "
            "(`trainstack jobs` lists them), or empty to start from scratch",
            "''",
        )


def _spot_fallback_minutes(minutes: Any, problems: _Problems) -> int:
    """0 = never; otherwise the minutes without a launch, while the group wants one, before on-demand."""
    _check_range(
        problems, "spotFallbackMinutes", minutes, 0, 24 * 60, "15",
        "minutes without a spot launch before launching on-demand; 0 = never",
    )  # fmt: skip
    return int(minutes)


def _expected_hours(text: str, problems: _Problems) -> float | None:
    """The job's expected length for `trainstack estimate`; empty = unknown."""
    if not text:
        return None
    if _PRICE.match(text) and float(text) > 0:
        return float(text)
    problems.add("expectedHours", f"{text!r} is not a positive number of hours; empty = unknown", "24")
    return None


def _string(raw: Any) -> str:
    if not isinstance(raw, str):
        raise ValueError(f"must be a string, got {raw!r}")
    return raw


def _integer(raw: Any) -> int:
    if isinstance(raw, bool):
        raise ValueError(f"must be an integer, got {raw!r}")
    if isinstance(raw, int):
        return raw
    if isinstance(raw, str) and re.fullmatch(r"-?\d+", raw.strip()):
        return int(raw)
    raise ValueError(f"must be an integer, got {raw!r}")


def _boolean(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in ("true", "false"):
        return raw.strip().lower() == "true"
    raise ValueError(f"must be true or false, got {raw!r}")


def _string_list(raw: Any) -> list[str]:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"must be a list of strings (JSON array), got {raw!r}") from exc
    if not isinstance(raw, list) or not all(isinstance(item, str) for item in raw):
        raise ValueError(f"must be a list of strings, got {raw!r}")
    return [item.strip() for item in raw]


@dataclass(frozen=True)
class _GroupKeys:
    """How a group's settings are named in the stack config: the single group's keys, or one pool's."""

    prefix: str = ""
    count: str = "instanceCount"
    pool: bool = False

    @classmethod
    def of_pool(cls, index: int) -> _GroupKeys:
        return cls(prefix=f"{POOLS_KEY}[{index}].", count="maxInstances", pool=True)

    def __call__(self, key: str) -> str:
        """The key as a problem line names it: `minNodes`, or `pools[1].minNodes`."""
        return f"{self.prefix}{key}"


def _check_group_size(
    types: tuple[str, ...], count: Any, min_nodes: Any, keys: _GroupKeys, problems: _Problems
) -> None:
    """The group's GPU types and how many instances one job trains on (the single group's and each pool's)."""
    _check_instance_types(types, problems, keys("instanceTypes"))
    _check_range(
        problems, keys(keys.count), count, 1, MAX_NODES, "1",
        "instances training one job; above 1 they train it together (docs/multi-node.md)",
    )  # fmt: skip
    if isinstance(count, int) and isinstance(min_nodes, int):
        _check_range(
            problems, keys("minNodes"), min_nodes, 1, max(1, count), "1",
            f"nodes the job keeps training with while the others are replaced; at most {keys.count}",
        )  # fmt: skip


def _check_group_purchase(
    count: Any,
    strategy: str,
    on_demand_base: Any,
    on_demand_pct: Any,
    spot_max_price: str,
    keys: _GroupKeys,
    problems: _Problems,
) -> None:
    """How the group buys its instances: spot strategy, on-demand base and share, spot price cap."""
    if strategy not in SPOT_ALLOCATION_STRATEGIES:
        problems.add(
            keys("spotAllocationStrategy"),
            f"unknown strategy {strategy!r}; choose one of {', '.join(SPOT_ALLOCATION_STRATEGIES)}",
            "price-capacity-optimized",
        )
    base_key = keys("onDemandBaseCapacity")
    _check_range(problems, base_key, on_demand_base, 0, 100, "0", "on-demand instances first")
    if isinstance(count, int) and isinstance(on_demand_base, int) and on_demand_base > count:
        problems.add(
            base_key,
            f"{on_demand_base} on-demand instances exceed the group's maximum {keys.count}={count} "
            "(min > max)",
            str(count),
        )
    _check_range(problems, keys("onDemandPercentageAboveBase"), on_demand_pct, 0, 100, "0", "0 = all spot")
    if spot_max_price and not (_PRICE.match(spot_max_price) and float(spot_max_price) > 0):
        problems.add(
            keys("spotMaxPrice"),
            f"{spot_max_price!r} is not a positive USD/hour price; empty = no cap",
            "0.50",
        )


def _check_default_job_fits(
    job: dict[str, Any],
    user_job: JobSpec | None,
    count: Any,
    min_nodes: Any,
    keys: _GroupKeys,
    problems: _Problems,
) -> None:
    """The stack's default job on a group of `count` instances: a user's job on one, the built-in trainer's
    global batch over every node count it can have."""
    if user_job is not None and isinstance(count, int) and count > 1:
        anywhere = (
            "; until jobs are placed on pools, any pool may run the stack's default job" if keys.pool else ""
        )
        problems.add(
            keys(keys.count),
            f"{count} nodes with trainstack:job: a user's job runs on one instance (multi-node runs "
            "the built-in trainer, trainstack:trainingConfig); set 1, or a multi-GPU type for more GPUs "
            f'(e.g. instanceTypes ["g6.12xlarge"], 4 x L4){anywhere}',
            "1",
        )
    elif (
        isinstance(count, int)
        and isinstance(min_nodes, int)
        and 1 < count <= MAX_NODES
        and 1 <= min_nodes <= count
    ):
        # Only for node counts that are themselves valid (already refused otherwise): the check's least
        # common multiple over an absurd count is a number no error line could hold.
        _check_global_batch(job, min_nodes, count, problems, keys)


def _check_global_batch(
    job: dict[str, Any], low: int, high: int, problems: _Problems, keys: _GroupKeys | None = None
) -> None:
    """The global batch is kept when nodes come and go: it must split evenly over every node count the job
    can have (one rank per node at least; the trainer checks the GPUs per node when it starts)."""
    keys = keys or _GroupKeys()
    train = job.get("train") if isinstance(job, dict) else None
    batch = train.get("batch_size") if isinstance(train, dict) else None
    if not isinstance(batch, int) or isinstance(batch, bool):
        return
    uneven = [n for n in range(low, high + 1) if batch % n]
    if uneven:
        multiple = math.lcm(*range(low, high + 1))
        problems.add(
            keys("minNodes"),
            f"train.batch_size {batch} of trainstack:trainingConfig does not split over "
            f"{', '.join(map(str, uneven))} node(s), and the job keeps its global batch whatever the "
            f"number of nodes (minNodes..{keys.count} = {low}..{high}): use a multiple of {multiple}, "
            "or raise minNodes",
            str(high),
        )


def _pool_entries(value: Any, problems: _Problems) -> list[Any]:
    """trainstack:pools as a list: Pulumi hands the program a structured value as JSON text, the CLI's stack
    file as parsed YAML."""
    if isinstance(value, str):
        with contextlib.suppress(json.JSONDecodeError):
            value = json.loads(value) if value.strip() else []
    if not isinstance(value, list):
        problems.add(
            POOLS_KEY,
            f"must be a list of pools (a JSON array of mappings with name, instanceTypes, maxInstances), "
            f"got {_clip(value)}",
            POOLS_EXAMPLE,
        )
        return []
    if len(value) > MAX_POOLS:
        problems.add(
            POOLS_KEY,
            f"{len(value)} pools; a stack holds at most {MAX_POOLS} (each is an Auto Scaling group, a launch "
            "template and its capacity function): merge pools that differ only in their types",
            POOLS_EXAMPLE,
        )
        return []
    return value


def _parse_pools(
    value: Any, problems: _Problems, *, stack_name: str, private_subnets: bool
) -> tuple[Pool, ...]:
    """Each pool validated as the single group is, its lines naming `pools[<index>].<key>`; () when the list
    is empty (the single group's keys then define the stack's pool) or any pool has a problem."""
    entries = _pool_entries(value, problems)
    before = len(problems.lines)
    pools: list[Pool] = []
    names: dict[str, int] = {}
    for index, entry in enumerate(entries):
        pool = _parse_pool(entry, index, problems, stack_name=stack_name, private_subnets=private_subnets)
        if pool is None:
            continue
        if pool.name in names:
            problems.add(
                f"{POOLS_KEY}[{index}].name",
                f"{pool.name!r} is pools[{names[pool.name]}]'s name too; each pool needs a name of its own",
                f"{pool.name}-2",
            )
            continue
        names[pool.name] = index
        pools.append(pool)
    if len(problems.lines) > before:
        return ()
    return tuple(pools)


def _parse_pool(
    entry: Any, index: int, problems: _Problems, *, stack_name: str, private_subnets: bool
) -> Pool | None:
    keys = _GroupKeys.of_pool(index)
    if not isinstance(entry, dict):
        problems.add(
            f"{POOLS_KEY}[{index}]",
            f"must be a mapping with name, instanceTypes and maxInstances, got {_clip(entry)}",
            # Never `gpu`: the name check below refuses it (its group could be another stack's).
            "big",
            fix_key=keys("name"),
        )
        return None
    before = len(problems.lines)
    for key in entry:
        if key not in POOL_DEFAULTS:
            close = difflib.get_close_matches(str(key), POOL_DEFAULTS, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"a pool's keys: {', '.join(POOL_DEFAULTS)}"
            problems.lines.append(
                f"{NAMESPACE}:{keys(str(key))}: unknown key, {hint} "
                f"(remove it with `pulumi config rm --path '{NAMESPACE}:{keys(str(key))}'`)"
            )

    def value(key: str, parse: Callable[[Any], Any], example: str) -> Any:
        if key not in entry or entry[key] is None:
            if POOL_DEFAULTS[key] is None:
                problems.add(keys(key), "is required", example)
            return POOL_DEFAULTS[key]
        try:
            return parse(entry[key])
        except (TypeError, ValueError) as exc:
            problems.add(keys(key), str(exc), example)
            return POOL_DEFAULTS[key]

    name = value("name", _string, "big")
    typed = len(problems.lines)
    types = tuple(value("instanceTypes", _string_list, '\'["g6.xlarge","g5.xlarge"]\'') or ())
    # A missing or mistyped list is its own line already; an empty one is judged below.
    types_given = len(problems.lines) == typed and entry.get("instanceTypes") is not None
    count = value("maxInstances", _integer, "1")
    min_nodes = value("minNodes", _integer, "1")
    strategy = value("spotAllocationStrategy", _string, "price-capacity-optimized").strip()
    on_demand_base = value("onDemandBaseCapacity", _integer, "0")
    on_demand_pct = value("onDemandPercentageAboveBase", _integer, "0")
    spot_max_price = value("spotMaxPrice", _string, "0.50").strip()
    fallback_minutes = value("spotFallbackMinutes", _integer, "15")
    placement_group = value("placementGroup", _boolean, "true")
    max_jobs = value("maxJobs", _integer, "4")
    if isinstance(max_jobs, int):
        _check_range(
            problems, keys("maxJobs"), max_jobs, 1, MAX_JOBS_PER_POOL, "4",
            "jobs the pool runs at once, each on its own instance with its warm standby",
        )  # fmt: skip
        if max_jobs > 1 and isinstance(count, int) and count > 1:
            problems.lines.append(
                f"{NAMESPACE}:{keys('maxJobs')}: several jobs at once run one-instance jobs, and this "
                f"pool's maxInstances is {count}: set maxJobs to 1 for a multi-node pool (`pulumi config "
                f"set --path '{NAMESPACE}:{keys('maxJobs')}' 1`), or add a pool of one-instance jobs"
            )
    if isinstance(name, str):
        name = name.strip()
        _check_pool_name(name, keys, stack_name, problems)
    if types_given:
        _check_group_size(types, count, min_nodes, keys, problems)
    elif isinstance(count, int):
        _check_range(
            problems, keys(keys.count), count, 1, MAX_NODES, "1",
            "instances training one job; above 1 they train it together (docs/multi-node.md)",
        )  # fmt: skip
    if isinstance(count, int) and count > 1 and placement_group and types:
        _check_efa_types(types, private_subnets, problems, keys("instanceTypes"))
    _check_group_purchase(count, strategy, on_demand_base, on_demand_pct, spot_max_price, keys, problems)
    _check_range(
        problems, keys("spotFallbackMinutes"), fallback_minutes, 0, 24 * 60, "15",
        "minutes without a spot launch before launching on-demand; 0 = never",
    )  # fmt: skip
    if len(problems.lines) > before:
        return None
    return Pool(
        name=name,
        group_name=pool_group_name(stack_name, name),
        instance_types=types,
        max_instances=count,
        min_nodes=min_nodes,
        spot_allocation_strategy=strategy,
        on_demand_base_capacity=on_demand_base,
        on_demand_percentage_above_base=on_demand_pct,
        spot_max_price=spot_max_price,
        spot_fallback_minutes=fallback_minutes,
        placement_group=placement_group,
        default=index == 0,
        max_jobs=max_jobs if isinstance(max_jobs, int) else 1,
    )


# The longest AWS name a pool's name goes into (infra/capacity.py: the capacity function's event rule), and
# the limit AWS puts on it (EventBridge rule names, IAM role and Lambda function names: 64 characters).
_LONGEST_POOL_NAME = "{stack}-capacity-{pool}-group-events"
_AWS_NAME_LIMIT = 64


def _check_pool_name(name: str, keys: _GroupKeys, stack_name: str, problems: _Problems) -> None:
    if not POOL_NAME.match(name):
        problems.add(
            keys("name"),
            f"{name!r} is not a pool name: 1 to 16 lowercase letters, digits and dashes, starting with a "
            "letter and not ending with a dash (it becomes part of the group's and its resources' names)",
            "big",
        )
        return
    if "gpu" in name.split("-"):
        # `<stack>-gpu-<pool>` names the group, and the instance role may scale the stack's groups by name:
        # with `gpu` as a word in it the name could be another stack's group (stack `dev`'s pool `gpu` is
        # stack `dev-gpu`'s group, pool `x-gpu-y` stack `dev-gpu-x`'s pool `y`). Without it, never.
        problems.add(
            keys("name"),
            f"{name!r} has the word gpu in it: its group {pool_group_name(stack_name, name)} could be "
            "another stack's group, which this stack's instances could then scale; name the pool without it",
            "-".join(word for word in name.split("-") if word != "gpu") or "main",
        )
        return
    longest = _LONGEST_POOL_NAME.format(stack=stack_name, pool=name)
    if name != LEGACY_POOL and len(longest) > _AWS_NAME_LIMIT:
        room = len(name) - (len(longest) - _AWS_NAME_LIMIT)
        shorter = name[:room].rstrip("-") if room > 0 else ""
        problems.add(
            keys("name"),
            f"{name!r} makes the pool's AWS names too long ({longest!r} is {len(longest)} characters, "
            f"AWS allows {_AWS_NAME_LIMIT}); "
            + (
                f"use a name of at most {room} characters"
                if shorter
                else f"the stack's name leaves no room for a pool's: only the pool named {LEGACY_POOL} "
                "(whose AWS names carry none) fits, or use a shorter stack name"
            ),
            shorter or LEGACY_POOL,
        )


def _refuse_single_group_keys(raw: Mapping[str, Any], parsed: Mapping[str, Any], problems: _Problems) -> None:
    """trainstack:pools replaces the single group's keys: one of them set as well (to anything but its
    default: Pulumi hands the program Pulumi.yaml's defaults as set values) is one line saying which to
    keep."""
    both = [key for key in SINGLE_GROUP_KEYS if key in raw and parsed[key] != DEFAULTS[key]]
    if not both:
        return
    named = ", ".join(f"{NAMESPACE}:{key}" for key in both)
    removals = " && ".join(f"pulumi config rm {NAMESPACE}:{key}" for key in both)
    problems.lines.append(
        f"{NAMESPACE}:{POOLS_KEY}: replaces the single group's keys, and {named} "
        f"{'is' if len(both) == 1 else 'are'} set too; keep one: the pools (set each pool's own "
        f"{'value' if len(both) == 1 else 'values'} in trainstack:pools, then `{removals}`), or the single "
        f"group (`pulumi config rm {NAMESPACE}:{POOLS_KEY}`)"
    )


def _clip(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_range(
    problems: _Problems, key: str, value: Any, low: int, high: int, example: str, why: str
) -> None:
    if isinstance(value, int) and not low <= value <= high:
        problems.add(key, f"must be between {low} and {high}, got {value} ({why})", example)


def _check_instance_types(types: tuple[str, ...], problems: _Problems, key: str = "instanceTypes") -> None:
    example = '\'["g6.xlarge","g5.xlarge","g6e.xlarge","g4dn.xlarge"]\''
    if not types:
        problems.add(key, "is empty; the group needs at least one NVIDIA GPU instance type", example)
        return
    if len(set(types)) != len(types):
        problems.add(key, f"lists a type twice: {', '.join(types)}", example)
    for instance_type in types:
        match = _INSTANCE_TYPE.match(instance_type)
        family = match.group("family") if match else ""
        if not match:
            problems.add(key, f"{instance_type!r} is not an EC2 instance type", example)
        elif family in REFUSED_FAMILIES:
            problems.add(key, f"{instance_type!r} is refused: {REFUSED_FAMILIES[family]}", example)
        elif family not in NVIDIA_FAMILIES:
            problems.add(
                key,
                f"{instance_type!r} has no NVIDIA GPU (or is unknown); use one of the families "
                f"{', '.join(NVIDIA_FAMILIES)}",
                example,
            )


def _check_efa_types(
    types: tuple[str, ...], private_subnets: bool, problems: _Problems, key: str = "instanceTypes"
) -> None:
    """A multi-node cluster gets one EFA per network card (infra/efa.py): every type's cards must be known and
    the same, and several interfaces need private subnets."""
    example = '\'["p5.48xlarge","p5e.48xlarge"]\''
    for unknown in unknown_efa_types(types):
        problems.add(
            key,
            f"{unknown} has no entry in the EFA table (its network cards are unknown); add it to "
            "EFA_TYPES in infra/efa.py (MaximumNetworkCards from `aws ec2 describe-instance-types`) or "
            "choose a listed type",
            example,
        )
    if not all_support_efa(types):
        return
    try:
        interfaces = efa_interfaces(types)
    except EfaTableError as exc:
        problems.add(key, str(exc), example)
        return
    if len(interfaces) > 1 and not private_subnets:
        problems.add(
            "privateSubnets",
            f"{types[0]} gets {len(interfaces)} EFA interfaces (one per network card) and AWS gives no "
            "public address to an instance with several network interfaces, so in a public subnet it could "
            "not reach S3 or the AWS APIs; private subnets reach them through the NAT gateway",
            "true",
        )


def _check_network_isolation(
    ssh_cidrs: tuple[str, ...],
    user_job: JobSpec | None,
    user_job_dir: Path | None,
    problems: _Problems,
) -> None:
    """What cannot work without any route out of the VPC: refused at preview, one line each."""
    if ssh_cidrs:
        problems.add(
            "sshIngressCidrs",
            "no SSH from outside reaches an instance under networkIsolation (the VPC has no internet "
            "gateway); use SSM Session Manager and remove the key",
            "'[]'",
        )
    try:
        vendored.vendored_wheels(vendored.INSTANCE_LOCK, vendored.INSTANCE_WHEELS_DIR)
    except vendored.WheelsError as exc:
        problems.add(
            "networkIsolation",
            f"the instances cannot reach PyPI and {exc}; run `make wheels` (they go to the stack's bucket)",
            "true",
        )
    if user_job is not None and user_job.requirements and user_job_dir is not None:
        requirements = user_job_dir / user_job.requirements
        try:
            vendored.vendored_wheels(requirements, requirements.parent / vendored.JOB_WHEELS_DIR_NAME)
        except vendored.WheelsError as exc:
            problems.add(
                "networkIsolation",
                f"the job's requirements cannot come from PyPI: {exc}; lock them with hashes (pip-compile "
                "--generate-hashes) and vendor them next to it (pip download --require-hashes "
                "--only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d wheels -r "
                f"{user_job.requirements}), or set false",
                "false",
            )


def _check_vpc_cidr(cidr: str, problems: _Problems) -> None:
    try:
        network = ipaddress.ip_network(cidr)
    except ValueError:
        problems.add("vpcCidr", f"{cidr!r} is not an IPv4 network (host bits must be zero)", "10.42.0.0/16")
        return
    if not isinstance(network, ipaddress.IPv4Network) or not 16 <= network.prefixlen <= 24:
        problems.add(
            "vpcCidr", f"{cidr!r} must be an IPv4 network from /16 to /24 (a VPC's limits)", "10.42.0.0/16"
        )
    elif not network.is_private:
        problems.add("vpcCidr", f"{cidr!r} is not a private (RFC 1918) range", "10.42.0.0/16")


# The most address space SSH may be opened to, all sshIngressCidrs together: one IPv4 /8, one IPv6 /32.
# The policy pack's no-unrestricted-ingress judges every security group by the same numbers (SECURITY.md).
MAX_INGRESS_ADDRESSES = {4: 2**24, 6: 2**96}


def _check_ssh_cidrs(cidrs: tuple[str, ...], problems: _Problems) -> None:
    example = "'[\"203.0.113.7/32\"]'"
    networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
    for cidr in cidrs:
        try:
            networks.append(ipaddress.ip_network(cidr))
        except ValueError:
            problems.add("sshIngressCidrs", f"{cidr!r} is not a CIDR (host bits must be zero)", example)
    # Judged by the address space they open together, not by how they are written: ["0.0.0.0/1",
    # "128.0.0.0/1"] is the whole internet, and so is "::0/0".
    unions: dict[int, list[ipaddress.IPv4Network | ipaddress.IPv6Network]] = {
        4: list(ipaddress.collapse_addresses(n for n in networks if isinstance(n, ipaddress.IPv4Network))),
        6: list(ipaddress.collapse_addresses(n for n in networks if isinstance(n, ipaddress.IPv6Network))),
    }
    for (version, union), widest in zip(unions.items(), ("/8", "/32"), strict=True):
        size = sum(network.num_addresses for network in union)
        if size <= MAX_INGRESS_ADDRESSES[version]:
            continue
        written = [str(n) for n in networks if n.version == version]
        subject = ", ".join(repr(cidr) for cidr in written[:3]) + (", ..." if len(written) > 3 else "")
        verb = "opens" if len(written) == 1 else "together open"
        whole = size == 2 ** (32 if version == 4 else 128)
        reach = "the whole internet" if whole else f"more than an IPv{version} {widest}, i.e. the internet"
        problems.add(
            "sshIngressCidrs",
            f"{subject} {verb} SSH to {reach} and is refused; use SSM Session Manager (no open port) "
            "or your own address",
            example,
        )


def _load_training_config(path_text: str, problems: _Problems) -> tuple[Path, dict[str, Any]]:
    path = Path(path_text)
    if not path.is_absolute():
        path = REPO_ROOT / path
    example = "training/configs/default.yaml"
    try:
        job = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        problems.add("trainingConfig", f"cannot read {path} ({exc.strerror})", example)
        return path, {}
    except UnicodeDecodeError as exc:  # a file saved in another encoding, or not text at all
        problems.add(
            "trainingConfig",
            f"{path}: {not_utf8(exc)}",
            example,
        )
        return path, {}
    except yaml.YAMLError as exc:
        problems.add("trainingConfig", f"{path} is not valid YAML ({str(exc).splitlines()[0]})", example)
        return path, {}
    if not isinstance(job, dict):
        problems.add("trainingConfig", f"{path} must hold a YAML mapping (the trainer's config)", example)
        return path, {}
    shown = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path
    # The same checks as `trainstack run --config` (the agent's `secrets:`, no credential-looking value, the
    # trainer's own validator without torch), so a typo fails `pulumi preview`, not a GPU instance.
    problems.lines.extend(training_config_problems(job, f"{NAMESPACE}:trainingConfig: {shown}"))
    return path, job


def _load_user_job(path_text: str, problems: _Problems) -> tuple[JobSpec | None, Path | None]:
    """The job file named by trainstack:job, validated by the agent's own parser (workdir and requirements
    must exist), so a bad job file fails `pulumi preview` naming the key."""
    path = Path(path_text)
    if not path.is_absolute():
        path = REPO_ROOT / path
    try:
        spec = load_job_spec(path)
    except JobSpecError as exc:
        problems.lines.extend(f"{NAMESPACE}:job: {problem}" for problem in exc.problems)
        return None, None
    workdir = (path.parent / spec.workdir).resolve()
    try:
        job_files(workdir)
    except BundleError as exc:
        problems.lines.append(str(exc))
        return None, None
    return spec, workdir
