"""`trainstack estimate`'s ranking: expected $ per 1,000 useful steps, with interruptions through the
Young/Daly checkpoint interval, in the table, the JSON and the pull-request comment."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from training.checkpoint_policy import InterruptionRate, young_daly_seconds
from trainstack import catalogue
from trainstack.estimate import measured_mtbi, progress_of, rank_by_progress

from .conftest import REGION, STACK, Result, write_project
from .test_estimate import TYPES, _ec2
from .test_prices import Pricing

RARE = InterruptionRate(2000.0, "test")  # an interruption per 2,000 h


def test_the_cheaper_type_per_hour_loses_on_progress_per_dollar() -> None:
    prices = {"g4dn.xlarge": 0.16, "g6.xlarge": 0.24}
    steps = {"g4dn.xlarge": 1.0, "g6.xlarge": 2.5}  # the L4 makes 2.5x the T4's steps

    ranked = rank_by_progress(prices, steps, {})

    assert min(prices, key=prices.__getitem__) == "g4dn.xlarge"
    assert [p.instance_type for p in ranked] == ["g6.xlarge", "g4dn.xlarge"]
    best, other = ranked
    assert best.usd_per_1000_steps is not None and other.usd_per_1000_steps is not None
    # Same default band for both: the ratio is the price-per-throughput ratio.
    assert other.usd_per_1000_steps / best.usd_per_1000_steps == pytest.approx((0.16 / 1.0) / (0.24 / 2.5))


def test_waste_is_checkpoints_plus_half_an_interval_and_the_restart_per_interruption() -> None:
    rate = InterruptionRate(10.0, "test")  # interruptions every 10 h: Young/Daly within the trainer's bounds
    p = progress_of("g6.xlarge", 0.36, 2.0, rate, checkpoint_seconds=30.0, restart_seconds=480.0)

    tau = young_daly_seconds(30.0, 10.0)
    assert p.checkpoint_every_minutes == pytest.approx(tau / 60)
    waste = 30.0 / tau + (tau / 2 + 480.0) / (10.0 * 3600)
    assert p.waste == pytest.approx(waste)
    assert p.usd_per_1000_steps == pytest.approx(0.36 / (2.0 * 3600 * (1 - waste)) * 1000)


def test_frequent_interruptions_can_outweigh_a_lower_price() -> None:
    prices = {"steady": 0.30, "flaky": 0.20}
    steps = {"steady": 1.0, "flaky": 1.0}
    rates = {"steady": RARE, "flaky": InterruptionRate(0.2, "test")}  # 12 min between interruptions

    ranked = rank_by_progress(prices, steps, rates, restart_seconds=480.0)

    assert [p.instance_type for p in ranked] == ["steady", "flaky"]
    assert ranked[1].waste > 0.5


def test_a_type_that_can_never_finish_ranks_last_without_a_price_per_step() -> None:
    rates = {"hopeless": InterruptionRate(0.05, "test"), "fine": RARE}  # restart alone outlasts the MTBI

    ranked = rank_by_progress({"hopeless": 0.01, "fine": 1.0}, {"hopeless": 1.0, "fine": 1.0}, rates)

    assert [p.instance_type for p in ranked] == ["fine", "hopeless"]
    assert ranked[1].usd_per_1000_steps is None and ranked[1].waste == 1.0


def test_types_without_a_throughput_are_not_ranked() -> None:
    ranked = rank_by_progress({"g6.xlarge": 0.24, "g5.xlarge": 0.30}, {"g6.xlarge": 2.0}, {})
    assert [p.instance_type for p in ranked] == ["g6.xlarge"]


def test_the_measured_mtbi_comes_from_the_flag_or_the_agents_variable() -> None:
    flag = measured_mtbi(12.0, {})
    env = measured_mtbi(None, {"TRAINSTACK_MTBI_HOURS": "40", "TRAINSTACK_MTBI_SOURCE": "ledger"})
    assert flag is not None and flag.mtbi_hours == 12.0 and flag.source == "--mtbi-hours"
    assert env is not None and env.mtbi_hours == 40.0 and "ledger" in env.source
    assert measured_mtbi(None, {}) is None


@pytest.fixture()
def estimate(tmp_path: Path, cli: Callable[..., Result]) -> Callable[..., Result]:
    def run(*flags: str, ec2: Any = None) -> Result:
        project = write_project(
            tmp_path,
            {"aws:region": REGION, "trainstack:instanceTypes": TYPES, "trainstack:expectedHours": "10"},
        )
        pricing = Pricing().on_demand("g6.xlarge", "0.8048").on_demand("g5.xlarge", "1.006")
        more = {} if ec2 is None else {"ec2": ec2}
        return cli(
            "estimate", "--cwd", str(project), "--stack", STACK, *flags, clients=pricing.clients(**more)
        )

    return run


def test_markdown_comment_ranks_by_progress_with_its_inputs(estimate: Callable[..., Result]) -> None:
    # g6.xlarge $0.25/h (cheapest AZ), g5.xlarge $0.45/h; the g5 is twice as fast: it wins per step.
    result = estimate(
        "--markdown",
        "--throughput",
        "g6.xlarge=2",
        "--throughput",
        "g5.xlarge=4",
        "--mtbi-hours",
        "100",
        ec2=_ec2(),
    )

    assert result.code == 0, result.err
    assert "prices: live: DescribeSpotPriceHistory, last 1 day(s)" in result.out
    assert "ranked by expected $ per 1,000 useful steps on spot" in result.out
    rows = [line for line in result.out.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert rows[0].startswith("| 1 | g5.xlarge | $0.4500 | 4 | 100 h (--mtbi-hours) |")
    assert rows[1].startswith("| 2 | g6.xlarge | $0.2500 | 2 |")
    assert "C (checkpoint) 30 s, restart 480 s" in result.out


def test_json_carries_the_ranking(estimate: Callable[..., Result]) -> None:
    result = estimate("--json", "--throughput", "g6.xlarge=2", ec2=_ec2())

    assert result.code == 0, result.err
    report = result.json()
    assert [p["instance_type"] for p in report["ranking"]] == ["g6.xlarge"]
    (g6,) = report["ranking"]
    assert math.isclose(g6["usd_per_1000_steps"], 0.25 / (2 * 3600 * (1 - g6["waste"])) * 1000)
    assert "Spot Instance Advisor" in g6["mtbi_source"]  # no score, no catalogue band: the default band
    assert any("not ranked by progress: g5.xlarge" in n for n in report["notes"])


def test_offline_estimate_says_it_is_the_catalogue(estimate: Callable[..., Result]) -> None:
    result = estimate("--markdown", "--offline", "--throughput", "g6.xlarge=2", "--throughput", "g5.xlarge=2")

    assert result.code == 0, result.err
    assert f"prices: offline catalogue of {catalogue.AS_OF}" in result.out
    assert f"on spot (offline catalogue of {catalogue.AS_OF})" in result.out
    assert "| 1 | g6.xlarge |" in result.out  # same throughput, lower catalogue price


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--throughput", "g6.xlarge"), "--throughput 'g6.xlarge': expected TYPE=STEPS_PER_SECOND"),
        (("--throughput", "g6.xlarge=-1"), "--throughput 'g6.xlarge=-1': expected TYPE=STEPS_PER_SECOND"),
        (("--mtbi-hours", "0"), "--mtbi-hours 0: give a positive number of hours"),
        (("--samples-per-step", "0"), "--samples-per-step 0: give a positive number"),
    ],
)
def test_bad_ranking_flags_are_one_line(
    estimate: Callable[..., Result], flags: tuple[str, ...], message: str
) -> None:
    result = estimate(*flags, ec2=_ec2())

    assert result.code == 1
    assert result.err.count("\n") == 1 and message in result.err


def test_without_throughput_flags_the_throughput_modules_estimates_rank_in_t4_seconds(
    estimate: Callable[..., Result],
) -> None:
    result = estimate("--markdown", ec2=_ec2())

    assert result.code == 0, result.err
    assert "ranked by expected $ per 1,000 useful T4-seconds of work on spot" in result.out
    assert "| rank | type | spot $/h | speed (T4 = 1) |" in result.out
    assert "- throughput: g6.xlarge: shipped estimate: 1x L4" in result.out
    # Every table row stays on one line, whatever the terminal's width.
    assert all(line.endswith("|") for line in result.out.splitlines() if line.startswith("| "))


def test_estimate_of_a_job_ranks_the_types_of_the_pool_it_would_run_on_for_its_model_and_batch(
    tmp_path: Path, cli: Callable[..., Result]
) -> None:
    """`trainstack estimate JOB`: the pool `trainstack run` would choose for the job's `resources:`, that
    pool's types only, each at the job's model family's throughput per step of its batch."""
    pools = [
        {"name": "default", "instanceTypes": ["g6.xlarge", "g5.xlarge"], "maxInstances": 1},
        {"name": "big", "instanceTypes": ["g6e.xlarge"], "maxInstances": 1},
    ]
    project = write_project(tmp_path, {"aws:region": REGION, "trainstack:pools": pools})
    config = tmp_path / "resnet.yaml"
    config.write_text(
        "model: {name: resnet18}\ntrain: {batch_size: 64, epochs: 1}\nresources: {pool: big}\n",
        encoding="utf-8",
    )
    result = cli("estimate", str(config), "--cwd", str(project), "--stack", STACK, "--offline", "--json")
    assert result.code == 0, result.err
    ranked = [p["instance_type"] for p in result.json()["ranking"]]
    assert ranked == ["g6e.xlarge"], "only the pool the job asks for"
    unnamed = tmp_path / "plain.yaml"
    unnamed.write_text("model: {name: resnet18}\ntrain: {batch_size: 64, epochs: 1}\n", encoding="utf-8")
    result = cli("estimate", str(unnamed), "--cwd", str(project), "--stack", STACK, "--offline", "--json")
    assert result.code == 0, result.err
    assert sorted(p["instance_type"] for p in result.json()["ranking"]) == ["g5.xlarge", "g6.xlarge"]


