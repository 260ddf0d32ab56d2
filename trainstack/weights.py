"""`trainstack weights`: each pool's types' shipped and measured throughput, the WeightedCapacity they have
today and the one the stack's measured lives would give them; `--apply` sets trainstack:measuredThroughput.

The weights never follow the measurements by themselves: the figures go into the stack config, a reviewable
change that `pulumi preview --diff` shows and `pulumi up` applies (docs/internals.md, "Weights from measured
throughput")."""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from rich.table import Table

from trainstack.aws import Clients
from trainstack.errors import CliError
from trainstack.output import console, print_json
from trainstack.stack import NAMESPACE, Stack, run_pulumi
from trainstack_job.contract import StackOutput
from trainstack_job.throughput import (
    THROUGHPUT,
    Measured,
    ThroughputStore,
    ThroughputTable,
    pool_capacity_weights,
    shipped_throughput,
)

if TYPE_CHECKING:
    from infra.config import Pool
    from infra.config import StackConfig as ProgramConfig

# The stack config key --apply sets (infra/config/measured.py reads it).
MEASURED_KEY = f"{NAMESPACE}:measuredThroughput"
# A type measured for less than this, in total, keeps its estimate: its first hour is mostly warm-up, data
# caching and the odd slow life, too little to move infrastructure by.
MIN_HOURS = 1.0
# Significant digits written to the config: a reviewer reads "410.2", and no weight depends on the fifth.
_DIGITS = 4


@dataclass(frozen=True)
class TypeWeights:
    """One type of one pool: what is known of its speed, and its weight now and with the measurements."""

    instance_type: str
    # The shipped estimate in T4-equivalents (comparable with other estimates only); None: not in the table.
    shipped: float | None
    # Samples/s the chosen model measured on it, the hours and lives behind that, and whether it is used.
    measured: float | None
    hours: float
    lives: int
    used: bool
    weight_now: int | None
    weight_to_set: int | None

    def to_json(self) -> dict[str, Any]:
        return dict(vars(self))


@dataclass(frozen=True)
class PoolWeights:
    name: str
    types: list[TypeWeights]
    # Why the pool has no weights whatever is measured (several instances per job, or jobs at once); "" if
    # it may have some.
    unweighted_because: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "pool": self.name,
            "unweighted_because": self.unweighted_because,
            "types": [t.to_json() for t in self.types],
        }


@dataclass(frozen=True)
class Proposal:
    """What `trainstack weights` found and what `--apply` would set."""

    # Whose lives the figures are ("model family resnet50", "job j-..."); "" when nothing is measured.
    scope: str
    pools: list[PoolWeights]
    # trainstack:measuredThroughput as set now, and as --apply would set it (instance type -> samples/s).
    current: dict[str, float]
    to_set: dict[str, float]
    # One line for each measured type left out (too few hours), and each other scope one could choose.
    left_out: list[str] = field(default_factory=list)
    other_scopes: list[str] = field(default_factory=list)

    @property
    def changes(self) -> bool:
        return self.to_set != self.current

    def to_json(self) -> dict[str, Any]:
        return {
            "scope": self.scope,
            "key": MEASURED_KEY,
            "current": self.current,
            "to_set": self.to_set,
            "changes": self.changes,
            "left_out": self.left_out,
            "other_scopes": self.other_scopes,
            "pools": [p.to_json() for p in self.pools],
        }


def add_weights_command(commands: Any, parents: Sequence[argparse.ArgumentParser]) -> None:
    weights = commands.add_parser(
        "weights",
        parents=list(parents),
        help="each pool's WeightedCapacity now and from measured throughput; --apply sets the stack config",
        description="Reads the stack's measured throughput (state/throughput.json: samples/s per instance "
        "type from every ended life) and shows, per pool, each type's shipped estimate and measured "
        f"samples/s with the hours behind it, its weight now and the weight the measurements would give it. "
        f"A type measured for under {MIN_HOURS:g} h keeps its estimate. --apply sets {MEASURED_KEY} for the "
        "stack; `pulumi preview --diff` then shows the new weights and `pulumi up` applies them.",
    )
    scope = weights.add_mutually_exclusive_group()
    scope.add_argument(
        "--family",
        metavar="MODEL",
        help="use the lives of jobs training this model (the trainer's model.name; default: the model "
        "measured longest on the pools' types)",
    )
    scope.add_argument(
        "--job", metavar="ID", help="use one job's own lives (default: a model family's, see --family)"
    )
    weights.add_argument("--apply", action="store_true", help=f"set {MEASURED_KEY} for the stack")


