"""Spot watcher: polls IMDS for interruption, scale-in and rebalance notices on a ≤5 s tick."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass

from bootstrap.eventlog import EventLog, iso, utc_now
from bootstrap.imds import ImdsClient, ImdsUnavailableError


@dataclass(frozen=True)
class TerminationNotice:
    """The instance is going away: a spot `instance-action`, or the group terminating it (scale-in)."""

    source: str  # "spot" or "scale-in"
    action: str
    time: str


@dataclass(frozen=True)
class RebalanceRecommendation:
    """`events/recommendations/rebalance`: elevated interruption risk since `notice_time`."""

    notice_time: str


class SpotWatcher:
    """Background poller; calls `on_notice` once, `on_rebalance` once per new recommendation.

    IMDS being unreachable is logged (first failure and recovery only) and retried on the next tick:
    a flaky metadata service must never stop training.
    """

    def __init__(
        self,
        imds: ImdsClient,
        log: EventLog,
        poll_seconds: float,
        on_notice: Callable[[TerminationNotice], None],
        on_rebalance: Callable[[RebalanceRecommendation], None],
    ) -> None:
        self._imds = imds
        self._log = log
        self._poll_seconds = poll_seconds
        self._on_notice = on_notice
        self._on_rebalance = on_rebalance
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spot-watcher", daemon=True)
        self._notice_seen = False
        self._rebalances_seen: set[str] = set()
        self.failed_polls = 0
        self.polls = 0

    def start(self) -> None:
        self._log.event("watcher", "watching IMDS for spot notices", poll_seconds=self._poll_seconds)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self._poll_seconds + 5)

    def _run(self) -> None:
        unreachable = False
        while not self._stop.is_set():
            try:
                self.poll_once()
                if unreachable:
                    self._log.event("watcher", "IMDS reachable again", failed_polls=self.failed_polls)
                unreachable = False
            except ImdsUnavailableError as exc:
                self.failed_polls += 1
                if not unreachable:
                    self._log.event(
                        "watcher", "IMDS unreachable; training continues, retrying", error=str(exc)
                    )
                unreachable = True
            self._stop.wait(self._poll_seconds)

    def poll_once(self) -> None:
        self.polls += 1
        if not self._notice_seen:
            action = self._imds.get("spot/instance-action")
            if action is not None:
                parsed = json.loads(action)
                self._notice_seen = True
                self._on_notice(TerminationNotice("spot", str(parsed.get("action")), str(parsed.get("time"))))
        if not self._notice_seen and self._imds.get("autoscaling/target-lifecycle-state") == "Terminated":
            # A scale-in or capacity-rebalance termination: the group's drain hook holds the instance
            # until the agent completes it, so the trainer gets the same stop-and-checkpoint.
            self._notice_seen = True
            self._on_notice(TerminationNotice("scale-in", "terminate", iso(utc_now())))
        rebalance = self._imds.get("events/recommendations/rebalance")
        if rebalance is not None:
            notice_time = str(json.loads(rebalance).get("noticeTime"))
            if notice_time not in self._rebalances_seen:
                self._rebalances_seen.add(notice_time)
                self._on_rebalance(RebalanceRecommendation(notice_time=notice_time))
