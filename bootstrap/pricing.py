"""The hourly price of this instance: the current spot price of its type in its AZ."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Protocol


class PriceLookup(Protocol):
    def __call__(self, instance_type: str, az: str) -> float | None: ...


class SpotPriceLookup:
    """`describe_spot_price_history` for one type and AZ, newest entry; None when EC2 has no price for it."""

    def __init__(self, ec2: Any) -> None:
        self._ec2 = ec2

    def __call__(self, instance_type: str, az: str) -> float | None:
        response = self._ec2.describe_spot_price_history(
            InstanceTypes=[instance_type],
            AvailabilityZone=az,
            ProductDescriptions=["Linux/UNIX", "Linux/UNIX (Amazon VPC)"],
            StartTime=datetime.now(timezone.utc),
        )
        # Filter again here: not every endpoint honours the AZ filter.
        entries = [e for e in response.get("SpotPriceHistory", []) if e.get("AvailabilityZone") == az]
        if not entries:
            return None
        newest = max(entries, key=lambda e: e["Timestamp"])
        return float(newest["SpotPrice"])
