"""The offline price catalogue: what `trainstack prices` and `estimate` show without credentials or network.

Per region and instance type: the on-demand price, a typical spot price and the Spot Instance Advisor's
interruption band, each with where it came from and when. Kept in Python rather than a data file so it ships
in the wheel with no package-data entry. Every line that uses it says "offline catalogue of <date>" so
nobody takes it for live prices.

Refresh (needs ec2:DescribeSpotPriceHistory and pricing:GetProducts):

    python -m trainstack.catalogue --region us-east-1 --type g5.xlarge --type g6.xlarge

prints the 90-day median spot price of each type's cheapest AZ and its on-demand price, dated, to paste
over the region's entries below.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from bootstrap.pricing import on_demand_price
from trainstack.aws import Clients

AS_OF = "2026-12-07"
ON_DEMAND_SOURCE = (
    "AWS EC2 On-Demand pricing, https://aws.amazon.com/ec2/pricing/on-demand/ (Linux, shared tenancy; "
    "us-east-1 and us-west-2 list the same price for these types); compiled 2026-12-07"
)
# Said plainly: the shipped spot figures were not read from the spot price history. They are the 0.30 x
# on-demand ratio bench/cost.py assumes, until someone with credentials runs the refresh above.
SPOT_SOURCE = (
    "assumed 0.30 x on-demand (bench/cost.py), not a measured spot price; refresh from "
    "DescribeSpotPriceHistory with `python -m trainstack.catalogue`"
)
BAND_SOURCE = "Spot Instance Advisor, https://aws.amazon.com/ec2/spot/instance-advisor/"
# AWS keeps 90 days of spot price history (DescribeSpotPriceHistory: "up to the past 90 days").
HISTORY_DAYS = 90


@dataclass(frozen=True)
class Entry:
    """One type in one region. `band`: the Advisor's monthly interruption band (low, high) when recorded."""

    on_demand_usd_per_hour: float
    spot_usd_per_hour: float
    band: tuple[float, float] | None = None


def _assumed(on_demand: float) -> Entry:
    return Entry(on_demand, round(0.30 * on_demand, 4))


_LIST_PRICES = {
    "g4dn.xlarge": 0.526,
    "g4dn.2xlarge": 0.752,
    "g5.xlarge": 1.006,
    "g5.2xlarge": 1.212,
    "g6.xlarge": 0.8048,
    "g6.2xlarge": 0.9776,
    "g6e.xlarge": 1.861,
}
CATALOGUE: dict[str, dict[str, Entry]] = {
    region: {name: _assumed(usd) for name, usd in _LIST_PRICES.items()}
    for region in ("us-east-1", "us-west-2")
}


def label() -> str:
    """The words every offline figure is shown under."""
    return f"offline catalogue of {AS_OF}"


def sources() -> list[str]:
    return [f"on-demand: {ON_DEMAND_SOURCE}", f"spot: {SPOT_SOURCE}"]


def lookup(region: str, instance_type: str) -> Entry | None:
    return CATALOGUE.get(region, {}).get(instance_type)


def measured(clients: Clients, types: list[str], region: str, days: float = HISTORY_DAYS) -> dict[str, Entry]:
    """Live entries: each type's cheapest AZ by median spot price over `days`, and its on-demand price."""
    since = datetime.now(timezone.utc) - timedelta(days=days)
    medians: dict[str, float] = {}
    paginator = clients.ec2().get_paginator("describe_spot_price_history")
    per_zone: dict[tuple[str, str], list[float]] = {}
    # Built as a plain dict: the stubs type InstanceTypes as a Literal of every known type name.
    request: dict[str, Any] = {
        "InstanceTypes": types,
        "ProductDescriptions": ["Linux/UNIX"],
        "StartTime": since,
    }
    for page in paginator.paginate(**request):
        for point in page["SpotPriceHistory"]:
            key = (point["InstanceType"], point["AvailabilityZone"])
            per_zone.setdefault(key, []).append(float(point["SpotPrice"]))
    for (name, _), prices in per_zone.items():
        median = statistics.median(prices)
        medians[name] = min(median, medians.get(name, median))
    entries = {}
    for name, spot in medians.items():
        on_demand = on_demand_price(clients.pricing(), name, region)
        if on_demand is not None:
            entries[name] = Entry(on_demand, spot)
    return entries


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m trainstack.catalogue", description=__doc__)
    parser.add_argument("--region", required=True)
    parser.add_argument("--type", action="append", dest="types", required=True, metavar="TYPE")
    parser.add_argument("--days", type=float, default=HISTORY_DAYS)
    args = parser.parse_args(argv)
    entries = measured(Clients(args.region), args.types, args.region, args.days)
    today = datetime.now(timezone.utc).date().isoformat()
    print(
        f"# {args.region}, read {today}: {args.days:g}-day median spot (cheapest AZ), "
        "on-demand from GetProducts"
    )
    for name, entry in sorted(entries.items()):
        print(f'    "{name}": Entry({entry.on_demand_usd_per_hour}, {round(entry.spot_usd_per_hour, 4)}),')
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
