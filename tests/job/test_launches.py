"""trainstack_job/launches.py: the one reading of a group's launches (capacity function and CLI)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from trainstack_job.launches import DROUGHT_GAP, Drought, Launch, drought, drought_start, read_launches

NOW = datetime(2026, 12, 6, 18, 0, tzinfo=timezone.utc)
NO_CAPACITY = "Could not launch Spot Instances. InsufficientInstanceCapacity - There is no Spot capacity."


def ago(minutes: float) -> datetime:
    return NOW - timedelta(minutes=minutes)


def test_only_launch_attempts_are_read_with_their_outcome_and_words() -> None:
    activities = [
        {"Description": "Launching a new EC2 instance: i-1", "StartTime": ago(1), "StatusCode": "Successful"},
        {"Description": "Launching a new EC2 instance.  Status Reason: x", "StartTime": ago(2),
         "StatusCode": "Failed", "StatusMessage": NO_CAPACITY},
        {"Description": "Launching a new EC2 instance", "StartTime": ago(3), "StatusCode": "Cancelled"},
        {"Description": "Launching a new EC2 instance", "StartTime": ago(4), "StatusCode": "InProgress"},
        {"Description": "Terminating EC2 instance: i-0", "StartTime": ago(5), "StatusCode": "Failed"},
        {"StartTime": ago(6), "StatusCode": "Failed"},
    ]  # fmt: skip
    assert read_launches(activities) == [
        Launch(ago(1), True),
        Launch(ago(2), False, NO_CAPACITY),
        Launch(ago(3), False),
        Launch(ago(4), True),  # in progress: launched, as far as anyone waiting can tell
    ]


def test_a_drought_is_the_run_of_failures_since_the_last_success() -> None:
    newest_first = [Launch(ago(2), False, NO_CAPACITY), Launch(ago(8), False, "older"), Launch(ago(15), True)]
    assert drought(newest_first, NOW) == Drought(since=ago(8), failed=2, message=NO_CAPACITY)
    assert drought_start(newest_first, NOW) == ago(8)
    assert drought([Launch(ago(1), True), *newest_first], NOW) is None
    assert drought([], NOW) is None and drought_start([], NOW) is None


def test_a_silence_longer_than_the_gap_starts_a_new_drought() -> None:
    gap = DROUGHT_GAP.total_seconds() / 60
    newest_first = [Launch(ago(1), False), Launch(ago(1 + gap + 1), False)]
    assert drought(newest_first, NOW) == Drought(since=ago(1), failed=1, message="")
    # A failure just within the gap still belongs to the same drought.
    within = [Launch(ago(1), False), Launch(ago(1 + gap), False)]
    assert drought_start(within, NOW) == ago(1 + gap)
    # The newest failure itself long ago: Auto Scaling stopped wanting since, no drought now.
    assert drought([Launch(ago(gap + 1), False)], NOW) is None
