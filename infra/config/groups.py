"""An Auto Scaling group's keys, shared by the single group and every pool: its instance types, size,
purchase options and EFA."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from infra.config.values import POOLS_KEY, PRICE, Problems, check_range
from infra.efa import EfaTableError, all_support_efa, efa_interfaces, unknown_efa_types

# The one place the defaults live; Pulumi.yaml repeats them for the CLI and a test keeps the two equal.
# Nodes one job trains on: the c10d rendezvous and one S3 ledger are sized for tens, not thousands.
MAX_NODES = 64

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

_INSTANCE_TYPE = re.compile(r"^(?P<family>[a-z][a-z0-9-]*?)\.(?P<size>[a-z0-9-]+)$")


def parse_spot_fallback_minutes(minutes: Any, problems: Problems) -> int:
    """0 = never; otherwise the minutes without a launch, while the group wants one, before on-demand."""
    check_range(
        problems, "spotFallbackMinutes", minutes, 0, 24 * 60, "15",
        "minutes without a spot launch before launching on-demand; 0 = never",
    )  # fmt: skip
    return int(minutes)


@dataclass(frozen=True)
class GroupKeys:
    """How a group's settings are named in the stack config: the single group's keys, or one pool's."""

    prefix: str = ""
    count: str = "instanceCount"
    pool: bool = False

    @classmethod
    def of_pool(cls, index: int) -> GroupKeys:
        return cls(prefix=f"{POOLS_KEY}[{index}].", count="maxInstances", pool=True)

    def __call__(self, key: str) -> str:
        """The key as a problem line names it: `minNodes`, or `pools[1].minNodes`."""
        return f"{self.prefix}{key}"


def check_group_size(
    types: tuple[str, ...], count: Any, min_nodes: Any, keys: GroupKeys, problems: Problems
) -> None:
    """The group's GPU types and how many instances one job trains on (the single group's and each pool's)."""
    _check_instance_types(types, problems, keys("instanceTypes"))
    check_range(
        problems, keys(keys.count), count, 1, MAX_NODES, "1",
        "instances training one job; above 1 they train it together (docs/multi-node.md)",
    )  # fmt: skip
    if isinstance(count, int) and isinstance(min_nodes, int):
        check_range(
            problems, keys("minNodes"), min_nodes, 1, max(1, count), "1",
            f"nodes the job keeps training with while the others are replaced; at most {keys.count}",
        )  # fmt: skip


def check_group_purchase(
    count: Any,
    strategy: str,
    on_demand_base: Any,
    on_demand_pct: Any,
    spot_max_price: str,
    keys: GroupKeys,
    problems: Problems,
) -> None:
    """How the group buys its instances: spot strategy, on-demand base and share, spot price cap."""
    if strategy not in SPOT_ALLOCATION_STRATEGIES:
        problems.add(
            keys("spotAllocationStrategy"),
            f"unknown strategy {strategy!r}; choose one of {', '.join(SPOT_ALLOCATION_STRATEGIES)}",
            "price-capacity-optimized",
        )
    base_key = keys("onDemandBaseCapacity")
    check_range(problems, base_key, on_demand_base, 0, 100, "0", "on-demand instances first")
    if isinstance(count, int) and isinstance(on_demand_base, int) and on_demand_base > count:
        problems.add(
            base_key,
            f"{on_demand_base} on-demand instances exceed the group's maximum {keys.count}={count} "
            "(min > max)",
            str(count),
        )
    check_range(problems, keys("onDemandPercentageAboveBase"), on_demand_pct, 0, 100, "0", "0 = all spot")
    if spot_max_price and not (PRICE.match(spot_max_price) and float(spot_max_price) > 0):
        problems.add(
            keys("spotMaxPrice"),
            f"{spot_max_price!r} is not a positive USD/hour price; empty = no cap",
            "0.50",
        )


def _check_instance_types(types: tuple[str, ...], problems: Problems, key: str = "instanceTypes") -> None:
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


def check_efa_types(
    types: tuple[str, ...], private_subnets: bool, problems: Problems, key: str = "instanceTypes"
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
