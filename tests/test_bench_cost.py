"""The cost replay's invariants (bench/cost.py): the price ratio, losses by band, nothing billed after."""

from __future__ import annotations

import itertools

import pytest

from bench.cost import BANDS, Job, on_demand_cost, replay, run_all, run_band

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
