"""What a job asks for, and which of the stack's pools can serve it.

A job names a pool, or asks for GPUs (`resources: {gpus: "L4:1", min_gpu_memory_gb: 24, instances: 2}`) in its
job file, in the built-in trainer's config, or with `trainstack run --pool/--gpus/--min-gpu-memory-gb`. It is
matched at submit to a pool every one of whose instance types serves it (a pool is one Auto Scaling group,
which may launch any of its types); a request no pool serves is refused in one line that names every pool and
what it offers. The record and the queue entry carry the pool, and only that pool's agents take the job
(docs/internals.md, "Pools").

Standard library only: the CLI, the agent and the Pulumi program import it. What an instance type has (its
GPU model, count and memory) is the caller's to say (bootstrap/devices.py's catalogue), as `TypeOffer`s.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trainstack_job.text import clip

# The key in a job file and in a training config (the trainer never sees it, as `secrets:`).
RESOURCES_KEY = "resources"
_GPUS = re.compile(r"^(?:(?P<model>[A-Za-z][A-Za-z0-9]*)(?::(?P<count>\d+))?|(?P<bare>\d+))$")
_KEYS = ("pool", "gpus", "min_gpu_memory_gb", "instances")


class ResourceError(ValueError):
    """A request that cannot be read, or that no pool serves; one line each, naming the key and the fix."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class ResourceRequest:
    """What a job asks for; None = no constraint. `gpus` is per instance; `gpu_model` matches the catalogue's
    model name (L4, A10G, T4, A100, H100...) without regard to case."""

    pool: str | None = None
    gpu_model: str | None = None
    gpus: int | None = None
    min_gpu_memory_gb: float | None = None
    instances: int | None = None

    @property
    def empty(self) -> bool:
        return self == ResourceRequest()

    def to_mapping(self) -> dict[str, Any]:
        """The request as a job file would say it (only what was asked), for the record."""
        gpus = None
        if self.gpu_model is not None or self.gpus is not None:
            gpus = f"{self.gpu_model}:{self.gpus or 1}" if self.gpu_model else str(self.gpus)
        values = {
            "pool": self.pool,
            "gpus": gpus,
            "min_gpu_memory_gb": self.min_gpu_memory_gb,
            "instances": self.instances,
        }
        return {key: value for key, value in values.items() if value is not None}

    def describe(self) -> str:
        """`2x L4 per instance, 24+ GB each, 2 instances` (or `pool gpu-big`)."""
        parts: list[str] = []
        if self.pool:
            parts.append(f"pool {self.pool}")
        if self.gpu_model or self.gpus:
            parts.append(f"{self.gpus or 1}x {self.gpu_model or 'any GPU'} per instance")
        if self.min_gpu_memory_gb is not None:
            parts.append(f"{self.min_gpu_memory_gb:g}+ GB per GPU")
        if self.instances is not None:
            parts.append(f"{self.instances} instance{'s' if self.instances != 1 else ''}")
        return ", ".join(parts) or "anything"


def _number(value: object, *, whole: bool = False) -> bool:
    """A JSON/YAML number (never a boolean, which Python counts as one)."""
    kinds = (int,) if whole else (int, float)
    return isinstance(value, kinds) and not isinstance(value, bool)


def parse_gpus(value: object, where: str) -> tuple[str | None, int]:
    """`L4:1` -> ("L4", 1); `L4` -> ("L4", 1); `2` (or 2) -> (None, 2): any GPU model, two per instance."""
    if isinstance(value, int) and not isinstance(value, bool):
        text = str(value)
    elif isinstance(value, str):
        text = value.strip()
    else:
        raise ResourceError([f'{where}: {clip(value)} is not a GPU request; write MODEL:COUNT, e.g. "L4:1"'])
    found = _GPUS.match(text)
    count = int(found.group("count") or found.group("bare") or 1) if found else 0
    if not found or count < 1:
        raise ResourceError(
            [f'{where}: {clip(value)} is not a GPU request; write MODEL:COUNT ("L4:1", "A100:8") or a count']
        )
    return found.group("model"), count


