"""`checkpoint.every_minutes: auto`: the Young/Daly interval, its bounds and the interruption rate."""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone

import pytest

from bootstrap.imds import InstanceIdentity
from bootstrap.job import interruption_env
from bootstrap.ledger import JobLedger
from training.checkpoint_policy import (
    DEFAULT_BAND,
    HOURS_PER_MONTH,
    MAX_MINUTES,
    MIN_MINUTES,
    InterruptionRate,
    choose_interval,
    young_daly_seconds,
)
from training.config import ConfigError, load_config
from training.stop import AutoDeadline
from trainstack_job.contract import JobEnv, LifeOutcome

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def test_interval_is_the_square_root_of_twice_checkpoint_time_times_mtbi() -> None:
    rate = InterruptionRate(11.2, "the ledger's 3 interruptions over 33.6 h")
    interval = choose_interval(4.1, rate)
    assert interval.minutes == pytest.approx(math.sqrt(2 * 4.1 * 11.2 * 3600) / 60)
    assert interval.bound is None
    assert interval.describe() == (
        f"checkpoint interval {interval.minutes:.1f} min (Young/Daly: C=4.1 s, "
        "MTBI=11.2 h from the ledger's 3 interruptions over 33.6 h)"
    )


def test_a_free_checkpoint_is_held_at_the_two_minute_floor() -> None:
    interval = choose_interval(0.0, InterruptionRate(11.2, "x"))
    assert (interval.minutes, interval.bound) == (MIN_MINUTES, "floor")
    assert "held at the floor" in interval.describe()


def test_a_rarely_interrupted_type_is_held_at_the_hour_ceiling() -> None:
    interval = choose_interval(30.0, InterruptionRate(HOURS_PER_MONTH / 0.01, "x"))
    assert (interval.minutes, interval.bound) == (MAX_MINUTES, "ceiling")


def test_negative_checkpoint_time_counts_as_zero() -> None:
    assert young_daly_seconds(-5.0, 10.0) == 0.0


def test_without_the_agents_figure_the_published_band_midpoint_is_used() -> None:
    rate = InterruptionRate.from_env({})
    assert rate.mtbi_hours == pytest.approx(HOURS_PER_MONTH / (sum(DEFAULT_BAND) / 2))
    assert "5-10%/month" in rate.source and "Spot Instance Advisor" in rate.source
    assert InterruptionRate.from_env({JobEnv.MTBI_HOURS.value: "soon"}) == rate
    assert InterruptionRate.from_env({JobEnv.MTBI_HOURS.value: "0"}) == rate


def test_the_ledger_rate_reaches_the_job_only_with_enough_interruptions() -> None:
    ledger = JobLedger()
    for i in range(3):
        start = T0 + timedelta(hours=12 * i)
        ledger.begin_life(
            InstanceIdentity(f"i-{i}", "g6.xlarge", "us-east-1a", "us-east-1", "spot"), 0.4, start
        )
        ledger.end_life(LifeOutcome.PREEMPTED, start + timedelta(hours=11.2))
        if i == 0:
            assert interruption_env(*ledger.spot_interruptions()) == {}, "one interruption is not a rate"
    # An on-demand life adds neither hours nor interruptions.
    ledger.begin_life(InstanceIdentity("i-od", "g6.xlarge", "us-east-1a", "us-east-1", "on-demand"), 0.8, T0)
    env = interruption_env(*ledger.spot_interruptions())
    rate = InterruptionRate.from_env(env)
    assert rate.mtbi_hours == pytest.approx(11.2)
    assert rate.source == "the ledger's 3 interruptions over 33.6 h"


def test_auto_deadline_follows_the_measured_checkpoint_time() -> None:
    deadline = AutoDeadline(InterruptionRate(11.2, "x"), announce=False)
    deadline.measured(4.1)
    assert deadline.seconds == pytest.approx(math.sqrt(2 * 4.1 * 11.2 * 3600))
    assert not deadline.due()


def test_every_minutes_accepts_a_number_or_auto_and_nothing_else() -> None:
    config = "training/configs/tiny.yaml"
    assert load_config(config, ["checkpoint.every_minutes=auto"]).checkpoint.every_minutes == "auto"
    assert load_config(config, ["checkpoint.every_minutes=7.5"]).checkpoint.every_minutes == 7.5
    with pytest.raises(ConfigError, match=r"checkpoint\.every_minutes"):
        load_config(config, ["checkpoint.every_minutes=often"])