def _settings(stack: Stack) -> ProgramConfig:
    settings = stack.config.settings
    if settings is None:
        raise CliError(f"{stack.config.source}: no pools read; run trainstack in the project directory")
    return settings


def read_table(clients: Clients, stack: Stack) -> ThroughputTable:
    """The stack's `state/throughput.json` (an empty table before any life has ended)."""
    outputs = stack.outputs
    key = outputs.prefix(StackOutput.STATE_PREFIX) + THROUGHPUT
    return ThroughputStore(clients.s3(), outputs.bucket, key).load()


def _unweighted_because(pool: Pool) -> str:
    if pool.max_instances != 1:
        return f"{pool.max_instances} instances per job: AWS could meet N units with fewer, heavier instances"
    if pool.max_jobs != 1:
        return f"{pool.max_jobs} jobs at once: AWS could meet N units with fewer, heavier instances"
    return ""


def _choose_scope(
    table: ThroughputTable, types: set[str], family: str | None, job: str | None
) -> tuple[str, dict[str, Measured], list[str]]:
    """Whose measurements to use: (their name, their figures per type, the other names one could pick)."""
    named = [(f"model family {k}", v, "--family " + k) for k, v in table.families.items()]
    named += [(f"job {k}", v, "--job " + k) for k, v in table.jobs.items()]
    if family is not None or job is not None:
        wanted = f"model family {family}" if family is not None else f"job {job}"
        chosen = next((n for n in named if n[0] == wanted), None)
        if chosen is None:
            known = ", ".join(n[2] for n in named) or "none yet"
            raise CliError(f"the stack's throughput table has no lives of {wanted} (measured: {known})")
    else:

        def hours(entry: tuple[str, dict[str, Measured], str]) -> float:
            return sum(m.hours for t, m in entry[1].items() if t in types)

        # A model family pools every job of that model; one job only when no life reported its model.
        families = [n for n in named if n[0].startswith("model family") and hours(n) > 0]
        jobs = [n for n in named if n[0].startswith("job") and hours(n) > 0]
        candidates = families or jobs
        if not candidates:
            return "", {}, []
        chosen = max(candidates, key=lambda n: (hours(n), n[0]))
    others = [n[2] for n in named if n[0] != chosen[0] and any(t in types for t in n[1])]
    return chosen[0], chosen[1], others


def _rounded(value: float) -> float:
    """`value` to a few significant digits, as the config holds it."""
    if value <= 0:
        return value
    return round(value, max(0, _DIGITS - 1 - math.floor(math.log10(value))))


