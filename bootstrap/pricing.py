"""What an instance life costs: its instance by purchase option, its root volume and the job's bucket.

A spot life is priced from the spot price history of its type in its AZ (a time-weighted integral over the
life: the price steps a few times a day), an on-demand life at the on-demand list price (AWS Pricing API, or
the built-in table below when the API cannot answer). Storage is priced pro rata at list prices: the root gp3
volume, and the bytes under the bucket's checkpoints/ and data/ prefixes (ListObjectsV2, at most hourly, off
the caller's thread: the state poller that calls `quote` also carries `trainstack stop` and the cost cap).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Protocol

from bootstrap import aws
from bootstrap.imds import InstanceIdentity

HOURS_PER_MONTH = 730.0
SPOT_REFRESH_SECONDS = 15 * 60.0
STORAGE_REFRESH_SECONDS = 3600.0
# us-east-1 list prices, USD per GB-month: https://aws.amazon.com/ebs/pricing/ (gp3 storage) and
# https://aws.amazon.com/s3/pricing/ (S3 Standard, first 50 TB). Other regions differ by a few percent.
GP3_USD_PER_GB_MONTH = 0.08
S3_STANDARD_USD_PER_GB_MONTH = 0.023
# On-demand, Linux, shared tenancy, us-east-1 (https://aws.amazon.com/ec2/pricing/on-demand/), USD per hour:
# used only when the Pricing API cannot answer, and labelled as such in the ledger's `price_source`.
ON_DEMAND_FALLBACK_USD_PER_HOUR = {
    "g4dn.xlarge": 0.526,
    "g5.xlarge": 1.006,
    "g5.2xlarge": 1.212,
    "g6.xlarge": 0.8048,
    "g6.2xlarge": 0.9776,
    "g6e.xlarge": 1.861,
    "p3.2xlarge": 3.06,
}
SPOT_PRODUCTS = ["Linux/UNIX", "Linux/UNIX (Amazon VPC)"]
PricePoints = Sequence[tuple[datetime, float]]


class PriceLookup(Protocol):
    def __call__(self, instance_type: str, az: str) -> float | None: ...


@dataclass(frozen=True)
class LifeQuote:
    """One life's prices as of a heartbeat: the ledger records them and integrates between heartbeats."""

    purchase_option: str  # "spot" or "on-demand"
    price_source: str
    price_usd_per_hour: float | None
    # Exact instance cost since the life started, where the meter knows it (None: price × time).
    instance_cost_usd: float | None
    storage_usd_per_hour: float
    price_note: str | None = None


def spot_cost_usd(points: PricePoints, start: datetime, end: datetime) -> float:
    """The integral of a step price over [start, end]: each price holds from its timestamp to the next.

    The price in effect at `start` is the newest point at or before it (DescribeSpotPriceHistory returns it);
    a history that begins after `start` is extended back with its first price.
    """
    if end <= start or not points:
        return 0.0
    ordered = sorted(points)
    total = 0.0
    for i, (moment, price) in enumerate(ordered):
        step_start = start if i == 0 else max(start, moment)
        step_end = min(end, ordered[i + 1][0]) if i + 1 < len(ordered) else end
        if step_end > step_start:
            total += price * (step_end - step_start).total_seconds() / 3600
    return total


def on_demand_price(pricing: Any, instance_type: str, region: str) -> float | None:
    """GetProducts: Linux, shared tenancy, no pre-installed software, capacity `Used` (what a running
    instance pays); None when the catalogue has no such product."""
    filters = {
        "instanceType": instance_type,
        "regionCode": region,
        "operatingSystem": "Linux",
        "tenancy": "Shared",
        "preInstalledSw": "NA",
        "capacitystatus": "Used",
        "licenseModel": "No License required",
    }
    response = pricing.get_products(
        ServiceCode="AmazonEC2",
        Filters=[{"Type": "TERM_MATCH", "Field": k, "Value": v} for k, v in filters.items()],
        FormatVersion="aws_v1",
        MaxResults=10,
    )
    for document in response.get("PriceList", []):
        product = json.loads(document) if isinstance(document, str) else document
        for term in product.get("terms", {}).get("OnDemand", {}).values():
            for dimension in term.get("priceDimensions", {}).values():
                usd = dimension.get("pricePerUnit", {}).get("USD")
                if usd is not None and float(usd) > 0:
                    return float(usd)
    return None


