"""`trainstack prices`: spot price per AZ for the configured types beside on-demand, cheapest first.

Live from DescribeSpotPriceHistory (up to 90 days, per AZ) and the Price List API; with `--placement-scores`
also GetSpotPlacementScores, the risk signal. With no credentials or no network (or `--offline`) the figures
come from the shipped catalogue (trainstack/catalogue.py) and every output says "offline catalogue of DATE".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    PartialCredentialsError,
)
from rich.table import Table

from bootstrap.pricing import on_demand_price
from trainstack import catalogue
from trainstack.aws import Clients, explain
from trainstack.errors import CliError
from trainstack.output import console, format_usd, print_json
from trainstack.stack import Stack

PRODUCT = "Linux/UNIX"
# DescribeSpotPriceHistory answers for the past 90 days at most.
MAX_DAYS = catalogue.HISTORY_DAYS
# What means "nothing live to ask": the catalogue answers instead. An AWS refusal is not among them: it is
# said, as before, because the user has credentials and may want to fix them.
OFFLINE_ERRORS = (NoCredentialsError, PartialCredentialsError, EndpointConnectionError, ConnectTimeoutError)
# The Advisor's monthly interruption bands, the same as bench/cost.py and training/checkpoint_policy.py.
BANDS: tuple[tuple[float, float], ...] = ((0.0, 0.05), (0.05, 0.10), (0.10, 0.15), (0.15, 0.20), (0.20, 0.30))


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


def check_days(days: float) -> float:
    if not 0 < days <= MAX_DAYS:
        raise CliError(
            f"--days {days:g}: AWS keeps spot price history for {MAX_DAYS} days; give 0 < days <= 90"
        )
    return days


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


@dataclass(frozen=True)
class Risk:
    """A type's interruption risk: its monthly band (low, high) and where it came from."""

    band: tuple[float, float]
    source: str
    placement_score: int | None = None


@dataclass
class PriceSet:
    """Prices for a set of types and what they are: live (and over which window) or the offline catalogue."""

    rows: list[SpotPrice]
    notes: list[str]
    source: str
    offline: bool
    risks: dict[str, Risk] = field(default_factory=dict)


def band_from_score(score: int) -> tuple[float, float]:
    """A placement score (1-10: how likely a spot request of that size succeeds) read as an interruption band.
    A heuristic, not AWS's: plentiful capacity is reclaimed less often. 9-10 -> <5%, 7-8 -> 5-10%,
    5-6 -> 10-15%, 3-4 -> 15-20%, 1-2 -> >20%."""
    index = min(len(BANDS) - 1, max(0, (10 - max(1, min(10, score))) // 2))
    return BANDS[index]


def placement_scores(clients: Clients, types: list[str], region: str, capacity: int) -> dict[str, int]:
    """GetSpotPlacementScores per type (AWS scores a set of types together, so one call each), in `region`."""
    scores: dict[str, int] = {}
    for name in types:
        answer = clients.ec2().get_spot_placement_scores(
            InstanceTypes=[name],
            TargetCapacity=max(1, capacity),
            TargetCapacityUnitType="units",
            SingleAvailabilityZone=False,
            RegionNames=[region],
        )
        found = [s["Score"] for s in answer.get("SpotPlacementScores", []) if s.get("Region") == region]
        if found:
            scores[name] = int(max(found))
    return scores


def offline_prices(types: list[str], region: str, why: str) -> PriceSet:
    """The shipped catalogue's figures for `types`, labelled as such."""
    rows: list[SpotPrice] = []
    notes = [f"{catalogue.label()} ({why}): not live prices", *catalogue.sources()]
    for name in types:
        entry = catalogue.lookup(region, name)
        if entry is None:
            notes.append(f"{name} in {region}: not in the {catalogue.label()}")
            continue
        spot = entry.spot_usd_per_hour
        rows.append(SpotPrice(name, f"{region} (catalogue)", spot, spot, spot, entry.on_demand_usd_per_hour))
    rows.sort(key=lambda r: (r.spot_usd_per_hour, r.instance_type))
    return PriceSet(rows, notes, catalogue.label(), offline=True, risks=catalogue_risks(types, region))


def catalogue_risks(types: list[str], region: str) -> dict[str, Risk]:
    risks = {}
    for name in types:
        entry = catalogue.lookup(region, name)
        if entry is not None and entry.band is not None:
            risks[name] = Risk(entry.band, f"{catalogue.BAND_SOURCE}, {catalogue.label()}")
    return risks


def gather(
    clients: Clients,
    types: list[str],
    region: str,
    *,
    days: float,
    offline: bool = False,
    scores: bool = False,
    capacity: int = 1,
) -> PriceSet:
    """Live prices (and placement scores when asked), else the catalogue when there is nothing live to ask."""
    if offline:
        return offline_prices(types, region, "--offline")
    try:
        rows, notes = collect(clients, types, region, check_days(days))
    except OFFLINE_ERRORS as error:
        return offline_prices(types, region, f"no live prices: {explain(error)}")
    found = PriceSet(
        rows,
        notes,
        f"live: DescribeSpotPriceHistory, last {days:g} day(s)",
        offline=False,
        risks=catalogue_risks(types, region),
    )
    if scores:
        try:
            for name, score in placement_scores(clients, types, region, capacity).items():
                found.risks[name] = Risk(
                    band_from_score(score), f"spot placement score {score}/10 (GetSpotPlacementScores)", score
                )
        except (BotoCoreError, ClientError) as error:
            # Prices still answer; the ranking falls back to the catalogue's band or the default one.
            found.notes.append(f"spot placement scores unavailable: {explain(error)}")
    return found


def run(
    clients: Clients,
    stack: Stack,
    *,
    types: list[str] | None,
    days: float,
    as_json: bool,
    offline: bool = False,
    scores: bool = False,
) -> int:
    config = stack.config
    region = clients.region or config.region
    if not region:
        raise CliError("no AWS region: `pulumi config set aws:region us-east-1`, or pass --region")
    chosen = types or list(config.instance_types)
    found = gather(clients, chosen, region, days=days, offline=offline, scores=scores)
    rows, notes = found.rows, found.notes
    if as_json:
        print_json(
            {
                "region": region,
                "window_days": None if found.offline else days,
                "source": found.source,
                "offline": found.offline,
                "prices": [{**asdict(r), "saving": r.saving} for r in rows],
                "risks": {name: asdict(risk) for name, risk in found.risks.items()},
                "notes": notes,
            }
        )
        return 0
    when = found.source if found.offline else f"last {days:g} day(s)"
    table = Table(title=f"spot vs on-demand, {region}, Linux, {when}, cheapest first")
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
    for name, risk in sorted(found.risks.items()):
        out.print(f"risk: {name}: {_band(risk.band)} interrupted per month, from {risk.source}", markup=False)
    for note in notes:
        out.print(f"note: {note}", markup=False)
    return 0


def _band(band: tuple[float, float]) -> str:
    low, high = band
    return (
        f"<{100 * high:g}%"
        if low == 0
        else f">{100 * low:g}%"
        if high >= 0.30
        else f"{100 * low:g}-{100 * high:g}%"
    )
