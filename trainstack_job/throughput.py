"""How fast each instance type trains a job: measured lives per job and per model family, a shipped estimate
before any, the Auto Scaling weights that make a pool's spot allocation compare price per unit of training,
and the types a job does better without; standard library only.

The stack keeps one table (`state/throughput.json`, `ThroughputStore`): at each life's end the agent merges
the job's ended lives into it with a conditional write, each life once (by its id). A job's own lives say the
most about it; lives of other jobs training the same model (the trainer's `model.name`, its "family") come
next; before either, `SHIPPED` below estimates each GPU's speed relative to a T4 from public datasheets.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeGuard

from trainstack_job.records import Life, S3Record

# Under the stack's state/ prefix (the instance role writes state/, trainstack_job/contract.py BucketPrefix).
THROUGHPUT = "throughput.json"
# A table remembers this many merged lives (newest kept): enough that a retried merge never counts one twice.
MERGED_LIVES_KEPT = 2000
# A life shorter than this counts as this long: its average over a minute or two is mostly warm-up.
MIN_LIFE_HOURS = 1 / 60
# A type is behind for a job when its expected $ per useful step is this far above the best type's
# (`trainstack estimate`): the job gains nothing from it.
DROP_MARGIN = 0.25
# AWS's bounds on an override's WeightedCapacity.
MAX_WEIGHT = 999


@dataclass(frozen=True)
class Throughput:
    """The expected training speed of one instance type (the whole instance, all of its GPUs)."""

    instance_type: str
    samples_per_second: float
    source: str  # e.g. "measured: 3 lives of job j-..." or "shipped: <citation>"


# -- the shipped estimate -------------------------------------------------------------------------------

# An ESTIMATE, not a measurement: each GPU's dense (no sparsity) FP16/BF16 tensor-core peak from NVIDIA's
# datasheets, relative to a T4. Real training gains less than the peak ratio where memory bandwidth or the
# data loader bounds a step; the first measured life of a job or its model replaces this for it. Read
# 2026-12-07.
_TFLOPS_CITED: dict[str, tuple[float, str]] = {
    "T4": (65.0, "NVIDIA T4 datasheet (2019): 65 TFLOPS mixed-precision FP16/FP32"),
    "V100": (125.0, "NVIDIA V100 datasheet (2020): 125 TFLOPS tensor (SXM2)"),
    # AWS's A10G is a lower-clocked A10; NVIDIA publishes the A10's figure only.
    "A10G": (125.0, "NVIDIA A10 datasheet (2021): 125 TFLOPS BF16 dense, taken for the A10G"),
    "L4": (121.0, "NVIDIA L4 datasheet (2023): 121 TFLOPS BF16 dense (242 with sparsity)"),
    "L40S": (362.0, "NVIDIA L40S datasheet (2023): 362 TFLOPS BF16 dense (733 with sparsity)"),
    "A100": (312.0, "NVIDIA A100 datasheet (2021): 312 TFLOPS BF16 dense"),
    "H100": (989.0, "NVIDIA H100 datasheet (2023): 989 TFLOPS BF16 dense (SXM)"),
    "H200": (989.0, "NVIDIA H200 datasheet (2024): 989 TFLOPS BF16 dense (SXM)"),
}
# EC2 family -> (its GPU, GPUs per size where that is not 1): the same table as bootstrap/devices.py FAMILIES,
# for the types the stack offers (this module may not import the agent).
_FAMILIES: dict[str, tuple[str, dict[str, int]]] = {
    "g4dn": ("T4", {"12xlarge": 4, "metal": 8}),
    "g5": ("A10G", {"12xlarge": 4, "24xlarge": 4, "48xlarge": 8}),
    "g6": ("L4", {"12xlarge": 4, "24xlarge": 4, "48xlarge": 8}),
    "gr6": ("L4", {}),
    "g6e": ("L40S", {"12xlarge": 4, "24xlarge": 4, "48xlarge": 8}),
    "p3": ("V100", {"8xlarge": 4, "16xlarge": 8}),
    "p3dn": ("V100", {"24xlarge": 8}),
    "p4d": ("A100", {"24xlarge": 8}),
    "p4de": ("A100", {"24xlarge": 8}),
    "p5": ("H100", {"48xlarge": 8}),
    "p5e": ("H200", {"48xlarge": 8}),
    "p5en": ("H200", {"48xlarge": 8}),
}


def shipped_throughput(instance_type: str) -> Throughput | None:
    """The shipped estimate for `g6.xlarge` and the like, in T4-equivalents (a T4 instance is 1.0): comparable
    with other shipped estimates only, never with measured samples/s. None for a type it does not know."""
    family, dot, size = instance_type.strip().partition(".")
    if not dot or family not in _FAMILIES:
        return None
    gpu, counts = _FAMILIES[family]
    gpus = counts.get(size, 1)
    tflops, citation = _TFLOPS_CITED[gpu]
    relative = gpus * tflops / _TFLOPS_CITED["T4"][0]
    return Throughput(
        instance_type, relative, f"shipped estimate: {gpus}x {gpu}, {citation}, relative to a T4"
    )


# -- the measured table ---------------------------------------------------------------------------------


@dataclass
class Measured:
    """What lives measured on one instance type: their hours-weighted mean samples/s."""

    samples_per_second: float
    lives: int
    hours: float
    precisions: list[str] = field(default_factory=list)

    def add(self, samples_per_second: float, hours: float, precision: str | None) -> None:
        total = self.hours + hours
        self.samples_per_second = (self.samples_per_second * self.hours + samples_per_second * hours) / total
        self.hours = total
        self.lives += 1
        if precision and precision not in self.precisions:
            self.precisions.append(precision)

    @classmethod
    def from_json(cls, raw: Any) -> Measured | None:
        if not isinstance(raw, dict):
            return None
        speed, lives, hours = raw.get("samples_per_second"), raw.get("lives"), raw.get("hours")
        if not (
            _positive(speed) and _positive(hours) and isinstance(lives, int) and not isinstance(lives, bool)
        ):
            return None
        precisions = raw.get("precisions")
        kept = [p for p in precisions if isinstance(p, str)] if isinstance(precisions, list) else []
        return cls(float(speed), lives, float(hours), kept)

    def to_json(self) -> dict[str, Any]:
        return {
            "samples_per_second": round(self.samples_per_second, 3),
            "lives": self.lives,
            "hours": round(self.hours, 6),
            "precisions": self.precisions,
        }


def _positive(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def _measured_map(raw: Any) -> dict[str, dict[str, Measured]]:
    """{job or family: {instance type: Measured}}, leaving out whatever does not read."""
    table: dict[str, dict[str, Measured]] = {}
    for key, types in (raw if isinstance(raw, dict) else {}).items():
        if not isinstance(types, dict):
            continue
        entries = {t: m for t, m in ((t, Measured.from_json(v)) for t, v in types.items()) if m is not None}
        if entries:
            table[str(key)] = entries
    return table


def life_hours(life: Life) -> float | None:
    """How long a life trained, start to end (None while it runs, or when a time does not read)."""
    if life.ended_at is None:
        return None
    try:
        start = datetime.fromisoformat(life.started_at.replace("Z", "+00:00"))
        end = datetime.fromisoformat(life.ended_at.replace("Z", "+00:00"))
        seconds = (end - start).total_seconds()
    # TypeError: one time with an offset and one without; raised, it stopped every later merge of the job.
    except (TypeError, ValueError):
        return None
    return max(0.0, seconds / 3600)


@dataclass
class ThroughputTable:
    """Measured samples/s per instance type, per job (`jobs`) and per model family (`families`), and which
    lives were merged (so a retried merge counts none twice)."""

    jobs: dict[str, dict[str, Measured]] = field(default_factory=dict)
    families: dict[str, dict[str, Measured]] = field(default_factory=dict)
    merged_lives: list[str] = field(default_factory=list)

    @classmethod
    def from_json(cls, raw: Any) -> ThroughputTable:
        """Anything that is not a table reads as an empty one (the table is advice, never a cause to fail)."""
        if not isinstance(raw, dict):
            return cls()
        merged = raw.get("merged_lives")
        return cls(
            jobs=_measured_map(raw.get("jobs")),
            families=_measured_map(raw.get("families")),
            merged_lives=[x for x in merged if isinstance(x, str)] if isinstance(merged, list) else [],
        )

    def to_json(self) -> dict[str, Any]:
        def written(table: dict[str, dict[str, Measured]]) -> dict[str, Any]:
            return {key: {t: m.to_json() for t, m in types.items()} for key, types in table.items()}

        return {
            "jobs": written(self.jobs),
            "families": written(self.families),
            "merged_lives": self.merged_lives[-MERGED_LIVES_KEPT:],
        }

    def merge(self, job_id: str, lives: Iterable[Life], family: str | None = None) -> int:
        """Add the job's ended, measured lives not merged before; returns how many were. A life's own
        `model_family` (the model its trainer reported) wins over `family`."""
        merged = set(self.merged_lives)
        added = 0
        for life in lives:
            hours = life_hours(life)
            speed = life.samples_per_second
            if not life.life_id or life.life_id in merged or life.instance_type is None:
                continue
            if hours is None or speed is None or speed <= 0:
                continue
            weight = max(hours, MIN_LIFE_HOURS)
            scopes = [(self.jobs, job_id), (self.families, life.model_family or family)]
            for scope, key in scopes:
                if key:
                    entry = scope.setdefault(key, {}).get(life.instance_type)
                    if entry is None:
                        scope[key][life.instance_type] = Measured(speed, 1, weight, _listed(life.precision))
                    else:
                        entry.add(speed, weight, life.precision)
            self.merged_lives.append(life.life_id)
            merged.add(life.life_id)
            added += 1
        return added


def _listed(value: str | None) -> list[str]:
    return [value] if value else []


def _measured(
    table: ThroughputTable | None, family: str | None, job_id: str | None
) -> list[tuple[dict[str, Measured], str]]:
    """The measurements that apply, most specific first, each with the words that say where it comes from."""
    if table is None:
        return []
    found = []
    if job_id and job_id in table.jobs:
        found.append((table.jobs[job_id], f"job {job_id}"))
    if family and family in table.families:
        found.append((table.families[family], f"model family {family}"))
    return found


def expected_throughput(
    instance_type: str,
    *,
    family: str | None = None,
    job_id: str | None = None,
    table: ThroughputTable | None = None,
) -> Throughput | None:
    """What `instance_type` is expected to train at: the job's own measured lives on it, else its model
    family's, else the shipped estimate. Where the job (or family) measured another type but not this one,
    the estimate is scaled by that measurement, so the numbers this returns for one job compare with each
    other. None: nothing is known of the type."""
    shipped = shipped_throughput(instance_type)
    for types, scope in _measured(table, family, job_id):
        entry = types.get(instance_type)
        if entry is not None:
            lives = f"{entry.lives} li{'fe' if entry.lives == 1 else 'ves'}"
            return Throughput(instance_type, entry.samples_per_second, f"measured: {lives} of {scope}")
        anchor = _anchor(types)
        if shipped is not None and anchor is not None:
            anchor_type, anchor_rate, anchor_shipped = anchor
            scaled = anchor_rate * shipped.samples_per_second / anchor_shipped
            return Throughput(
                instance_type,
                round(scaled, 3),
                f"estimate: {scope} measured on {anchor_type}, scaled by the {shipped.source}",
            )
    return shipped


def _anchor(types: Mapping[str, Measured]) -> tuple[str, float, float] | None:
    """The most-measured type that the shipped estimate also knows: (type, measured samples/s, estimate)."""
    for instance_type, entry in sorted(types.items(), key=lambda item: (-item[1].hours, item[0])):
        shipped = shipped_throughput(instance_type)
        if shipped is not None:
            return instance_type, entry.samples_per_second, shipped.samples_per_second
    return None


# -- weights --------------------------------------------------------------------------------------------


def pool_throughput(
    instance_types: Sequence[str], measured: Mapping[str, float]
) -> dict[str, Throughput | None]:
    """Each of a pool's types' expected throughput in one unit, from the stack's measured figures
    (trainstack:measuredThroughput, samples/s of one model on each type it names) and the shipped estimate.

    A measured type trains at its figure. Every other type gets the shipped estimate scaled by the measured
    types' measured/shipped ratio (their geometric mean: the ratios scale multiplicatively, and that mean
    does not depend on which measured type is taken as the reference), so measured and estimated numbers
    compare. None of the types measured: the shipped estimates as they are. None for a type that can be
    neither measured nor scaled (no estimate, or no measured type with one to scale by)."""
    ratios = [
        measured[t] / shipped.samples_per_second
        for t in instance_types
        if t in measured and (shipped := shipped_throughput(t)) is not None and shipped.samples_per_second > 0
    ]
    any_measured = any(t in measured for t in instance_types)
    scale = math.exp(sum(math.log(r) for r in ratios) / len(ratios)) if ratios else None
    found: dict[str, Throughput | None] = {}
    for instance_type in instance_types:
        shipped = shipped_throughput(instance_type)
        if instance_type in measured:
            found[instance_type] = Throughput(
                instance_type, measured[instance_type], "measured: trainstack:measuredThroughput"
            )
        elif shipped is None or not any_measured:
            found[instance_type] = shipped
        elif scale is None:
            found[instance_type] = None
        else:
            found[instance_type] = Throughput(
                instance_type,
                shipped.samples_per_second * scale,
                f"estimated: the {shipped.source}, scaled by the measured types' measured/shipped ratio",
            )
    return found


def capacity_weights(
    instance_types: Sequence[str],
    *,
    family: str | None = None,
    job_id: str | None = None,
    table: ThroughputTable | None = None,
    measured: Mapping[str, float] | None = None,
) -> dict[str, int]:
    """Each type's WeightedCapacity: its expected throughput relative to the slowest type's, rounded, at
    least 1, so that price-capacity-optimized compares price per unit of training. All 1 (unweighted) when any
    type is unknown: a weight guessed for one type would be compared against measured ones.

    `measured` (the stack's trainstack:measuredThroughput) naming any of the types decides instead of
    `table`: `pool_throughput` combines it with the shipped estimate."""
    if measured and any(t in measured for t in instance_types):
        expected = list(pool_throughput(instance_types, measured).values())
    else:
        expected = [expected_throughput(t, family=family, job_id=job_id, table=table) for t in instance_types]
    speeds = [e.samples_per_second for e in expected if e is not None and e.samples_per_second > 0]
    if len(speeds) != len(instance_types) or not speeds:
        return {t: 1 for t in instance_types}
    slowest = min(speeds)
    return {
        t: min(MAX_WEIGHT, max(1, round(speed / slowest)))
        for t, speed in zip(instance_types, speeds, strict=True)
    }


def pool_capacity_weights(
    instance_types: Sequence[str],
    *,
    max_instances: int,
    max_jobs: int,
    measured: Mapping[str, float] | None = None,
) -> dict[str, int] | None:
    """A pool's types' WeightedCapacity, or None (no weights: a unit is an instance) for a pool that may hold
    more than one instance per job or more than one job at once, and for one whose types all weigh 1.
    infra/fleet.py's pool_weights says why only a pool of one instance of one job is weighted; the program
    and `trainstack weights` both ask here, so they never disagree."""
    if max_instances != 1 or max_jobs != 1:
        return None
    weights = capacity_weights(instance_types, measured=measured)
    return weights if max(weights.values(), default=1) > 1 else None


def capacity_units(instances: int, weights: Mapping[str, int] | None = None) -> int:
    """The desired capacity, in the group's units, for `instances` instances. A weighted pool serves one
    job on one instance (infra/fleet.py), and its slowest type weighs 1: any instance fulfils one unit, so
    one unit is one instance. An unweighted pool's unit is an instance. Either way N instances are N units;
    this says so in one place for everything that sets a desired capacity."""
    if weights and min(weights.values()) != 1:
        raise ValueError(f"weights {dict(weights)} must give the slowest type 1: a unit is one instance")
    return instances


# -- the stack's table in S3 ----------------------------------------------------------------------------


class ThroughputStore:
    """The stack's `state/throughput.json`, read and merged with conditional writes (records.py S3Record)."""

    def __init__(self, s3: Any, bucket: str, key: str, attempts: int = 10) -> None:
        self._record = S3Record(s3, bucket, key)
        self._attempts = attempts

    @property
    def uri(self) -> str:
        return self._record.uri

    def load(self) -> ThroughputTable:
        raw, _ = self._record.get()
        return ThroughputTable.from_json(raw)

    def merge(self, job_id: str, lives: Iterable[Life], family: str | None = None) -> int:
        """Merge the job's ended lives into the table; returns how many were new. A lost race reads again."""
        lives = list(lives)
        for attempt in range(self._attempts):
            raw, etag = self._record.get()
            table = ThroughputTable.from_json(raw)
            added = table.merge(job_id, lives, family)
            if not added or self._record.put(table.to_json(), etag):
                return added
            time.sleep(0.05 * (attempt + 1))
        raise RuntimeError(
            f"{self.uri}: {self._attempts} concurrent writers in a row; the next life end merges"
        )