class SpotPriceLookup:
    """`describe_spot_price_history` for one type and AZ, newest entry; None when EC2 has no price for it."""

    def __init__(self, ec2: Any) -> None:
        self._ec2 = ec2

    def __call__(self, instance_type: str, az: str) -> float | None:
        response = self._ec2.describe_spot_price_history(
            InstanceTypes=[instance_type],
            AvailabilityZone=az,
            ProductDescriptions=SPOT_PRODUCTS,
            StartTime=datetime.now(timezone.utc),
        )
        # Filter again here: not every endpoint honours the AZ filter.
        entries = [e for e in response.get("SpotPriceHistory", []) if e.get("AvailabilityZone") == az]
        if not entries:
            return None
        newest = max(entries, key=lambda e: e["Timestamp"])
        return float(newest["SpotPrice"])


def spot_history(
    ec2: Any, instance_type: str, az: str, start: datetime, end: datetime
) -> list[tuple[datetime, float]]:
    """The price steps of one type in one AZ between start and end (the one in effect at start included)."""
    paginator = ec2.get_paginator("describe_spot_price_history")
    points: list[tuple[datetime, float]] = []
    request = {
        "InstanceTypes": [instance_type],
        "AvailabilityZone": az,
        "ProductDescriptions": SPOT_PRODUCTS,
        "StartTime": start,
        "EndTime": end,
    }
    for page in paginator.paginate(**request):
        for entry in page.get("SpotPriceHistory", []):
            if entry.get("AvailabilityZone") == az:
                points.append((entry["Timestamp"], float(entry["SpotPrice"])))
    # Both product descriptions may list the same step.
    return sorted(set(points))


