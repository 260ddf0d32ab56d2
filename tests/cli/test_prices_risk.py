"""`trainstack prices` beyond the live table: the 90-day window, GetSpotPlacementScores as the risk signal,
and the offline catalogue when there is nothing live to ask."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.stub import ANY, Stubber

from trainstack import catalogue
from trainstack.aws import Clients
from trainstack.prices import BANDS, band_from_score, placement_scores

from .conftest import REGION, STACK, Result, write_project
from .test_prices import Pricing


def _scores(answers: dict[str, int], capacity: int = 1) -> Any:
    """FAKE at the client boundary: moto has no GetSpotPlacementScores; the stub checks each request the CLI
    builds (one per type) and answers in the real API's shape, with no network call."""
    ec2 = boto3.client("ec2", region_name=REGION)
    stub = Stubber(ec2)
    for name, score in answers.items():
        stub.add_response(
            "get_spot_placement_scores",
            {"SpotPlacementScores": [{"Region": REGION, "Score": score}]},
            {
                "InstanceTypes": [name],
                "TargetCapacity": capacity,
                "TargetCapacityUnitType": "units",
                "SingleAvailabilityZone": False,
                "RegionNames": [REGION],
            },
        )
    stub.activate()
    return ec2


class MotoHistoryWithScores:
    """One ec2 client as the CLI sees it: moto answers the price history, `scores` the placement scores."""

    def __init__(self, *, scores: Any) -> None:
        self._moto: Any = boto3.client("ec2", region_name=REGION)
        self._scores = scores

    def get_paginator(self, name: str) -> Any:
        return self._moto.get_paginator(name)

    def get_spot_placement_scores(self, **request: Any) -> Any:
        return self._scores.get_spot_placement_scores(**request)


@pytest.fixture()
def prices(tmp_path: Path, cli: Callable[..., Result]) -> Callable[..., Result]:
    project = write_project(tmp_path, {"aws:region": REGION, "trainstack:instanceTypes": ["g6.xlarge"]})

    def run(*flags: str, **clients: Any) -> Result:
        return cli(
            "prices",
            "--cwd",
            str(project),
            "--stack",
            STACK,
            *flags,
            clients=Clients(REGION, overrides=clients),
        )

    return run


def test_placement_scores_are_asked_per_type_and_read_as_a_band() -> None:
    ec2 = _scores({"g6.xlarge": 9, "g5.xlarge": 3}, capacity=2)

    found = placement_scores(Clients(REGION, overrides={"ec2": ec2}), ["g6.xlarge", "g5.xlarge"], REGION, 2)

    assert found == {"g6.xlarge": 9, "g5.xlarge": 3}
    assert band_from_score(9) == BANDS[0] and band_from_score(3) == BANDS[3]
    assert band_from_score(10) == (0.0, 0.05) and band_from_score(1) == (0.20, 0.30)


def test_prices_with_placement_scores_show_the_risk_and_its_source(
    aws: Any, prices: Callable[..., Result]
) -> None:
    # Spot history from moto (its flat price); the placement score from a stub, as moto lacks the call.
    ec2 = MotoHistoryWithScores(scores=_scores({"g6.xlarge": 8}))

    result = prices(
        "--placement-scores",
        "--json",
        ec2=ec2,
        pricing=Pricing().on_demand("g6.xlarge", "0.8048").clients().pricing(),
    )

    assert result.code == 0, result.err
    report = result.json()
    assert report["offline"] is False and report["source"].startswith("live: DescribeSpotPriceHistory")
    assert report["risks"]["g6.xlarge"]["placement_score"] == 8
    assert report["risks"]["g6.xlarge"]["band"] == [0.05, 0.10]
    assert {p["instance_type"] for p in report["prices"]} == {"g6.xlarge"}


def test_a_refused_placement_score_is_a_note_and_prices_still_show(
    aws: Any, prices: Callable[..., Result]
) -> None:
    refused = boto3.client("ec2", region_name=REGION)
    stub = Stubber(refused)
    stub.add_client_error("get_spot_placement_scores", "UnauthorizedOperation", "not authorized")
    stub.activate()
    ec2 = MotoHistoryWithScores(scores=refused)
    pricing = Pricing().on_demand("g6.xlarge", "0.8048").clients().pricing()
    result = prices("--placement-scores", ec2=ec2, pricing=pricing)

    assert result.code == 0, result.err
    assert "note: spot placement scores unavailable:" in result.out
    assert "us-east-1a" in result.out


