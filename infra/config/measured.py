"""trainstack:measuredThroughput: samples/s of one model measured on each instance type, which a weighted
pool's WeightedCapacity follows instead of the shipped estimate (infra/fleet.py pool_weights,
docs/internals.md "Weights from measured throughput"). `trainstack weights --apply` sets it from the stack's
measured lives."""

from __future__ import annotations

import contextlib
import difflib
import json
import math
from collections.abc import Collection
from typing import Any

from infra.config.values import MEASURED_KEY, NAMESPACE, Problems, clip

# Far above any training job's samples/s: a bigger figure is a typo (or another unit), not a measurement.
MAX_SAMPLES_PER_SECOND = 1e9
_EXAMPLE_TYPE = "g6.xlarge"
_EXAMPLE_VALUE = "410"
_FROM_LIVES = "`trainstack weights --apply` sets it from the stack's measured lives"


def _entry(instance_type: str) -> str:
    """The key's entry for one type, as `pulumi config set --path` names it (a type has a dot in it)."""
    return f'{MEASURED_KEY}["{instance_type}"]'


def _samples_per_second(raw: Any) -> float:
    """A positive, finite number of samples/s: a number, or its text (`pulumi config set --path` may store
    either)."""
    value: Any = raw
    if isinstance(raw, str):
        with contextlib.suppress(ValueError):
            value = float(raw.strip())
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"must be a number of samples per second, got {clip(raw)}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"must be a positive number of samples per second, got {clip(raw)}")
    if value > MAX_SAMPLES_PER_SECOND:
        raise ValueError(
            f"{value:g} samples per second is more than any training job measures "
            f"(at most {MAX_SAMPLES_PER_SECOND:g}); check the unit"
        )
    return float(value)


def parse_measured_throughput(
    value: Any, problems: Problems, offered: Collection[str] | None
) -> tuple[tuple[str, float], ...]:
    """(instance type, samples/s) for each type the key names; () when unset or empty. `offered`: every pool's
    types, which a named type must be one of (a typo otherwise changes nothing, silently); None when the pools
    did not parse (their own lines say why, and no type can be judged against them)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return ()
    if isinstance(value, str):
        # Pulumi hands the program a structured value as JSON text, the CLI's stack file as parsed YAML.
        with contextlib.suppress(json.JSONDecodeError):
            value = json.loads(value)
    if not isinstance(value, dict):
        problems.add(
            MEASURED_KEY,
            f"must be a mapping of instance type to the samples per second measured on it, got "
            f"{clip(value)}; {_FROM_LIVES}",
            _EXAMPLE_VALUE,
            fix_key=_entry(_EXAMPLE_TYPE),
        )
        return ()
    found: list[tuple[str, float]] = []
    for instance_type, raw in value.items():
        name = str(instance_type).strip()
        if offered is not None and name not in offered:
            # Close enough to be a typo of it: g6.xlarg, not p5.48xlarge for g5.xlarge.
            close = difflib.get_close_matches(name, sorted(offered), n=1, cutoff=0.85)
            hint = f"did you mean '{close[0]}'?" if close else f"the pools offer {', '.join(sorted(offered))}"
            problems.lines.append(
                f"{NAMESPACE}:{_entry(name)}: not an instance type of any pool, so it would weigh nothing "
                f"({hint}); remove it with `pulumi config rm --path '{NAMESPACE}:{_entry(name)}'`"
            )
            continue
        try:
            found.append((name, _samples_per_second(raw)))
        except ValueError as exc:
            problems.add(_entry(name), f"{exc}; {_FROM_LIVES}", _EXAMPLE_VALUE)
    return tuple(found)
