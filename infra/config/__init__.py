"""The stack's configuration: one typed, validated `StackConfig`, every problem named by its key.

One module per part, each importing only those before it: `values` (the readers and the problems),
`groups` (a group's keys), `pools` (trainstack:pools), `measured` (trainstack:measuredThroughput), `jobs` (the
default job), `network`, `stack` (the whole config and its parser).
"""

from infra.config.groups import (
    MAX_NODES,
    NVIDIA_FAMILIES,
    PLACEMENT_STRATEGIES,
    REFUSED_FAMILIES,
    SPOT_ALLOCATION_STRATEGIES,
)
from infra.config.network import MAX_INGRESS_ADDRESSES
from infra.config.pools import (
    LEGACY_POOL,
    MAX_JOBS_PER_POOL,
    MAX_POOLS,
    POOL_DEFAULTS,
    POOL_NAME,
    POOLS_EXAMPLE,
    SINGLE_GROUP_KEYS,
    Pool,
    pool_group_name,
)
from infra.config.stack import (
    LOG_RETENTION_DAYS,
    MAX_CONCURRENT_JOBS,
    StackConfig,
    load_stack_config,
    parse_stack_config,
    read_stack_config,
)
from infra.config.values import (
    DEFAULT_AMI_PARAMETER,
    DEFAULTS,
    MEASURED_KEY,
    NAMESPACE,
    POOLS_KEY,
    REPO_ROOT,
    STRUCTURED_KEYS,
    StackConfigError,
)

__all__ = [
    "DEFAULTS",
    "DEFAULT_AMI_PARAMETER",
    "LEGACY_POOL",
    "LOG_RETENTION_DAYS",
    "MAX_CONCURRENT_JOBS",
    "MAX_INGRESS_ADDRESSES",
    "MAX_JOBS_PER_POOL",
    "MAX_NODES",
    "MAX_POOLS",
    "MEASURED_KEY",
    "NAMESPACE",
    "NVIDIA_FAMILIES",
    "PLACEMENT_STRATEGIES",
    "POOLS_EXAMPLE",
    "POOLS_KEY",
    "POOL_DEFAULTS",
    "POOL_NAME",
    "REFUSED_FAMILIES",
    "REPO_ROOT",
    "SINGLE_GROUP_KEYS",
    "SPOT_ALLOCATION_STRATEGIES",
    "STRUCTURED_KEYS",
    "Pool",
    "StackConfig",
    "StackConfigError",
    "load_stack_config",
    "parse_stack_config",
    "pool_group_name",
    "read_stack_config",
]