def test_estimate_of_a_job_no_pool_serves_is_one_line_naming_the_pools(
    tmp_path: Path, cli: Callable[..., Result]
) -> None:
    project = write_project(tmp_path, {"aws:region": REGION, "trainstack:instanceTypes": ["g6.xlarge"]})
    config = tmp_path / "big.yaml"
    config.write_text("model: {name: resnet18}\nresources: {gpus: 'A100:8'}\n", encoding="utf-8")
    result = cli("estimate", str(config), "--cwd", str(project), "--stack", STACK, "--offline")
    assert result.code == 1
    assert result.err.count("\n") == 1 and "no pool serves" in result.err and "g6.xlarge" in result.err


def test_a_type_past_the_margin_is_named_as_one_the_job_gains_nothing_from() -> None:
    """The T4 is cheaper by the hour; per useful step it is 2.5 × 0.16/0.24 - 1 = 67 % dearer: past the 25 %
    margin, named with what to do. One within the margin, and the best, are not named."""
    from trainstack.estimate import behind

    prices = {"g4dn.xlarge": 0.16, "g6.xlarge": 0.24, "g5.xlarge": 0.27}
    steps = {
        "g4dn.xlarge": 1.0,
        "g6.xlarge": 2.5,
        "g5.xlarge": 2.5,
    }  # the A10G 12.5 % dearer per step (13 % shown)
    ranked = rank_by_progress(prices, steps, {})
    assert behind(ranked) == [
        "g4dn.xlarge: 67% dearer per useful step than g6.xlarge (past the 25% margin): this job gains "
        "nothing from it; run the job on a pool without it (`trainstack run --pool`), or remove it from the "
        "pool (`pulumi config`)"
    ]
    assert behind(ranked, margin=0.7) == [], "within a wider margin"
    assert behind(ranked, margin=0.1)[0].startswith("g5.xlarge: 13% dearer")
    assert behind([]) == []
    never = rank_by_progress(
        {"flaky": 0.1, "steady": 0.3},
        {"flaky": 1.0, "steady": 1.0},
        {"flaky": InterruptionRate(0.001, "test"), "steady": RARE},
    )
    assert (
        behind(never)[-1]
        == "flaky: interruptions waste all its time at this rate: this job gains nothing from it"
    )


def test_the_table_and_the_json_name_the_types_a_job_gains_nothing_from(
    estimate: Callable[..., Result],
) -> None:
    # g6.xlarge $0.25/h at 2 steps/s; g5.xlarge $0.45/h at 1 step/s: 3.6 x dearer per step.
    result = estimate("--throughput", "g6.xlarge=2", "--throughput", "g5.xlarge=1", ec2=_ec2())
    assert result.code == 0, result.err
    assert "g5.xlarge: 260% dearer per useful step than g6.xlarge" in " ".join(result.out.split())
    report = estimate(
        "--json", "--throughput", "g6.xlarge=2", "--throughput", "g5.xlarge=1", ec2=_ec2()
    ).json()
    assert [line.split(":")[0] for line in report["behind"]] == ["g5.xlarge"]
