"""The cost replay's invariants (bench/cost.py): the price ratio, losses by band, nothing billed after, and
replays over a spot price trace."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from bench.cost import (
    BANDS,
    Job,
    PriceTrace,
    TraceError,
    TracePrices,
    on_demand_cost,
    replay,
    run_all,
    run_band,
    run_trace,
)

STEADY = Job(spot_volatility=0.0)


def test_without_interruptions_the_ratio_is_the_spot_to_on_demand_price_ratio() -> None:
    result = replay(STEADY, 0.0, seed=1)
    assert result.interruptions == 0 and result.lives == 1
    assert result.cost_usd / on_demand_cost(STEADY) == pytest.approx(STEADY.spot_fraction)
    assert run_band(STEADY, "none", 0.0, runs=20, seed=1).ratio_mean == pytest.approx(STEADY.spot_fraction)


def test_lost_gpu_hours_and_interruptions_grow_with_the_band() -> None:
    results = run_all(Job(), runs=1000, seed=5)
    assert [r.band for r in results] == [band for band, _ in BANDS]
    lost = [r.lost_gpu_hours_mean for r in results]
    interruptions = [r.interruptions_mean for r in results]
    # Common random numbers: each band replays the same arrival draws, scaled by its rate.
    assert all(later >= earlier - 1e-12 for earlier, later in itertools.pairwise(lost))
    assert all(later >= earlier for earlier, later in itertools.pairwise(interruptions))
    assert lost[-1] > lost[0] > 0


def test_nothing_is_billed_after_completion_but_the_shutdown() -> None:
    job = Job()
    for seed in range(50):
        # A high rate so that many replays hold interruptions, replacements and fallbacks.
        result = replay(job, 50.0, seed)
        assert result.billed_after_completion_hours == pytest.approx(job.shutdown_hours)
    assert all(r.billed_minutes_after_completion_max == pytest.approx(0.5) for r in run_all(job, 50, 0))


def test_an_outage_longer_than_the_fallback_finishes_the_job_on_demand() -> None:
    job = Job(spot_volatility=0.0, outage_mean_hours=1e6)
    result = replay(job, 200.0, seed=3)
    assert result.interruptions == 1
    assert result.on_demand_hours > 0
    assert result.lives == 2


def test_lost_work_without_the_emergency_checkpoint_is_at_most_one_interval_per_interruption() -> None:
    job = Job(emergency_checkpoint=False, outage_mean_hours=0.0)
    for seed in range(30):
        result = replay(job, 100.0, seed)
        per_interruption = job.checkpoint_every_hours + job.boot_and_restore_hours + job.notice_hours
        assert result.lost_gpu_hours <= result.interruptions * per_interruption + 1e-9


# Replays over a spot price trace (bench/cost.py --trace): the file is what `aws ec2
# describe-spot-price-history --output json` prints.


def _history(*points: tuple[str, str, str], instance_type: str = "g5.xlarge") -> dict[str, Any]:
    return {
        "SpotPriceHistory": [
            {
                "AvailabilityZone": zone,
                "InstanceType": instance_type,
                "ProductDescription": "Linux/UNIX",
                "SpotPrice": price,
                "Timestamp": when,
            }
            for zone, when, price in points
        ]
    }


def _flat(usd: float) -> PriceTrace:
    return PriceTrace.from_history(
        _history(
            ("us-east-1a", "2026-01-01T00:00:00Z", f"{usd}"), ("us-east-1a", "2026-01-31T00:00:00Z", f"{usd}")
        ),
        source="test",
    )


def test_a_flat_trace_at_the_assumed_ratio_replays_as_the_steady_model() -> None:
    trace = _flat(STEADY.on_demand_usd_per_hour * STEADY.spot_fraction)
    on_trace = replay(STEADY, 0.0, seed=1, trace=trace)
    assert on_trace.cost_usd == pytest.approx(replay(STEADY, 0.0, seed=1).cost_usd)


def test_a_trace_is_a_step_function_that_wraps_and_is_paid_per_second(tmp_path: Path) -> None:
    path = tmp_path / "g5.json"
    history = _history(
        ("us-east-1a", "2026-01-01T00:00:00Z", "0.30"),
        ("us-east-1a", "2026-01-01T10:00:00Z", "0.60"),
        ("us-east-1a", "2026-01-01T20:00:00Z", "0.30"),
        ("us-east-1b", "2026-01-01T00:00:00Z", "9.99"),  # fewer points: not the AZ chosen by default
    )
    path.write_text(json.dumps({**history, "Source": "test excerpt"}), encoding="utf-8")

    trace = PriceTrace.load(path)

    assert (trace.instance_type, trace.zone, trace.span_hours) == ("g5.xlarge", "us-east-1a", 20.0)
    assert "test excerpt" in trace.source
    assert [trace.price_at(h) for h in (0, 9.99, 10, 19.9, 20, 30)] == [0.30, 0.30, 0.60, 0.60, 0.30, 0.60]
    # 8 h to 12 h from the start: 2 h at 0.30 then 2 h at 0.60; and across the wrap from 18 h to 22 h.
    assert TracePrices(trace, 0.0).cost(8.0, 12.0) == pytest.approx(2 * 0.30 + 2 * 0.60)
    assert TracePrices(trace, 18.0).cost(0.0, 4.0) == pytest.approx(2 * 0.60 + 2 * 0.30)
    assert trace.mean() == pytest.approx(0.45)


def test_a_bad_trace_file_names_the_file_and_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "empty.json"
    path.write_text('{"SpotPriceHistory": []}', encoding="utf-8")
    with pytest.raises(TraceError, match=r"empty\.json: no SpotPriceHistory entries; write the file with"):
        PriceTrace.load(path)
    with pytest.raises(TraceError, match=r"no prices for p5\.48xlarge"):
        PriceTrace.from_history(
            _history(("us-east-1a", "2026-01-01T00:00:00Z", "1")), source="x", instance_type="p5.48xlarge"
        )


def test_trace_replay_reports_p50_and_p95_per_finished_job_against_on_demand() -> None:
    trace = PriceTrace.from_history(
        _history(
            ("us-east-1a", "2026-01-01T00:00:00Z", "0.30"),
            ("us-east-1a", "2026-01-03T00:00:00Z", "0.70"),
            ("us-east-1a", "2026-01-04T00:00:00Z", "0.30"),
            ("us-east-1a", "2026-01-08T00:00:00Z", "0.30"),
        ),
        source="test",
    )
    job = Job(outage_mean_hours=0.0)
    result = run_trace(job, trace, "5-10%", 0.10, runs=200, seed=3)

    assert result.on_demand_usd == pytest.approx(on_demand_cost(job))
    assert result.p50_usd <= result.p95_usd
    # Every second is paid at 0.30 or 0.70 a hour: the job's cost lies within those prices' bounds.
    hours = job.work_hours
    assert 0.30 * hours <= result.p50_usd and result.p95_usd <= 0.70 * (hours + 2)
    # Most start points miss the one dear day; some jobs overlap it.
    assert result.p50_ratio < result.p95_ratio < 1.0


def test_trace_replay_includes_the_on_demand_fallback() -> None:
    job = Job(outage_mean_hours=1e6)  # every interruption's outage outlasts the fallback delay
    result = run_trace(job, _flat(0.30), ">20%", 200.0, runs=20, seed=1)
    assert result.jobs_with_fallback == 1.0
    # Once on demand the job pays the on-demand price: dearer than the same hours on spot.
    assert result.p50_usd > 0.30 * job.work_hours
