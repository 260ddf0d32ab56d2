"""`trainstack estimate`: instance count × expected hours × today's prices per type, beside maxCostUsd."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import ANY, Stubber

from trainstack.estimate import project
from trainstack.prices import SpotPrice

from .conftest import REGION, STACK, Result, write_project
from .test_prices import Pricing

TYPES = ["g6.xlarge", "g5.xlarge"]


def _spot_history(prices: list[tuple[str, str, str]]) -> Any:
    """FAKE at the client boundary: moto's spot history is one flat price for every type and AZ."""
    ec2 = boto3.client("ec2", region_name=REGION)
    stub = Stubber(ec2)
    now = datetime.now(timezone.utc)
    stub.add_response(
        "describe_spot_price_history",
        {
            "SpotPriceHistory": [
                {
                    "InstanceType": t,
                    "AvailabilityZone": az,
                    "Timestamp": now - timedelta(hours=1),
                    "SpotPrice": p,
                    "ProductDescription": "Linux/UNIX",
                }
                for t, az, p in prices
            ]
        },
        {"InstanceTypes": TYPES, "ProductDescriptions": ["Linux/UNIX"], "StartTime": ANY},
    )
    stub.activate()
    return ec2


@pytest.fixture()
def estimate(tmp_path: Path, cli: Callable[..., Result]) -> Callable[..., Result]:
    def run(config: dict[str, Any], *flags: str, ec2: Any = None) -> Result:
        project = write_project(tmp_path, {"aws:region": REGION, "trainstack:instanceTypes": TYPES, **config})
        pricing = Pricing().on_demand("g6.xlarge", "0.8048").on_demand("g5.xlarge", "1.006")
        more = {} if ec2 is None else {"ec2": ec2}
        return cli(
            "estimate", "--cwd", str(project), "--stack", STACK, *flags, clients=pricing.clients(**more)
        )

    return run


def _ec2() -> Any:
    return _spot_history(
        [
            ("g6.xlarge", "us-east-1a", "0.30"),
            ("g6.xlarge", "us-east-1b", "0.25"),
            ("g5.xlarge", "us-east-1a", "0.45"),
        ]
    )


def test_projection_is_count_times_hours_times_the_cheapest_azs_price() -> None:
    rows = [
        SpotPrice("g6.xlarge", "us-east-1a", 0.30, 0.30, 0.30, 0.8048),
        SpotPrice("g6.xlarge", "us-east-1b", 0.25, 0.25, 0.25, 0.8048),
    ]
    (cost,) = project(rows, ["g6.xlarge"], 2, 10.0)
    assert cost.spot_job_usd == pytest.approx(2 * 10 * 0.25)
    assert cost.on_demand_job_usd == pytest.approx(2 * 10 * 0.8048)


def test_estimate_shows_cheapest_and_dearest_type_beside_the_cap(estimate: Callable[..., Result]) -> None:
    result = estimate({"trainstack:expectedHours": "24", "trainstack:maxCostUsd": "20"}, ec2=_ec2())

    assert result.code == 0, result.err
    assert "1 instance(s) × 24 h" in result.out
    assert "cheapest: g6.xlarge on spot, $6.00" in result.out  # 0.25 (cheapest AZ) × 24 h
    assert "most expensive: g5.xlarge on demand, $24.14" in result.out  # 1.006 × 24 h
    assert "trainstack:maxCostUsd $20.00: g5.xlarge could exceed it" in result.out


def test_estimate_json_for_scripts(estimate: Callable[..., Result]) -> None:
    result = estimate({"trainstack:expectedHours": "10"}, "--json", ec2=_ec2())

    assert result.code == 0, result.err
    report = result.json()
    assert report["expected_hours"] == 10 and report["max_cost_usd"] is None
    assert report["cheapest"] == "g6.xlarge" and report["most_expensive"] == "g5.xlarge"
    g5 = next(t for t in report["types"] if t["instance_type"] == "g5.xlarge")
    assert g5["spot_job_usd"] == pytest.approx(4.5) and g5["on_demand_job_usd"] == pytest.approx(10.06)


def test_hours_flag_overrides_the_config_and_markdown_is_a_table(estimate: Callable[..., Result]) -> None:
    result = estimate({"trainstack:expectedHours": "10"}, "--hours", "2", "--markdown", ec2=_ec2())

    assert result.code == 0, result.err
    assert result.out.startswith("### trainstack estimate: `test`, us-east-1, 1 instance(s) × 2 h")
    assert "| g6.xlarge | $0.2500/h | $0.8048/h | $0.50 | $1.61 |" in result.out


def test_without_expected_hours_prices_only_and_how_to_set_them(estimate: Callable[..., Result]) -> None:
    result = estimate({}, ec2=_ec2())

    assert result.code == 0, result.err
    assert "note: no job length: set trainstack:expectedHours" in result.out
    assert "$0.2500" in result.out


def test_a_bad_expected_hours_is_one_line_naming_the_key(estimate: Callable[..., Result]) -> None:
    result = estimate({"trainstack:expectedHours": "a day"}, ec2=_ec2())

    assert result.code == 1
    assert result.err.count("\n") == 1
    # The program's own line (infra/config/), after the file it was read from.
    assert (
        f"Pulumi.{STACK}.yaml: trainstack:expectedHours: 'a day' is not a positive number of hours; "
        "empty = unknown (e.g. `pulumi config set trainstack:expectedHours 24`)"
    ) in result.err


def test_the_cap_beside_the_estimate_is_the_one_the_program_enforces(estimate: Callable[..., Result]) -> None:
    """maxCostUsd as the program parses it: a bad one is refused as preview refuses it, never read as none."""
    result = estimate({"trainstack:expectedHours": "24", "trainstack:maxCostUsd": "0"}, ec2=_ec2())

    assert result.code == 1
    assert "trainstack:maxCostUsd: '0' is not a positive USD amount; empty = no cap" in result.err


def test_estimate_against_moto_needs_no_stack_outputs(aws: Any, estimate: Callable[..., Result]) -> None:
    result = estimate({"trainstack:expectedHours": "24", "trainstack:maxCostUsd": "100"})

    assert result.code == 0, result.err
    assert "every type fits, spot or on-demand" in result.out
