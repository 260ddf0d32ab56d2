"""`trainstack prices`: spot price per AZ for the configured types beside on-demand, cheapest first."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError
from rich.table import Table

from bootstrap.pricing import on_demand_price
from trainstack.aws import Clients, explain
from trainstack.errors import CliError
from trainstack.output import console, format_usd, print_json
from trainstack.stack import Stack

PRODUCT = "Linux/UNIX"


@dataclass(frozen=True)
class SpotPrice:
    instance_type: str
    az: str
    spot_usd_per_hour: float  # the latest price in effect
    low_usd_per_hour: float  # over the window
    high_usd_per_hour: float
    on_demand_usd_per_hour: float | None

    @property
    def saving(self) -> float | None:
        if not self.on_demand_usd_per_hour:
            return None
        return 1 - self.spot_usd_per_hour / self.on_demand_usd_per_hour


def spot_history(
    clients: Clients, types: list[str], since: datetime
) -> dict[tuple[str, str], list[tuple[datetime, float]]]:
    """(type, AZ) → [(time, price)] for Linux, the seeds' `describe-spot-price-history` query."""
    history: dict[tuple[str, str], list[tuple[datetime, float]]] = {}
    paginator = clients.ec2().get_paginator("describe_spot_price_history")
    request: dict[str, Any] = {"InstanceTypes": types, "ProductDescriptions": [PRODUCT], "StartTime": since}
    for page in paginator.paginate(**request):
        for entry in page["SpotPriceHistory"]:
            key = (entry["InstanceType"], entry["AvailabilityZone"])
            history.setdefault(key, []).append((entry["Timestamp"], float(entry["SpotPrice"])))
    return history


def collect(
    clients: Clients, types: list[str], region: str, days: float
) -> tuple[list[SpotPrice], list[str]]:
    since = datetime.now(timezone.utc) - timedelta(days=days)
    history = spot_history(clients, types, since)
    notes: list[str] = []
    on_demand: dict[str, float | None] = {}
    for name in types:
        try:
            # The agent prices its lives with the same catalogue query: one definition of "on-demand price".
            on_demand[name] = on_demand_price(clients.pricing(), name, region)
        except (BotoCoreError, ClientError) as error:
            # Spot prices alone still answer the question; say why the comparison is missing.
            notes.append(f"on-demand price of {name} unavailable: {explain(error)}")
            on_demand[name] = None
    rows = []
    for (name, az), points in history.items():
        points.sort()
        prices = [p for _, p in points]
        rows.append(SpotPrice(name, az, points[-1][1], min(prices), max(prices), on_demand.get(name)))
    missing = sorted(set(types) - {name for name, _ in history})
    notes += [f"no spot price for {name} in {region}: not offered as spot there" for name in missing]
    rows.sort(key=lambda r: (r.spot_usd_per_hour, r.instance_type, r.az))
    return rows, notes


def run(clients: Clients, stack: Stack, *, types: list[str] | None, days: float, as_json: bool) -> int:
    config = stack.config
    region = clients.region or config.region
    if not region:
        raise CliError("no AWS region: `pulumi config set aws:region us-east-1`, or pass --region")
    chosen = types or list(config.instance_types)
    rows, notes = collect(clients, chosen, region, days)
    if as_json:
        print_json(
            {
                "region": region,
                "window_days": days,
                "prices": [{**asdict(r), "saving": r.saving} for r in rows],
                "notes": notes,
            }
        )
        return 0
    table = Table(title=f"spot vs on-demand, {region}, Linux, last {days:g} day(s), cheapest first")
    for column in ("type", "AZ", "spot now", "low", "high", "on-demand", "saving"):
        table.add_column(column, justify="left" if column in {"type", "AZ"} else "right")
    for r in rows:
        table.add_row(
            r.instance_type,
            r.az,
            format_usd(r.spot_usd_per_hour, 4),
            format_usd(r.low_usd_per_hour, 4),
            format_usd(r.high_usd_per_hour, 4),
            format_usd(r.on_demand_usd_per_hour, 4),
            "-" if r.saving is None else f"{100 * r.saving:.0f}%",
        )
    out = console()
    out.print(table)
    for note in notes:
        out.print(f"note: {note}", markup=False)
    return 0
