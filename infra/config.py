"""The stack's configuration: one typed, validated `StackConfig`, every problem named by its key."""

from __future__ import annotations

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

from bootstrap.job import JobSpec, JobSpecError, load_job_spec
from infra import wheels as vendored
from infra.bundle import BundleError, job_files
from infra.efa import EfaTableError, all_support_efa, efa_interfaces, unknown_efa_types
from infra.jobdef import define_job
from infra.submission import training_config_problems
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
}

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


@dataclass(frozen=True)
class StackConfig:
    """Everything the program needs from `Pulumi.<stack>.yaml`, validated and typed."""

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
    def group_name(self) -> str:
        """The Auto Scaling group's name, fixed so user-data and the IAM policy know it before it exists."""
        return f"{self.name}-gpu"

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

    def add(self, key: str, why: str, example: str) -> None:
        self.lines.append(f"{NAMESPACE}:{key}: {why} (e.g. `pulumi config set {NAMESPACE}:{key} {example}`)")


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
        if key not in DEFAULTS:
            close = difflib.get_close_matches(key, DEFAULTS, n=1)
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

    _check_instance_types(instance_types, problems)
    _check_range(
        problems, "instanceCount", instance_count, 1, MAX_NODES, "1",
        "instances training one job; above 1 they train it together (docs/multi-node.md)",
    )  # fmt: skip
    if isinstance(instance_count, int) and isinstance(min_nodes, int):
        _check_range(
            problems, "minNodes", min_nodes, 1, max(1, instance_count), "1",
            "nodes the job keeps training with while the others are replaced; at most instanceCount",
        )  # fmt: skip
    if placement_strategy not in PLACEMENT_STRATEGIES:
        problems.add(
            "placementStrategy",
            f"unknown strategy {placement_strategy!r}; use '' (none) or cluster (one AZ, multi-node jobs)",
            "cluster",
        )
    if isinstance(instance_count, int) and instance_count > 1 and placement_strategy == "cluster":
        _check_efa_types(instance_types, private_subnets, problems)
    if strategy not in SPOT_ALLOCATION_STRATEGIES:
        problems.add(
            "spotAllocationStrategy",
            f"unknown strategy {strategy!r}; choose one of {', '.join(SPOT_ALLOCATION_STRATEGIES)}",
            "price-capacity-optimized",
        )
    _check_range(problems, "onDemandBaseCapacity", on_demand_base, 0, 100, "0", "on-demand instances first")
    if (
        isinstance(instance_count, int)
        and isinstance(on_demand_base, int)
        and on_demand_base > instance_count
    ):
        problems.add(
            "onDemandBaseCapacity",
            f"{on_demand_base} on-demand instances exceed the group's maximum instanceCount={instance_count} "
            "(min > max)",
            str(instance_count),
        )
    _check_range(problems, "onDemandPercentageAboveBase", on_demand_pct, 0, 100, "0", "0 = all spot")
    if spot_max_price and not (_PRICE.match(spot_max_price) and float(spot_max_price) > 0):
        problems.add(
            "spotMaxPrice", f"{spot_max_price!r} is not a positive USD/hour price; empty = no cap", "0.50"
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
    if user_job is not None and isinstance(instance_count, int) and instance_count > 1:
        problems.add(
            "instanceCount",
            f"{instance_count} nodes with trainstack:job: a user's job runs on one instance (multi-node runs "
            "the built-in trainer, trainstack:trainingConfig); set 1, or a multi-GPU type for more GPUs "
            '(e.g. instanceTypes ["g6.12xlarge"], 4 x L4)',
            "1",
        )
    elif (
        isinstance(instance_count, int)
        and isinstance(min_nodes, int)
        and 1 < instance_count <= MAX_NODES
        and 1 <= min_nodes <= instance_count
    ):
        # Only for node counts that are themselves valid (already refused otherwise): the check's least
        # common multiple over an absurd count is a number no error line could hold.
        _check_global_batch(job, min_nodes, instance_count, problems)
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


def _check_global_batch(job: dict[str, Any], low: int, high: int, problems: _Problems) -> None:
    """The global batch is kept when nodes come and go: it must split evenly over every node count the job
    can have (one rank per node at least; the trainer checks the GPUs per node when it starts)."""
    train = job.get("train") if isinstance(job, dict) else None
    batch = train.get("batch_size") if isinstance(train, dict) else None
    if not isinstance(batch, int) or isinstance(batch, bool):
        return
    uneven = [n for n in range(low, high + 1) if batch % n]
    if uneven:
        multiple = math.lcm(*range(low, high + 1))
        problems.add(
            "minNodes",
            f"train.batch_size {batch} of trainstack:trainingConfig does not split over "
            f"{', '.join(map(str, uneven))} node(s), and the job keeps its global batch whatever the "
            f"number of nodes (minNodes..instanceCount = {low}..{high}): use a multiple of {multiple}, "
            "or raise minNodes",
            str(high),
        )


def _check_range(
    problems: _Problems, key: str, value: Any, low: int, high: int, example: str, why: str
) -> None:
    if isinstance(value, int) and not low <= value <= high:
        problems.add(key, f"must be between {low} and {high}, got {value} ({why})", example)


def _check_instance_types(types: tuple[str, ...], problems: _Problems) -> None:
    example = '\'["g6.xlarge","g5.xlarge","g6e.xlarge","g4dn.xlarge"]\''
    if not types:
        problems.add(
            "instanceTypes", "is empty; the group needs at least one NVIDIA GPU instance type", example
        )
        return
    if len(set(types)) != len(types):
        problems.add("instanceTypes", f"lists a type twice: {', '.join(types)}", example)
    for instance_type in types:
        match = _INSTANCE_TYPE.match(instance_type)
        family = match.group("family") if match else ""
        if not match:
            problems.add("instanceTypes", f"{instance_type!r} is not an EC2 instance type", example)
        elif family in REFUSED_FAMILIES:
            problems.add(
                "instanceTypes", f"{instance_type!r} is refused: {REFUSED_FAMILIES[family]}", example
            )
        elif family not in NVIDIA_FAMILIES:
            problems.add(
                "instanceTypes",
                f"{instance_type!r} has no NVIDIA GPU (or is unknown); use one of the families "
                f"{', '.join(NVIDIA_FAMILIES)}",
                example,
            )


def _check_efa_types(types: tuple[str, ...], private_subnets: bool, problems: _Problems) -> None:
    """A multi-node cluster gets one EFA per network card (infra/efa.py): every type's cards must be known and
    the same, and several interfaces need private subnets."""
    example = '\'["p5.48xlarge","p5e.48xlarge"]\''
    for unknown in unknown_efa_types(types):
        problems.add(
            "instanceTypes",
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
        problems.add("instanceTypes", str(exc), example)
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
