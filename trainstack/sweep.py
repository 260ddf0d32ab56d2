"""Sweeps: `--sweep KEY=V1,V2,...` axes, their grid of points, each point applied to a job, and the ranking
`trainstack jobs --sweep NAME` shows.

A point sets dotted keys of the built-in trainer's config (`train.lr=0.1`), or environment variables of a
user's job (`LR=0.1`: the job reads its hyperparameters from its environment, as docs/job-contract.md
says for everything it is given). Each point is validated as a job of its own before anything is uploaded.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from training.config import ConfigError, apply_overrides, parse_override
from trainstack.errors import CliError
from trainstack_job.jobfile import JobSpec, JobSpecError
from trainstack_job.secret_refs import ENV_NAME

# A grid is queued as one job per point: past this it is more likely a typo than an experiment.
MAX_POINTS = 100
# The built-in trainer's main metric, from results/metrics.json (training/metrics.py): higher is better.
DEFAULT_METRIC = "final.val_accuracy"
_LABEL = re.compile(r"[^a-z0-9.]+")


class SweepError(CliError):
    """Every problem of a sweep, one line each naming the key and the fix."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class SweepAxis:
    """One `--sweep KEY=V1,V2,...`: the key, each value as YAML reads it, and as the user wrote it."""

    key: str
    values: tuple[Any, ...]
    texts: tuple[str, ...]

    @property
    def short(self) -> str:
        """The key in a job's name: its last part, initials when it has several words (batch_size: bs)."""
        last = self.key.rsplit(".", 1)[-1].lower()
        words = [w for w in re.split(r"[_\-]+", last) if w]
        return "".join(w[0] for w in words) if len(words) > 1 else last


@dataclass(frozen=True)
class SweepPoint:
    """One job of the grid: key -> value, in the order the axes were given."""

    values: dict[str, Any]
    # Each value as the user wrote it: what a trainer override or an environment variable receives.
    texts: dict[str, str]
    label: str

    def to_json(self) -> dict[str, Any]:
        return dict(self.values)


def parse_axes(specs: Sequence[str]) -> list[SweepAxis]:
    """Every `--sweep` argument; all malformed ones in one error, one line each."""
    axes: list[SweepAxis] = []
    problems: list[str] = []
    seen: set[str] = set()
    for spec in specs:
        key, sep, raw = spec.partition("=")
        key = key.strip()
        texts = tuple(t.strip() for t in raw.split(","))
        if not sep or not key or not all(texts):
            problems.append(f"--sweep {spec!r}: expected KEY=V1,V2,... (e.g. --sweep train.lr=0.1,0.03)")
            continue
        if key in seen:
            problems.append(f"--sweep {key}: given twice; put all its values in one --sweep {key}=V1,V2")
            continue
        if len(set(texts)) != len(texts):
            problems.append(f"--sweep {key}: a value repeats ({raw}); give each value once")
            continue
        seen.add(key)
        axes.append(SweepAxis(key, tuple(parse_override(f"{key}={t}")[1] for t in texts), texts))
    if problems:
        raise SweepError(problems)
    size = math.prod(len(axis.values) for axis in axes)
    if size > MAX_POINTS:
        raise SweepError(
            [f"--sweep: the grid has {size} points (at most {MAX_POINTS} jobs at once); sweep fewer values"]
        )
    return axes


def grid(axes: Sequence[SweepAxis]) -> list[SweepPoint]:
    """The cartesian product, the first axis varying slowest; each point's label names its values."""
    points = []
    for combo in itertools.product(*(range(len(axis.values)) for axis in axes)):
        values = {axis.key: axis.values[i] for axis, i in zip(axes, combo, strict=True)}
        label = "-".join(
            f"{axis.short}{_LABEL.sub('-', axis.texts[i].lower()).strip('-')}"
            for axis, i in zip(axes, combo, strict=True)
        )
        texts = {axis.key: axis.texts[i] for axis, i in zip(axes, combo, strict=True)}
        points.append(SweepPoint(values, texts, label))
    return points


def trainer_point(config: Mapping[str, Any], point: SweepPoint) -> dict[str, Any]:
    """The built-in trainer's config with the point's dotted keys set (validated by the caller)."""
    try:
        return apply_overrides(config, [f"{key}={text}" for key, text in point.texts.items()])
    except ConfigError as error:
        raise SweepError([f"--sweep {point.label}: {problem}" for problem in error.problems]) from None


def user_job_point(spec: JobSpec, point: SweepPoint, source: str) -> JobSpec:
    """A user's job with the point's keys as environment variables, checked by the job file's own
    validator (a key that is no variable name, TRAINSTACK_*, or a value that looks like a secret)."""
    problems = [
        f"--sweep {key}: a user's job is swept through its environment; use a variable name (e.g. LR)"
        for key in point.values
        if not ENV_NAME.match(key)
    ]
    if problems:
        raise SweepError(problems)
    env = {**spec.env, **point.texts}
    mapping = {**spec.to_mapping(), "env": env}
    try:
        return JobSpec.from_mapping(mapping, f"{source} (--sweep {point.label})")
    except JobSpecError as error:
        raise SweepError(error.problems) from None


def metric_value(metrics: Mapping[str, Any] | None, key: str) -> float | None:
    """A dotted key of a job's metrics.json, when it is a number."""
    value: Any = metrics
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def rank(rows: Sequence[dict[str, Any]], *, higher_is_better: bool = True) -> list[dict[str, Any]]:
    """Rows with a `metric` (None: no metrics yet), best first; those without one last, in their order."""
    scored = [row for row in rows if row.get("metric") is not None]
    unscored = [row for row in rows if row.get("metric") is None]
    scored.sort(key=lambda row: float(row["metric"]), reverse=higher_is_better)
    return [*scored, *unscored]