def _plain(value: float) -> str:
    """A config value without an exponent: 410.2, 12345, 0.0413."""
    text = format(Decimal(repr(value)), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def propose(
    table: ThroughputTable,
    pools: Sequence[Pool],
    current: Mapping[str, float],
    *,
    family: str | None = None,
    job: str | None = None,
) -> Proposal:
    """Each pool's weights now (with `current`, the key as set) and with the chosen lives' measurements."""
    weighable = [p for p in pools if not _unweighted_because(p)]
    types = {t for p in weighable for t in p.instance_types}
    scope, found, others = _choose_scope(table, types, family, job)
    to_set: dict[str, float] = {}
    left_out: list[str] = []
    for instance_type in sorted(types):
        entry = found.get(instance_type)
        if entry is None:
            continue
        if entry.hours < MIN_HOURS:
            left_out.append(
                f"{instance_type}: {entry.hours:.2f} h measured ({entry.lives} li"
                f"{'fe' if entry.lives == 1 else 'ves'}), under the {MIN_HOURS:g} h needed; keeps its "
                "estimate"
            )
            continue
        to_set[instance_type] = _rounded(entry.samples_per_second)
    rows: list[PoolWeights] = []
    for pool in pools:
        why = _unweighted_because(pool)
        now = to = None
        if not why:
            now = pool_capacity_weights(pool.instance_types, max_instances=1, max_jobs=1, measured=current)
            to = pool_capacity_weights(pool.instance_types, max_instances=1, max_jobs=1, measured=to_set)
        described = []
        for instance_type in pool.instance_types:
            shipped = shipped_throughput(instance_type)
            entry = found.get(instance_type)
            described.append(
                TypeWeights(
                    instance_type=instance_type,
                    shipped=round(shipped.samples_per_second, 2) if shipped else None,
                    measured=round(entry.samples_per_second, 3) if entry else None,
                    hours=round(entry.hours, 2) if entry else 0.0,
                    lives=entry.lives if entry else 0,
                    used=instance_type in to_set,
                    weight_now=(now or {}).get(instance_type, 1) if not why else None,
                    weight_to_set=(to or {}).get(instance_type, 1) if not why else None,
                )
            )
        rows.append(PoolWeights(pool.name, described, why))
    return Proposal(scope, rows, dict(current), to_set, left_out, others)


def apply(stack: Stack, proposal: Proposal) -> None:
    """Set trainstack:measuredThroughput to `proposal.to_set` with the pulumi CLI: first the key's entries
    the new figures leave out are removed (the whole key, when any), then every figure is set in one call."""
    where = ["--stack", stack.name]
    if set(proposal.current) - set(proposal.to_set):
        _pulumi(stack, ["config", "rm", *where, MEASURED_KEY])
    entries = [f'{MEASURED_KEY}["{t}"]={_plain(v)}' for t, v in sorted(proposal.to_set.items())]
    values = [arg for entry in entries for arg in ("--plaintext", entry)]
    _pulumi(stack, ["config", "set-all", *where, "--path", *values])


def _pulumi(stack: Stack, argv: list[str]) -> None:
    result = run_pulumi(argv, stack.project_dir)
    if result.returncode != 0:
        lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
        raise CliError(
            f"`pulumi {' '.join(argv[:2])}` failed for stack {stack.name}: "
            f"{lines[0] if lines else 'no error message'}; {MEASURED_KEY} may be partly set: check "
            f"`pulumi config --stack {stack.name}` and run `trainstack weights --apply` again"
        )


def run(
    clients: Clients,
    stack: Stack,
    *,
    family: str | None = None,
    job: str | None = None,
    do_apply: bool = False,
    as_json: bool = False,
) -> int:
    settings = _settings(stack)
    current = dict(settings.measured_throughput)
    proposal = propose(read_table(clients, stack), settings.pools, current, family=family, job=job)
    if do_apply and not proposal.to_set:
        raise CliError(
            f"nothing measured for {MIN_HOURS:g} h or more on the pools' types yet, so nothing to set; "
            f"{MEASURED_KEY} is left as it is (to go back to the shipped estimate: `pulumi config rm "
            f"{MEASURED_KEY}`)"
        )
    applied = do_apply and proposal.changes
    if applied:
        apply(stack, proposal)
    if as_json:
        print_json({**proposal.to_json(), "applied": applied})
        return 0
    _print(stack, proposal, do_apply=do_apply, applied=applied)
    return 0


def _weight(value: int | None) -> str:
    return "-" if value is None else str(value)


def _print(stack: Stack, proposal: Proposal, *, do_apply: bool, applied: bool) -> None:
    out = console()
    table = Table(title=f"Weights of stack {stack.name}'s pools")
    for column in ("Pool", "Type", "Shipped (x T4)", "Measured samples/s", "Hours", "Lives"):
        table.add_column(column, justify="left" if column in ("Pool", "Type") else "right")
    table.add_column("Weight now", justify="right")
    table.add_column("Weight to set", justify="right")
    table.add_column("From")
    for pool in proposal.pools:
        for row in pool.types:
            table.add_row(
                pool.name,
                row.instance_type,
                "-" if row.shipped is None else f"{row.shipped:g}",
                "-" if row.measured is None else f"{row.measured:,.1f}",
                f"{row.hours:.2f}" if row.lives else "-",
                str(row.lives) if row.lives else "-",
                _weight(row.weight_now),
                _weight(row.weight_to_set),
                "-" if pool.unweighted_because else "measured" if row.used else "estimated",
            )
    out.print(table)
    for pool in proposal.pools:
        if pool.unweighted_because:
            out.print(f"pool {pool.name}: unweighted whatever is measured ({pool.unweighted_because})")
    if not proposal.scope:
        out.print("no measured lives on the pools' types yet: every weight stays the shipped estimate")
    else:
        out.print(f"measured: the lives of {proposal.scope}")
    for line in proposal.left_out:
        out.print(f"not used: {line}")
    if proposal.other_scopes:
        out.print(f"also measured: {', '.join(proposal.other_scopes)}")
    if not proposal.changes:
        out.print(f"{MEASURED_KEY} already holds these figures; nothing to change")
    elif applied:
        out.print(
            f"set {MEASURED_KEY} for stack {stack.name}; review the new weights with `pulumi preview "
            "--diff`, then `pulumi up`"
        )
    elif not do_apply and proposal.to_set:
        out.print(f"`trainstack weights --apply` sets {MEASURED_KEY} to these figures")
