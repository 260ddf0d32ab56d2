"""The agent's cost meter against moto (EC2 spot history, S3 listing) and a stubbed Pricing API."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from bootstrap.imds import InstanceIdentity
from bootstrap.pricing import (
    GP3_USD_PER_GB_MONTH,
    HOURS_PER_MONTH,
    ON_DEMAND_FALLBACK_USD_PER_HOUR,
    S3_STANDARD_USD_PER_GB_MONTH,
    BucketUsage,
    CostMeter,
    spot_cost_usd,
)

REGION = "us-east-1"
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
SPOT = InstanceIdentity("i-1", "g6.xlarge", "us-east-1a", REGION, "spot")
ON_DEMAND = InstanceIdentity("i-2", "g6.xlarge", "us-east-1a", REGION, "on-demand")


def _pricing(usd: str | None) -> Any:
    """A Pricing client that answers one GetProducts with `usd` per hour (None: access denied)."""
    client = boto3.client("pricing", region_name="us-east-1")
    stub = Stubber(client)
    if usd is None:
        stub.add_client_error("get_products", "AccessDeniedException", "not authorized")
    else:
        product = {"terms": {"OnDemand": {"t": {"priceDimensions": {"d": {"pricePerUnit": {"USD": usd}}}}}}}
        stub.add_response("get_products", {"PriceList": [json.dumps(product)], "FormatVersion": "aws_v1"})
    stub.activate()
    return client


def _meter(aws: Any, pricing: Any, **more: Any) -> CostMeter:
    settings: dict[str, Any] = {"root_volume_gb": 0, "bucket_usage": None, **more}
    return CostMeter(ec2=boto3.client("ec2", region_name=REGION), pricing=pricing, region=REGION, **settings)


def test_spot_life_is_priced_from_moto_spot_history_in_its_zone(aws: Any) -> None:
    now = datetime.now(timezone.utc)
    quote = _meter(aws, _pricing(None)).quote(SPOT, now - timedelta(hours=2), now)
    # moto's history is one flat price per AZ since 2006: two hours of it.
    assert quote.purchase_option == "spot" and quote.price_usd_per_hour is not None
    assert quote.instance_cost_usd == pytest.approx(2 * quote.price_usd_per_hour)
    assert quote.price_source.startswith("spot price history us-east-1a")


def test_on_demand_life_is_priced_by_the_pricing_api(aws: Any) -> None:
    quote = _meter(aws, _pricing("0.8048")).quote(ON_DEMAND, T0, T0 + timedelta(hours=3))
    assert (quote.price_usd_per_hour, quote.price_source) == (0.8048, "AWS Pricing API, on-demand us-east-1")
    assert quote.instance_cost_usd == pytest.approx(3 * 0.8048) and quote.price_note is None


def test_on_demand_price_falls_back_to_the_built_in_table_labelled_as_such(aws: Any) -> None:
    quote = _meter(aws, _pricing(None)).quote(ON_DEMAND, T0, T0 + timedelta(hours=1))
    assert quote.price_usd_per_hour == ON_DEMAND_FALLBACK_USD_PER_HOUR["g6.xlarge"]
    assert (
        quote.price_source.startswith("built-in on-demand table") and "not authorized" in quote.price_source
    )


def test_spot_history_is_read_again_only_after_fifteen_minutes(aws: Any) -> None:
    clock = [0.0]
    meter = _meter(aws, _pricing(None), clock=lambda: clock[0])
    ec2 = meter._ec2
    with Stubber(ec2) as stub:  # every call after the first must come from the cache, or the stub fails
        stub.add_response(
            "describe_spot_price_history",
            {"SpotPriceHistory": [{"AvailabilityZone": "us-east-1a", "Timestamp": T0, "SpotPrice": "0.5"}]},
        )
        for minutes in (0, 5, 14):
            clock[0] = minutes * 60
            assert meter.quote(SPOT, T0, T0 + timedelta(minutes=minutes)).price_usd_per_hour == 0.5
        stub.assert_no_pending_responses()


def test_time_weighted_spot_cost_edge_cases() -> None:
    points = [(T0, 1.0), (T0 + timedelta(hours=1), 3.0)]
    assert spot_cost_usd(points, T0, T0 + timedelta(hours=2)) == pytest.approx(4.0)
    assert spot_cost_usd(points, T0 + timedelta(minutes=30), T0 + timedelta(minutes=90)) == pytest.approx(2.0)
    assert spot_cost_usd(points, T0 - timedelta(hours=1), T0) == pytest.approx(1.0), "first price back-filled"
    assert spot_cost_usd([], T0, T0 + timedelta(hours=1)) == 0.0
    assert spot_cost_usd(points, T0, T0) == 0.0


def test_storage_prices_the_root_volume_and_the_listed_bucket_bytes(aws: Any) -> None:
    s3 = boto3.client("s3", region_name=REGION)
    s3.create_bucket(Bucket="job-bucket")
    s3.put_object(Bucket="job-bucket", Key="checkpoints/step-1/model.pt", Body=b"x" * 3000)
    s3.put_object(Bucket="job-bucket", Key="data/train/a/1.png", Body=b"x" * 2000)
    s3.put_object(Bucket="job-bucket", Key="results/model.pt", Body=b"x" * 9999)  # not job storage here
    usage = BucketUsage(s3, "job-bucket", ["checkpoints/", "data/"])
    meter = _meter(aws, _pricing(None), bucket_usage=usage, root_volume_gb=150, background_storage=False)
    expected = (150 * GP3_USD_PER_GB_MONTH + 5000 / 1e9 * S3_STANDARD_USD_PER_GB_MONTH) / HOURS_PER_MONTH
    assert meter.storage_usd_per_hour() == pytest.approx(expected)
    assert usage.bytes == 5000
