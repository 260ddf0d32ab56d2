"""`trainstack estimate`: the configured job's cost per instance type, spot and on-demand, beside the cap."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from rich.table import Table

from trainstack.aws import Clients
from trainstack.errors import CliError
from trainstack.output import console, format_usd, print_json
from trainstack.prices import SpotPrice, collect
from trainstack.stack import NAMESPACE, Stack

HOURS_KEY = f"{NAMESPACE}:expectedHours"
CAP_KEY = f"{NAMESPACE}:maxCostUsd"


@dataclass(frozen=True)
class TypeCost:
    """One instance type: its hourly prices now and the whole job at those prices."""

    instance_type: str
    spot_usd_per_hour: float | None  # the cheapest AZ's price in effect now
    on_demand_usd_per_hour: float | None
    spot_job_usd: float | None
    on_demand_job_usd: float | None


@dataclass(frozen=True)
class Estimate:
    stack: str
    region: str
    instance_count: int
    expected_hours: float | None
    max_cost_usd: float | None
    types: list[TypeCost]
    notes: list[str]

    def cheapest(self) -> TypeCost | None:
        priced = [t for t in self.types if t.spot_job_usd is not None]
        return min(priced, key=lambda t: t.spot_job_usd or 0.0) if priced else None

    def most_expensive(self) -> TypeCost | None:
        """The dearest type at its dearest purchase option (on-demand: what the capacity fallback pays)."""
        priced = [t for t in self.types if _dearest(t) is not None]
        return max(priced, key=lambda t: _dearest(t) or 0.0) if priced else None


def _dearest(cost: TypeCost) -> float | None:
    known = [c for c in (cost.spot_job_usd, cost.on_demand_job_usd) if c is not None]
    return max(known) if known else None


def project(
    rows: Sequence[SpotPrice], types: Sequence[str], instance_count: int, hours: float | None
) -> list[TypeCost]:
    """Instance count × expected hours × the price per type; the cheapest AZ for spot (the group's strategy
    picks across AZs). No hours: prices only."""
    costs = []
    for instance_type in types:
        own = [r for r in rows if r.instance_type == instance_type]
        spot = min((r.spot_usd_per_hour for r in own), default=None)
        on_demand = next((r.on_demand_usd_per_hour for r in own if r.on_demand_usd_per_hour), None)
        costs.append(
            TypeCost(
                instance_type=instance_type,
                spot_usd_per_hour=spot,
                on_demand_usd_per_hour=on_demand,
                spot_job_usd=_job(spot, instance_count, hours),
                on_demand_job_usd=_job(on_demand, instance_count, hours),
            )
        )
    return costs


def _job(price: float | None, instance_count: int, hours: float | None) -> float | None:
    if price is None or hours is None:
        return None
    return price * instance_count * hours


def build(clients: Clients, stack: Stack, *, hours: float | None) -> Estimate:
    config = stack.config
    region = clients.region or config.region
    if not region:
        raise CliError("no AWS region: `pulumi config set aws:region us-east-1`, or pass --region")
    # Read through the program's schema (trainstack/stack.py): the cap is the one the agent enforces.
    expected_hours = config.expected_hours if hours is None else hours
    max_cost = config.max_cost_usd
    types = list(config.instance_types)
    rows, notes = collect(clients, types, region, days=1)
    if expected_hours is None:
        notes.append(
            f"no job length: set {HOURS_KEY} (e.g. `pulumi config set {HOURS_KEY} 24`) or pass --hours"
        )
    return Estimate(
        stack=stack.name,
        region=region,
        instance_count=config.instance_count,
        expected_hours=expected_hours,
        max_cost_usd=max_cost,
        types=project(rows, types, config.instance_count, expected_hours),
        notes=notes,
    )


def verdict(estimate: Estimate) -> list[str]:
    """The lines under the table: the range, and where it stands against maxCostUsd."""
    cheapest, dearest = estimate.cheapest(), estimate.most_expensive()
    lines = []
    if cheapest is not None and dearest is not None:
        lines.append(
            f"cheapest: {cheapest.instance_type} on spot, {format_usd(cheapest.spot_job_usd)}; "
            f"most expensive: {dearest.instance_type} {_option(dearest)}, {format_usd(_dearest(dearest))}"
        )
        lines.append(
            "spot figures assume no interruption and today's prices "
            "(`python -m bench cost` replays interruptions)"
        )
    cap = estimate.max_cost_usd
    if cap is None:
        lines.append(f"{CAP_KEY}: not set (no cost cap)")
    elif cheapest is not None and dearest is not None:
        over = [t.instance_type for t in estimate.types if (_dearest(t) or 0.0) > cap]
        if (cheapest.spot_job_usd or 0.0) > cap:
            lines.append(
                f"{CAP_KEY} {format_usd(cap)}: even the cheapest type exceeds it; the job stops at the cap"
            )
        elif over:
            lines.append(
                f"{CAP_KEY} {format_usd(cap)}: {', '.join(over)} could exceed it (on-demand or a dear spot "
                "price); the job stops at the cap"
            )
        else:
            lines.append(f"{CAP_KEY} {format_usd(cap)}: every type fits, spot or on-demand")
    else:
        lines.append(f"{CAP_KEY} {format_usd(cap)}")
    return lines


def _option(cost: TypeCost) -> str:
    if cost.on_demand_job_usd is not None and cost.on_demand_job_usd >= (cost.spot_job_usd or 0.0):
        return "on demand"
    return "on spot"


def markdown(estimate: Estimate) -> str:
    """The pull-request comment: the same figures as a Markdown table."""
    hours = "?" if estimate.expected_hours is None else f"{estimate.expected_hours:g}"
    lines = [
        f"### trainstack estimate: `{estimate.stack}`, {estimate.region}, "
        f"{estimate.instance_count} instance(s) × {hours} h",
        "",
        "| type | spot now (cheapest AZ) | on-demand | job on spot | job on demand |",
        "|---|---:|---:|---:|---:|",
    ]
    for t in estimate.types:
        lines.append(
            f"| {t.instance_type} | {format_usd(t.spot_usd_per_hour, 4)}/h | "
            f"{format_usd(t.on_demand_usd_per_hour, 4)}/h | {format_usd(t.spot_job_usd)} | "
            f"{format_usd(t.on_demand_job_usd)} |"
        )
    lines.append("")
    lines += [f"- {line}" for line in [*verdict(estimate), *(f"note: {n}" for n in estimate.notes)]]
    return "\n".join(lines) + "\n"


def run(clients: Clients, stack: Stack, *, hours: float | None, as_json: bool, as_markdown: bool) -> int:
    estimate = build(clients, stack, hours=hours)
    if as_json:
        cheapest, dearest = estimate.cheapest(), estimate.most_expensive()
        print_json(
            {
                **asdict(estimate),
                "cheapest": None if cheapest is None else cheapest.instance_type,
                "most_expensive": None if dearest is None else dearest.instance_type,
            }
        )
        return 0
    out = console()
    if as_markdown:
        out.print(markdown(estimate), markup=False, end="")
        return 0
    hours_text = "?" if estimate.expected_hours is None else f"{estimate.expected_hours:g}"
    table = Table(
        title=f"projected job cost, stack {estimate.stack}, {estimate.region}: "
        f"{estimate.instance_count} instance(s) × {hours_text} h"
    )
    for column in ("type", "spot now", "on-demand", "job on spot", "job on demand"):
        table.add_column(column, justify="left" if column == "type" else "right")
    for t in estimate.types:
        table.add_row(
            t.instance_type,
            format_usd(t.spot_usd_per_hour, 4),
            format_usd(t.on_demand_usd_per_hour, 4),
            format_usd(t.spot_job_usd),
            format_usd(t.on_demand_job_usd),
        )
    out.print(table)
    for line in verdict(estimate):
        out.print(line, markup=False)
    for note in estimate.notes:
        out.print(f"note: {note}", markup=False)
    return 0