def parse_resources(raw: object, where: str) -> ResourceRequest:
    """A `resources:` mapping (None or absent: no request); every problem in one ResourceError."""
    if raw is None:
        return ResourceRequest()
    if not isinstance(raw, Mapping):
        raise ResourceError(
            [f'{where}: must be a mapping (pool, gpus, min_gpu_memory_gb, instances), e.g. {{gpus: "L4:1"}}']
        )
    problems = [
        f"{where}.{key}: unknown key; known are {', '.join(_KEYS)}" for key in raw if key not in _KEYS
    ]
    pool = raw.get("pool")
    if pool is not None and (not isinstance(pool, str) or not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,31}", pool)):
        problems.append(f"{where}.pool: {clip(pool)} is not a pool name (lowercase letters, digits and '-')")
        pool = None
    model, gpus = None, None
    if raw.get("gpus") is not None:
        try:
            model, gpus = parse_gpus(raw["gpus"], f"{where}.gpus")
        except ResourceError as error:
            problems += error.problems
    memory = raw.get("min_gpu_memory_gb")
    if memory is not None and (
        isinstance(memory, bool) or not isinstance(memory, int | float) or memory <= 0
    ):
        problems.append(f"{where}.min_gpu_memory_gb: {clip(memory)} is not a size in GB (e.g. 24)")
        memory = None
    instances = raw.get("instances")
    if instances is not None and (
        isinstance(instances, bool) or not isinstance(instances, int) or instances < 1
    ):
        problems.append(f"{where}.instances: {clip(instances)} is not a number of instances (1 or more)")
        instances = None
    if problems:
        raise ResourceError(problems)
    return ResourceRequest(
        pool=pool,
        gpu_model=model,
        gpus=gpus,
        min_gpu_memory_gb=float(memory) if memory is not None else None,
        instances=instances,
    )


@dataclass(frozen=True)
class TypeOffer:
    """One instance type of a pool and its GPUs (the catalogue's; `gpu_model` None: not in the catalogue)."""

    instance_type: str
    gpu_model: str | None
    gpu_count: int
    memory_gib: int

    def describe(self) -> str:
        if self.gpu_model is None:
            return f"{self.instance_type} (GPUs unknown)"
        return f"{self.gpu_count}x {self.gpu_model} {self.memory_gib} GiB ({self.instance_type})"

    def serves(self, request: ResourceRequest) -> bool:
        if request.gpu_model is None and request.gpus is None and request.min_gpu_memory_gb is None:
            return True
        if self.gpu_model is None:
            return False  # nothing known about it: it cannot be promised to a job that asks for GPUs
        if request.gpu_model is not None and request.gpu_model.lower() != self.gpu_model.lower():
            return False
        if request.gpus is not None and self.gpu_count < request.gpus:
            return False
        # The catalogue's GiB against the request's GB: a "24 GB" L4 has 22.4 GiB usable, listed as 24.
        return request.min_gpu_memory_gb is None or self.memory_gib >= request.min_gpu_memory_gb


@dataclass(frozen=True)
class PoolOffer:
    """One pool as the stack declares it (the `pools` stack output): its types and most instances per job.
    `default`: the pool the stack's default job starts on, the one a request that asks for nothing gets."""

    name: str
    types: tuple[TypeOffer, ...]
    max_instances: int
    default: bool = False

    def serves(self, request: ResourceRequest, instances: int) -> bool:
        """Every type serves it (the group may launch any of them) and the pool holds that many instances."""
        if request.pool is not None and request.pool != self.name:
            return False
        return instances <= self.max_instances and all(t.serves(request) for t in self.types)

    def describe(self) -> str:
        types = ", ".join(t.describe() for t in self.types)
        plural = "s" if self.max_instances != 1 else ""
        return f"{self.name} offers {types}, up to {self.max_instances} instance{plural}"


def match_pool(
    request: ResourceRequest, pools: Sequence[PoolOffer], *, instances: int, where: str
) -> PoolOffer:
    """The pool that serves `request` on `instances` instances: the named one, else the default pool when it
    serves, else the first that does in the stack's order. Refused with one line naming every pool and what
    it offers, and the fix."""
    named = [pool for pool in pools if pool.name == request.pool] if request.pool else list(pools)
    if request.pool and not named:
        known = "; ".join(pool.describe() for pool in pools)
        raise ResourceError([f"{where}: no pool named {request.pool!r} in this stack ({known})"])
    serving = [pool for pool in named if pool.serves(request, instances)]
    if serving:
        return next((pool for pool in serving if pool.default), serving[0])
    asked = request.describe()
    if instances > 1 and "instance" not in asked:
        asked = f"{asked}, {instances} instances"
    offers = "; ".join(pool.describe() for pool in (named or pools))
    raise ResourceError(
        [
            f"{where}: no pool serves {asked} ({offers}): ask for what a pool offers, or add a pool that has "
            "it to trainstack:pools and run `pulumi up`"
        ]
    )


def pool_offers(output: Mapping[str, Any], describe_type: Any) -> list[PoolOffer]:
    """The pools of the `pools` stack output ({name: {instance_types, max_instances, default, ...}}), each
    type described by `describe_type(instance_type) -> TypeOffer` (the caller's catalogue)."""
    return [
        PoolOffer(
            name=str(name),
            types=tuple(describe_type(str(t)) for t in value.get("instance_types") or ()),
            max_instances=int(value.get("max_instances") or 1),
            default=bool(value.get("default")),
        )
        for name, value in output.items()
        if isinstance(value, Mapping)
    ]
