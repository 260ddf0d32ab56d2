"""The spot watcher (bootstrap/watcher.py) with scripted IMDS answers (no network): what the agent is told,
how often, and what the journal says about an IMDS outage."""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from bootstrap.eventlog import EventLog
from bootstrap.imds import ImdsClient, ImdsUnavailableError
from bootstrap.watcher import RebalanceRecommendation, SpotWatcher, TerminationNotice

ACTION = "spot/instance-action"
LIFECYCLE = "autoscaling/target-lifecycle-state"
REBALANCE = "events/recommendations/rebalance"


class ScriptedImds(ImdsClient):
    """IMDS answers set by the test; `down` polls left in an outage (each read raises)."""

    def __init__(self) -> None:
        super().__init__("http://127.0.0.1:9")  # never contacted: `get` is replaced
        self.answers: dict[str, str] = {}
        self.down = 0

    def get(self, path: str) -> str | None:
        if self.down:
            self.down -= 1
            raise ImdsUnavailableError("connection refused")
        return self.answers.get(path)


class Journal:
    def __init__(self) -> None:
        self.log = EventLog(io.StringIO())
        self.events: list[dict[str, Any]] = []
        self.log.add_sink(lambda line: self.events.append(json.loads(line)))

    def with_message(self, message: str) -> list[dict[str, Any]]:
        """The journal lines with exactly this message (what an operator greps for); all of the watcher's
        lines are of its stage."""
        assert {e["stage"] for e in self.events} <= {"watcher"}
        return [e for e in self.events if e["message"] == message]


def watcher(
    imds: ImdsClient, journal: Journal | None = None
) -> tuple[SpotWatcher, list[TerminationNotice], list[RebalanceRecommendation]]:
    notices: list[TerminationNotice] = []
    rebalances: list[RebalanceRecommendation] = []
    log = (journal or Journal()).log
    return SpotWatcher(imds, log, 0.02, notices.append, rebalances.append), notices, rebalances


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 20
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_spot_notice_is_reported_once_with_its_action_and_time() -> None:
    imds = ScriptedImds()
    spot, notices, _ = watcher(imds)
    spot.poll_once()
    assert notices == []
    imds.answers[ACTION] = json.dumps({"action": "stop", "time": "2030-01-01T10:02:00Z"})
    for _ in range(3):
        spot.poll_once()
    assert notices == [TerminationNotice("spot", "stop", "2030-01-01T10:02:00Z")]
    imds.answers[LIFECYCLE] = "Terminated"  # the group lets go of it too: still one notice
    spot.poll_once()
    assert len(notices) == 1


def test_a_scale_in_is_reported_once_as_a_terminate_notice_timed_now() -> None:
    imds = ScriptedImds()
    imds.answers[LIFECYCLE] = "InService"
    spot, notices, _ = watcher(imds)
    spot.poll_once()
    assert notices == []
    imds.answers[LIFECYCLE] = "Terminated"
    before = datetime.now(timezone.utc)
    for _ in range(3):
        spot.poll_once()
    assert [(n.source, n.action) for n in notices] == [("scale-in", "terminate")]
    when = datetime.fromisoformat(notices[0].time.replace("Z", "+00:00"))
    assert abs((when - before).total_seconds()) < 60
    imds.answers[ACTION] = json.dumps({"action": "terminate", "time": "2030-01-01T10:02:00Z"})
    spot.poll_once()
    assert len(notices) == 1, "a spot notice after the scale-in is the same stop"


def test_rebalances_and_a_notice_are_both_reported_in_one_poll() -> None:
    imds = ScriptedImds()
    imds.answers[ACTION] = json.dumps({"action": "terminate", "time": "2030-01-01T10:02:00Z"})
    imds.answers[REBALANCE] = json.dumps({"noticeTime": "2030-01-01T10:00:00Z"})
    spot, notices, rebalances = watcher(imds)
    spot.poll_once()
    assert len(notices) == 1
    assert rebalances == [RebalanceRecommendation("2030-01-01T10:00:00Z")]


def test_the_watcher_thread_says_once_that_imds_is_down_once_that_it_is_back_and_still_reports() -> None:
    imds = ScriptedImds()
    journal = Journal()
    spot, notices, _ = watcher(imds, journal)
    imds.down = 4
    spot.start()
    try:
        wait_for(lambda: bool(journal.with_message("IMDS reachable again")), "the recovery")
        imds.answers[ACTION] = json.dumps({"action": "terminate", "time": "2030-01-01T10:02:00Z"})
        wait_for(lambda: bool(notices), "the notice after the outage")
    finally:
        spot.stop()
    assert spot.failed_polls == 4
    down = journal.with_message("IMDS unreachable; training continues, retrying")
    assert len(down) == 1 and down[0]["error"] == "connection refused", "the line says why"
    back = journal.with_message("IMDS reachable again")
    assert len(back) == 1 and back[0]["failed_polls"] == 4
    assert journal.with_message("watching IMDS for spot notices")[0]["poll_seconds"] == 0.02


def test_stop_ends_the_thread_promptly() -> None:
    spot, _, _ = watcher(ScriptedImds())
    spot.start()
    started = time.monotonic()
    spot.stop()
    assert not spot._thread.is_alive()
    assert time.monotonic() - started < 5  # a tick is 20 ms; generous for a loaded 2-core machine


def test_a_watcher_stuck_on_imds_never_holds_up_the_agents_exit() -> None:
    """The interpreter exits without waiting for daemon threads only: a hung IMDS read must not keep an
    agent that is done (or dying) alive."""
    release = threading.Event()

    class Hung(ScriptedImds):
        def get(self, path: str) -> str | None:
            release.wait(30)
            return None

    spot, _, _ = watcher(Hung())
    spot.start()
    try:
        assert spot._thread.daemon
    finally:
        release.set()
        spot.stop()
