"""The config keys and their defaults, and what every key shares: its reader (one value of a given type), and
the problems collected, each with its key and a fix."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO_ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "trainstack"

# The Deep Learning AMI (OSS NVIDIA driver, PyTorch, Ubuntu 24.04, x86_64): python at /opt/pytorch/bin/python,
# instance-store NVMe mounted at /opt/dlami/nvme.
DEFAULT_AMI_PARAMETER = (
    "/aws/service/deeplearning/ami/x86_64/oss-nvidia-driver-gpu-pytorch-2.9-ubuntu-24.04/latest/ami-id"
)
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
    # Bring your own network (infra/network.py, lookup_existing_network): an existing VPC and its private
    # subnets instead of the stack's own; the stack then checks them against its baseline at preview.
    "vpcId": "",
    "subnetIds": [],
    # With vpcId: let the stack add the VPC endpoints it finds missing (S3 gateway; under networkIsolation,
    # the interface endpoints) instead of refusing the preview.
    "createVpcEndpoints": False,
}

# trainstack:pools (docs/internals.md, "Pools"): a list of mappings, so no entry of DEFAULTS (Pulumi.yaml's
# typed schema has no type for a list of objects, and Pulumi passes such a value to the program as JSON).
# Unset or empty: today's single-group keys above define the stack's one pool, named LEGACY_POOL.
POOLS_KEY = "pools"
# trainstack:measuredThroughput (infra/config/measured.py): a mapping of instance type to samples/s, which the
# schema cannot type either; unset, every pool weighs its types by the shipped estimate.
MEASURED_KEY = "measuredThroughput"
STRUCTURED_KEYS = (POOLS_KEY, MEASURED_KEY)
AMI_ID = re.compile(r"^ami-[0-9a-f]{8}([0-9a-f]{9})?$")
EMAIL = re.compile(r"^[^@\s]+@[^@\s]+\.[A-Za-z]{2,}$")
PRICE = re.compile(r"^\d+(\.\d+)?$")
VPC_ID = re.compile(r"^vpc-[0-9a-f]{8}([0-9a-f]{9})?$")
SUBNET_ID = re.compile(r"^subnet-[0-9a-f]{8}([0-9a-f]{9})?$")


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


class Problems:
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


def string(raw: Any) -> str:
    if not isinstance(raw, str):
        raise ValueError(f"must be a string, got {raw!r}")
    return raw


def integer(raw: Any) -> int:
    if isinstance(raw, bool):
        raise ValueError(f"must be an integer, got {raw!r}")
    if isinstance(raw, int):
        return raw
    if isinstance(raw, str) and re.fullmatch(r"-?\d+", raw.strip()):
        return int(raw)
    raise ValueError(f"must be an integer, got {raw!r}")


def boolean(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in ("true", "false"):
        return raw.strip().lower() == "true"
    raise ValueError(f"must be true or false, got {raw!r}")


def string_list(raw: Any) -> list[str]:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"must be a list of strings (JSON array), got {raw!r}") from exc
    if not isinstance(raw, list) or not all(isinstance(item, str) for item in raw):
        raise ValueError(f"must be a list of strings, got {raw!r}")
    return [item.strip() for item in raw]


def clip(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_range(
    problems: Problems, key: str, value: Any, low: int, high: int, example: str, why: str
) -> None:
    if isinstance(value, int) and not low <= value <= high:
        problems.add(key, f"must be between {low} and {high}, got {value} ({why})", example)