class BucketUsage:
    """Bytes under some bucket prefixes, re-listed at most every `refresh_seconds` on a background thread."""

    def __init__(
        self,
        s3: Any,
        bucket: str,
        prefixes: Sequence[str],
        refresh_seconds: float = STORAGE_REFRESH_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._s3 = s3
        self._bucket = bucket
        self._prefixes = list(prefixes)
        self._refresh_seconds = refresh_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._listed_at: float | None = None
        self._running = False
        self.bytes: int | None = None
        self.error: str | None = None

    def refresh(self) -> None:
        """List the prefixes now (one ListObjectsV2 per 1000 keys) and keep the sum."""
        try:
            total = 0
            paginator = self._s3.get_paginator("list_objects_v2")
            for prefix in self._prefixes:
                for page in paginator.paginate(Bucket=self._bucket, Prefix=prefix):
                    total += sum(int(item.get("Size", 0)) for item in page.get("Contents", []))
            self.bytes, self.error = total, None
        except Exception as exc:  # the last sum stays: storage is a small share of the bill
            self.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        finally:
            with self._lock:
                self._listed_at = self._clock()
                self._running = False

    def current(self, background: bool = True) -> int | None:
        """The last sum; starts a new listing when the last one is older than the refresh period."""
        with self._lock:
            stale = self._listed_at is None or self._clock() - self._listed_at >= self._refresh_seconds
            start = stale and not self._running
            if start:
                self._running = True
        if start:
            if background:
                threading.Thread(target=self.refresh, name="bucket-usage", daemon=True).start()
            else:
                self.refresh()
        return self.bytes


class CostMeter:
    """Prices one life per heartbeat: instance by purchase option, plus root volume and bucket storage."""

    def __init__(
        self,
        *,
        ec2: Any,
        pricing: Any,
        region: str,
        root_volume_gb: float,
        bucket_usage: BucketUsage | None,
        fixed_price: PriceLookup | None = None,
        clock: Callable[[], float] = time.monotonic,
        background_storage: bool = True,
    ) -> None:
        self._ec2 = ec2
        self._pricing = pricing
        self._region = region
        self._root_volume_gb = root_volume_gb
        self.bucket_usage = bucket_usage
        # Injected hourly prices (the demo's simulated spot prices, tests): used for every purchase option.
        self.fixed_price = fixed_price
        self._clock = clock
        self._background_storage = background_storage
        self._spot: dict[tuple[str, str], tuple[float, datetime, list[tuple[datetime, float]]]] = {}
        self._on_demand: dict[str, tuple[float | None, str]] = {}

    @classmethod
    def for_agent(
        cls,
        *,
        ec2: Any,
        s3: Any,
        region: str,
        bucket: str,
        storage_prefixes: Sequence[str],
        root_volume_gb: float,
        fixed_price: PriceLookup | None = None,
    ) -> CostMeter:
        # The Pricing API answers from us-east-1 (and two other regions) whatever region is priced.
        return cls(
            ec2=ec2,
            pricing=aws.client("pricing", "us-east-1"),
            region=region,
            root_volume_gb=root_volume_gb,
            bucket_usage=BucketUsage(s3, bucket, storage_prefixes),
            fixed_price=fixed_price,
        )

    def storage_usd_per_hour(self) -> float:
        bucket_bytes = self.bucket_usage.current(self._background_storage) if self.bucket_usage else None
        per_month = self._root_volume_gb * GP3_USD_PER_GB_MONTH
        per_month += (bucket_bytes or 0) / 1e9 * S3_STANDARD_USD_PER_GB_MONTH
        return per_month / HOURS_PER_MONTH

    def quote(self, identity: InstanceIdentity, started_at: datetime, now: datetime) -> LifeQuote:
        """This life's instance cost since `started_at` and its hourly prices now."""
        option = "spot" if identity.lifecycle == "spot" else "on-demand"
        storage = self.storage_usd_per_hour()
        if self.fixed_price is not None:
            fixed = self.fixed_price(identity.instance_type, identity.az)
            return LifeQuote(option, "injected price lookup", fixed, None, storage)
        if option == "on-demand":
            listed, source = self._on_demand_price(identity.instance_type)
            if listed is not None:
                cost = listed * max(0.0, (now - started_at).total_seconds()) / 3600
                return LifeQuote(option, source, listed, cost, storage)
            # Better a low figure than none: the cost cap still acts, and the note says which way it errs.
            spot_price, spot_cost, _ = self._spot_quote(identity, started_at, now)
            note = "on-demand instance priced at the spot price (" + source + "); the bill will be higher"
            return LifeQuote(option, "spot price history (estimate)", spot_price, spot_cost, storage, note)
        spot_price, spot_cost, source = self._spot_quote(identity, started_at, now)
        return LifeQuote(option, source, spot_price, spot_cost, storage)

    def _spot_quote(
        self, identity: InstanceIdentity, started_at: datetime, now: datetime
    ) -> tuple[float | None, float | None, str]:
        key = (identity.instance_type, identity.az)
        cached = self._spot.get(key)
        if cached is None or self._clock() - cached[0] >= SPOT_REFRESH_SECONDS or cached[1] > started_at:
            try:
                # An hour before the start: the step in effect at the start is then surely listed.
                points = spot_history(self._ec2, *key, started_at - timedelta(hours=1), now)
            except Exception:
                if cached is None:
                    raise
                points = cached[2]  # a stale history beats none; the next heartbeat tries again
            cached = (self._clock(), started_at, points)
            self._spot[key] = cached
        points = cached[2]
        if not points:
            return None, None, f"no spot price for {identity.instance_type} in {identity.az}"
        in_force = [p for p in points if p[0] <= now] or points[:1]
        steps = len([p for p in points if started_at < p[0] <= now])
        source = f"spot price history {identity.az}, time-weighted over the life ({steps} price change(s))"
        return in_force[-1][1], spot_cost_usd(points, started_at, now), source

    def _on_demand_price(self, instance_type: str) -> tuple[float | None, str]:
        if instance_type not in self._on_demand:
            try:
                price = on_demand_price(self._pricing, instance_type, self._region)
                why = "no product in the catalogue"
            except Exception as exc:
                price, why = None, (str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            if price is not None:
                self._on_demand[instance_type] = (price, f"AWS Pricing API, on-demand {self._region}")
            elif instance_type in ON_DEMAND_FALLBACK_USD_PER_HOUR:
                self._on_demand[instance_type] = (
                    ON_DEMAND_FALLBACK_USD_PER_HOUR[instance_type],
                    f"built-in on-demand table (us-east-1 list price; Pricing API: {why})",
                )
            else:
                self._on_demand[instance_type] = (
                    None,
                    f"on-demand price unknown: Pricing API: {why}; {instance_type} not in the built-in table",
                )
        return self._on_demand[instance_type]