def test_offline_flag_shows_the_dated_catalogue_and_says_so(prices: Callable[..., Result]) -> None:
    result = prices("--offline")

    assert result.code == 0, result.err
    assert f"offline catalogue of {catalogue.AS_OF}" in result.out
    assert "not live prices" in result.out
    entry = catalogue.lookup(REGION, "g6.xlarge")
    assert entry is not None and f"${entry.on_demand_usd_per_hour:.4f}" in result.out
    assert "https://aws.amazon.com/ec2/pricing/on-demand/" in result.out  # the citation is printed


def test_without_credentials_prices_come_from_the_catalogue(
    prices: Callable[..., Result], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    # A real client of a fresh session (the default one may hold earlier tests' credentials) and no
    # credentials anywhere: botocore refuses before any request leaves.
    no_credentials = boto3.Session().client("ec2", region_name=REGION)

    result = prices("--json", ec2=no_credentials)

    assert result.code == 0, result.err
    report = result.json()
    assert report["offline"] is True and report["source"] == f"offline catalogue of {catalogue.AS_OF}"
    assert any("no AWS credentials found" in n for n in report["notes"]), report["notes"]
    assert report["prices"][0]["on_demand_usd_per_hour"] == pytest.approx(0.8048)


def test_without_network_prices_come_from_the_catalogue(prices: Callable[..., Result]) -> None:
    # Port 9 (discard) on the loopback: nothing listens, the connection is refused at once.
    unreachable = boto3.Session().client(
        "ec2",
        region_name=REGION,
        endpoint_url="http://127.0.0.1:9",
        config=Config(retries={"max_attempts": 1, "mode": "standard"}, connect_timeout=2),
    )

    result = prices("--json", ec2=unreachable)

    assert result.code == 0, result.err
    report = result.json()
    assert report["offline"] is True
    assert any("cannot reach AWS" in n for n in report["notes"]), report["notes"]


def test_more_than_90_days_is_one_line_naming_the_limit(prices: Callable[..., Result]) -> None:
    result = prices("--days", "120", ec2=boto3.client("ec2", region_name=REGION))

    assert result.code == 1
    assert result.err.count("\n") == 1
    assert "--days 120: AWS keeps spot price history for 90 days" in result.err


def test_every_catalogue_entry_is_priced_and_spot_below_on_demand() -> None:
    assert catalogue.AS_OF and catalogue.sources()
    for region, entries in catalogue.CATALOGUE.items():
        for name, entry in entries.items():
            assert 0 < entry.spot_usd_per_hour < entry.on_demand_usd_per_hour, (region, name)


def test_the_catalogue_refresh_reads_the_90_day_median_of_the_cheapest_az() -> None:
    ec2 = boto3.client("ec2", region_name=REGION)
    stub = Stubber(ec2)
    now = datetime.now(timezone.utc)
    history = [("us-east-1a", "0.40"), ("us-east-1a", "0.20"), ("us-east-1a", "0.30"), ("us-east-1b", "0.35")]
    stub.add_response(
        "describe_spot_price_history",
        {
            "SpotPriceHistory": [
                {"InstanceType": "g6.xlarge", "AvailabilityZone": az, "Timestamp": now, "SpotPrice": price}
                for az, price in history
            ]
        },
        {"InstanceTypes": ["g6.xlarge"], "ProductDescriptions": ["Linux/UNIX"], "StartTime": ANY},
    )
    stub.activate()
    pricing = Pricing().on_demand("g6.xlarge", "0.8048")

    entries = catalogue.measured(pricing.clients(ec2=ec2), ["g6.xlarge"], REGION)

    # us-east-1a's median 0.30 beats us-east-1b's 0.35.
    assert entries == {"g6.xlarge": catalogue.Entry(0.8048, 0.30)}
    stub.assert_no_pending_responses()
