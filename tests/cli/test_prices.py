"""`trainstack prices`: the latest spot price per AZ beside on-demand, cheapest first."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import ANY, Stubber

from trainstack.aws import PRICING_REGION, Clients
from trainstack.prices import collect

from .conftest import REGION, STACK, Result, write_project


def _price_list(usd: str) -> str:
    """One Price List API product, trimmed to the fields an on-demand price is read from."""
    return json.dumps(
        {
            "product": {"attributes": {"instanceType": "g6.xlarge", "regionCode": REGION}},
            "terms": {
                "OnDemand": {
                    "TERM.A": {
                        "priceDimensions": {"TERM.A.DIM": {"unit": "Hrs", "pricePerUnit": {"USD": usd}}}
                    }
                }
            },
        }
    )


def _pricing_filters(instance_type: str) -> list[dict[str, str]]:
    values = {
        "instanceType": instance_type,
        "regionCode": REGION,
        "operatingSystem": "Linux",
        "tenancy": "Shared",
        "preInstalledSw": "NA",
        "capacitystatus": "Used",
        "licenseModel": "No License required",
    }
    return [{"Type": "TERM_MATCH", "Field": k, "Value": v} for k, v in values.items()]


class Pricing:
    """FAKE at the client boundary: moto has no Price List API; a stubbed client answers the exact
    get_products requests the CLI builds, with responses in the real API's shape."""

    def __init__(self) -> None:
        self.client = boto3.client("pricing", region_name=PRICING_REGION)
        self.stub = Stubber(self.client)

    def on_demand(self, instance_type: str, usd: str) -> Pricing:
        self.stub.add_response(
            "get_products",
            {"PriceList": [_price_list(usd)], "FormatVersion": "aws_v1"},
            {
                "ServiceCode": "AmazonEC2",
                "Filters": _pricing_filters(instance_type),
                "FormatVersion": "aws_v1",
                "MaxResults": 10,
            },
        )
        return self

    def denied(self) -> Pricing:
        self.stub.add_client_error(
            "get_products", "AccessDeniedException", "not authorized to perform pricing:GetProducts"
        )
        return self

    def clients(self, **more: Any) -> Clients:
        self.stub.activate()
        return Clients(REGION, overrides={"pricing": self.client, **more})


def test_latest_price_per_az_is_shown_with_the_window_range_cheapest_first():
    # FAKE at the client boundary as well: moto's spot history is one flat price for every AZ,
    # which cannot show "latest" or "cheapest first".
    ec2 = boto3.client("ec2", region_name=REGION)
    ec2_stub = Stubber(ec2)
    now = datetime.now(timezone.utc)
    history = [
        ("g6.xlarge", "us-east-1a", now - timedelta(hours=5), "0.40"),
        ("g6.xlarge", "us-east-1a", now - timedelta(hours=1), "0.30"),
        ("g6.xlarge", "us-east-1b", now - timedelta(hours=2), "0.25"),
        ("g6.xlarge", "us-east-1b", now - timedelta(hours=6), "0.20"),
    ]
    ec2_stub.add_response(
        "describe_spot_price_history",
        {
            "SpotPriceHistory": [
                {
                    "InstanceType": t,
                    "AvailabilityZone": az,
                    "Timestamp": ts,
                    "SpotPrice": p,
                    "ProductDescription": "Linux/UNIX",
                }
                for t, az, ts, p in history
            ]
        },
        {"InstanceTypes": ["g6.xlarge"], "ProductDescriptions": ["Linux/UNIX"], "StartTime": ANY},
    )
    ec2_stub.activate()
    pricing = Pricing().on_demand("g6.xlarge", "0.8048000000")

    rows, notes = collect(pricing.clients(ec2=ec2), ["g6.xlarge"], REGION, days=1)

    assert [(r.az, r.spot_usd_per_hour, r.low_usd_per_hour, r.high_usd_per_hour) for r in rows] == [
        ("us-east-1b", 0.25, 0.20, 0.25),
        ("us-east-1a", 0.30, 0.30, 0.40),
    ]
    assert rows[0].on_demand_usd_per_hour == pytest.approx(0.8048)
    assert rows[0].saving == pytest.approx(1 - 0.25 / 0.8048)
    assert notes == []


@pytest.fixture()
def prices(aws: Any, tmp_path: Path, cli: Callable[..., Result]) -> Callable[..., Result]:
    project = write_project(
        tmp_path, {"aws:region": REGION, "trainstack:instanceTypes": ["g6.xlarge", "g5.xlarge"]}
    )

    def run(pricing: Pricing, *flags: str) -> Result:
        return cli("prices", "--cwd", str(project), "--stack", STACK, *flags, clients=pricing.clients())

    return run


def test_prices_table_lists_every_az_of_every_configured_type(prices: Callable[..., Result]):
    pricing = Pricing().on_demand("g6.xlarge", "0.8048").on_demand("g5.xlarge", "1.006")

    result = prices(pricing)

    assert result.code == 0, result.err
    rows = [line for line in result.out.splitlines() if "xlarge" in line and "us-east-1" in line]
    assert {line.split("│")[1].strip() for line in rows} == {"g6.xlarge", "g5.xlarge"}
    assert any("$0.8048" in line and "100%" in line for line in rows)  # moto's flat $0.00001 spot price
    pricing.stub.assert_no_pending_responses()


def test_prices_json_and_a_type_option(prices: Callable[..., Result]):
    result = prices(
        Pricing().on_demand("g4dn.xlarge", "0.526"), "--type", "g4dn.xlarge", "--json", "--days", "7"
    )

    assert result.code == 0, result.err
    report = result.json()
    assert report["window_days"] == 7
    assert {p["instance_type"] for p in report["prices"]} == {"g4dn.xlarge"}
    assert all(p["on_demand_usd_per_hour"] == pytest.approx(0.526) for p in report["prices"])


def test_prices_without_pricing_permission_still_show_spot_and_say_why(prices: Callable[..., Result]):
    result = prices(Pricing().denied(), "--type", "g6.xlarge")

    assert result.code == 0, result.err
    assert (
        "note: on-demand price of g6.xlarge unavailable: permission denied: GetProducts was refused"
        in result.out
    )
    assert "us-east-1a" in result.out
