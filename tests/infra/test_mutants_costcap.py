"""The capacity function (infra/capacity_fallback/handler.py): the promises `make mutate` found untested.
Its decision is pure (the group and its launches in, an action and the reason out), and the reason is the
one line an operator reads in the function's log to learn why the group moved or did not: each situation
gives its own, exact line."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from infra.capacity_fallback.handler import (
    RETURN_TO_SPOT,
    STAY,
    Decision,
    Group,
    Launch,
    Settings,
    decide,
)

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)
SPOT = Settings(group_name="trainstack-test-gpu", fallback_minutes=15, spot_on_demand_percentage=0)


def launched(minutes_ago: float, *, ok: bool) -> Launch:
    return Launch(started_at=NOW - timedelta(minutes=minutes_ago), succeeded=ok)


@pytest.mark.parametrize(
    "group, launches, decision",
    [
        (
            Group(desired=1, active=1, on_demand_percentage=100),
            [launched(30, ok=True)],
            Decision(STAY, "on-demand instance running; spot is tried again at the next launch"),
        ),
        (
            Group(desired=0, active=0, on_demand_percentage=100),
            [],
            Decision(RETURN_TO_SPOT, "group at zero: the next launch tries spot first"),
        ),
        (
            Group(desired=1, active=0, on_demand_percentage=100),
            [launched(1, ok=True), launched(40, ok=False)],
            Decision(RETURN_TO_SPOT, "the on-demand life ended and a launch is due: spot first"),
        ),
        (
            Group(desired=1, active=0, on_demand_percentage=100),
            [launched(1, ok=False)],
            Decision(STAY, "waiting for the on-demand launch"),
        ),
        (
            Group(desired=1, active=0, on_demand_percentage=100),
            [],
            Decision(STAY, "waiting for the on-demand launch"),
        ),
    ],
    ids=["on-demand-running", "at-zero", "on-demand-ended", "on-demand-launch-failed", "nothing-launched"],
)
def test_in_fallback_each_situation_says_why_in_its_own_line(
    group: Group, launches: list[Launch], decision: Decision
) -> None:
    assert decide(group, launches, NOW, SPOT) == decision
