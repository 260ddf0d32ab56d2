"""trainstack:pools: each pool its own group and launch template over the one baseline (docs/internals.md,
"Pools")."""

from __future__ import annotations

import contextlib
import difflib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from infra.config.groups import MAX_NODES, GroupKeys, check_efa_types, check_group_purchase, check_group_size
from infra.config.values import (
    DEFAULTS,
    NAMESPACE,
    POOLS_KEY,
    Problems,
    boolean,
    check_range,
    clip,
    integer,
    string,
    string_list,
)
from infra.efa import all_support_efa

# The pool the single-group keys define. A declared pool of this name keeps that group's resources and names
# (the Auto Scaling group `<project>-<stack>-gpu`, the Pulumi names `fleet`, `capacity`...), so a stack moving
# its single group into trainstack:pools with the same settings diffs to nothing.
LEGACY_POOL = "default"
# Each pool is an Auto Scaling group, a launch template and (when on) its capacity function, alarm and rules.
MAX_POOLS = 8
# The most jobs one pool runs at once: each is a pointer that every instance of the pool reads for work.
MAX_JOBS_PER_POOL = 64
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
    # trainstack:measuredThroughput's (type, samples/s) for this pool's types: its weights follow them
    # (infra/fleet.py pool_weights). A tuple, not a mapping, so a pool stays hashable.
    measured_throughput: tuple[tuple[str, float], ...] = ()

    @property
    def measured(self) -> dict[str, float]:
        """trainstack:measuredThroughput for this pool's types: instance type -> samples/s."""
        return dict(self.measured_throughput)

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


def _pool_entries(value: Any, problems: Problems) -> list[Any]:
    """trainstack:pools as a list: Pulumi hands the program a structured value as JSON text, the CLI's stack
    file as parsed YAML."""
    if isinstance(value, str):
        with contextlib.suppress(json.JSONDecodeError):
            value = json.loads(value) if value.strip() else []
    if not isinstance(value, list):
        problems.add(
            POOLS_KEY,
            f"must be a list of pools (a JSON array of mappings with name, instanceTypes, maxInstances), "
            f"got {clip(value)}",
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


def parse_pools(
    value: Any, problems: Problems, *, stack_name: str, private_subnets: bool
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
    entry: Any, index: int, problems: Problems, *, stack_name: str, private_subnets: bool
) -> Pool | None:
    keys = GroupKeys.of_pool(index)
    if not isinstance(entry, dict):
        problems.add(
            f"{POOLS_KEY}[{index}]",
            f"must be a mapping with name, instanceTypes and maxInstances, got {clip(entry)}",
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

    name = value("name", string, "big")
    typed = len(problems.lines)
    types = tuple(value("instanceTypes", string_list, '\'["g6.xlarge","g5.xlarge"]\'') or ())
    # A missing or mistyped list is its own line already; an empty one is judged below.
    types_given = len(problems.lines) == typed and entry.get("instanceTypes") is not None
    count = value("maxInstances", integer, "1")
    min_nodes = value("minNodes", integer, "1")
    strategy = value("spotAllocationStrategy", string, "price-capacity-optimized").strip()
    on_demand_base = value("onDemandBaseCapacity", integer, "0")
    on_demand_pct = value("onDemandPercentageAboveBase", integer, "0")
    spot_max_price = value("spotMaxPrice", string, "0.50").strip()
    fallback_minutes = value("spotFallbackMinutes", integer, "15")
    placement_group = value("placementGroup", boolean, "true")
    max_jobs = value("maxJobs", integer, "4")
    if isinstance(max_jobs, int):
        check_range(
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
        check_group_size(types, count, min_nodes, keys, problems)
    elif isinstance(count, int):
        check_range(
            problems, keys(keys.count), count, 1, MAX_NODES, "1",
            "instances training one job; above 1 they train it together (docs/multi-node.md)",
        )  # fmt: skip
    if isinstance(count, int) and count > 1 and placement_group and types:
        check_efa_types(types, private_subnets, problems, keys("instanceTypes"))
    check_group_purchase(count, strategy, on_demand_base, on_demand_pct, spot_max_price, keys, problems)
    check_range(
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


def _check_pool_name(name: str, keys: GroupKeys, stack_name: str, problems: Problems) -> None:
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


def refuse_single_group_keys(raw: Mapping[str, Any], parsed: Mapping[str, Any], problems: Problems) -> None:
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
