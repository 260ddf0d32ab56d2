"""A group's launch history as Auto Scaling's scaling activities tell it; stdlib only.

One reading of it for the capacity function (lambdas/capacity_fallback/handler.py: how long spot has had no
capacity, to fall back to on-demand) and for `trainstack jobs` (why a queued job waits: "no capacity for its
instance types for 12 min"), so the two never disagree about what a drought is.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

# Auto Scaling retries a failed launch within minutes for as long as it wants capacity. A longer silence
# between two failures means it stopped wanting (scaled to zero, then resumed): a new drought starts.
DROUGHT_GAP = timedelta(minutes=30)
LAUNCH_FAILED = ("Failed", "Cancelled")
_LAUNCHING = "Launching a new EC2 instance"


@dataclass(frozen=True)
class Launch:
    """One launch attempt from the group's scaling activities."""

    started_at: datetime
    succeeded: bool
    # Auto Scaling's own words for a failure (StatusMessage), e.g. "... InsufficientInstanceCapacity ...".
    message: str = ""


@dataclass(frozen=True)
class Drought:
    """A run of unsuccessful launches still going on: since when, how many, and the newest one's words."""

    since: datetime
    failed: int
    message: str


def read_launches(activities: Iterable[Mapping[str, Any]]) -> list[Launch]:
    """Launch attempts only (terminations are not launches); a launch in progress counts as launched."""
    return [
        Launch(
            started_at=activity["StartTime"],
            succeeded=activity.get("StatusCode") not in LAUNCH_FAILED,
            message=str(activity.get("StatusMessage") or ""),
        )
        for activity in activities
        if str(activity.get("Description", "")).startswith(_LAUNCHING)
    ]


def drought(newest_first: Sequence[Launch], now: datetime) -> Drought | None:
    """The current run of unsuccessful launches (None: the newest launch succeeded, or there is none)."""
    run: list[Launch] = []
    later = now
    for launch in newest_first:
        if launch.succeeded or later - launch.started_at > DROUGHT_GAP:
            break
        run.append(launch)
        later = launch.started_at
    if not run:
        return None
    return Drought(since=run[-1].started_at, failed=len(run), message=run[0].message)


def drought_start(newest_first: Sequence[Launch], now: datetime) -> datetime | None:
    """When the current run of unsuccessful launches began (None: the newest launch succeeded, or none)."""
    found = drought(newest_first, now)
    return found.since if found is not None else None
