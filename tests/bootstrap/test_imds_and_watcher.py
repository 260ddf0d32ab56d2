"""IMDSv2 client and spot watcher against the simulator: tokens, 401/404 handling, outages, notices. The
watcher with scripted IMDS answers (no network): what the agent is told, how often, and what the journal
says about an IMDS outage."""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from typing import Any

import pytest

from bootstrap.eventlog import EventLog
from bootstrap.imds import ImdsClient, ImdsUnavailableError
from bootstrap.watcher import RebalanceRecommendation, SpotWatcher, TerminationNotice
from demo.imds import ImdsSimulator, SimulatedInstance


@pytest.fixture()
def simulator() -> Iterator[ImdsSimulator]:
    with ImdsSimulator(SimulatedInstance(instance_id="i-0abc", availability_zone="eu-west-1b")) as sim:
        yield sim


def token_requests(sim: ImdsSimulator) -> int:
    return sum(1 for path in sim.paths_requested() if path == "/latest/api/token")


def test_identity_is_read_with_a_session_token(simulator: ImdsSimulator) -> None:
    identity = ImdsClient(simulator.endpoint).identity("eu-west-1")
    assert (identity.instance_id, identity.az, identity.lifecycle) == ("i-0abc", "eu-west-1b", "spot")
    assert token_requests(simulator) == 1


def test_endpoint_comes_from_the_botocore_variable(
    simulator: ImdsSimulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", simulator.endpoint + "/")
    assert ImdsClient().get("instance-id") == "i-0abc"


def test_no_spot_notice_is_a_404_that_reads_as_none(simulator: ImdsSimulator) -> None:
    assert ImdsClient(simulator.endpoint).get("spot/instance-action") is None


def test_expired_token_gets_401_and_a_new_token(simulator: ImdsSimulator) -> None:
    client = ImdsClient(simulator.endpoint)
    assert client.get("instance-id") == "i-0abc"
    simulator.expire_tokens()
    assert client.get("instance-id") == "i-0abc"
    assert token_requests(simulator) == 2


def test_token_is_renewed_before_it_expires(simulator: ImdsSimulator) -> None:
    # TTL 61 s with a 60 s renewal margin: the token is due for renewal one second after it was issued.
    client = ImdsClient(simulator.endpoint, token_ttl=61)
    client.get("instance-id")
    time.sleep(1.1)
    client.get("instance-id")
    assert token_requests(simulator) == 2
    assert not any(status == 401 for _m, _p, status in simulator.requests)


@pytest.mark.parametrize("mode", ["refuse", "error"])
def test_imds_outage_raises_unavailable_and_recovers(simulator: ImdsSimulator, mode: str) -> None:
    client = ImdsClient(simulator.endpoint, timeout=0.5)
    client.get("instance-id")
    simulator.go_down(mode)
    with pytest.raises(ImdsUnavailableError):
        client.get("spot/instance-action")
    simulator.come_back()
    assert client.get("instance-id") == "i-0abc"


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Waits for the watcher thread; the bound only says when to give up: generous, since a loaded 2-core
    machine can stall a thread for seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_watcher_reports_a_notice_once_and_each_rebalance_once(simulator: ImdsSimulator) -> None:
    notices: list[TerminationNotice] = []
    rebalances: list[RebalanceRecommendation] = []
    watcher = SpotWatcher(ImdsClient(simulator.endpoint), EventLog(), 0.05, notices.append, rebalances.append)
    watcher.start()
    try:
        simulator.inject_rebalance()
        wait_for(lambda: len(rebalances) == 1, "the rebalance recommendation")
        simulator.inject_spot_notice()
        wait_for(lambda: len(notices) == 1, "the spot notice")
        polls = watcher.polls
        wait_for(lambda: watcher.polls > polls + 3, "three more polls after the notice")
    finally:
        watcher.stop()
    assert len(notices) == 1 and notices[0].source == "spot" and notices[0].action == "terminate"
    assert len(rebalances) == 1


class ScriptedImds(ImdsClient):
    """IMDS answers set by the test, read without a network: each `poll_once` sees what is set now; `down`
    polls left in an outage (each read raises)."""

    def __init__(self) -> None:
        super().__init__("http://127.0.0.1:9")  # never contacted: `get` is replaced
        self.answers: dict[str, str] = {}
        self.down = 0

    def get(self, path: str) -> str | None:
        if self.down:
            self.down -= 1
            raise ImdsUnavailableError("connection refused")
        return self.answers.get(path)

    def recommend_rebalance(self, notice_time: str) -> None:
        self.answers["events/recommendations/rebalance"] = json.dumps({"noticeTime": notice_time})


def test_watcher_reports_a_second_rebalance_with_a_new_notice_time_and_never_the_same_one_twice() -> None:
    """A recommendation stays in IMDS until it is withdrawn, and AWS may issue a new one later (a new
    `noticeTime`): each is reported exactly once, however many polls see it, in the order they came."""
    imds = ScriptedImds()
    rebalances: list[RebalanceRecommendation] = []
    watcher = SpotWatcher(imds, EventLog(), 0.05, print, rebalances.append)
    watcher.poll_once()
    assert rebalances == []
    imds.recommend_rebalance("2030-01-01T10:00:00Z")
    for _ in range(3):
        watcher.poll_once()
    assert [r.notice_time for r in rebalances] == ["2030-01-01T10:00:00Z"]
    imds.answers.clear()  # withdrawn, then the same one shown again: still reported once
    watcher.poll_once()
    imds.recommend_rebalance("2030-01-01T10:00:00Z")
    watcher.poll_once()
    assert [r.notice_time for r in rebalances] == ["2030-01-01T10:00:00Z"]
    imds.recommend_rebalance("2030-01-01T10:07:00Z")  # a new recommendation
    for _ in range(3):
        watcher.poll_once()
    assert [r.notice_time for r in rebalances] == ["2030-01-01T10:00:00Z", "2030-01-01T10:07:00Z"]


def test_watcher_keeps_polling_through_an_imds_outage(simulator: ImdsSimulator) -> None:
    notices: list[TerminationNotice] = []
    watcher = SpotWatcher(
        ImdsClient(simulator.endpoint, timeout=0.3), EventLog(), 0.05, notices.append, print
    )
    watcher.start()
    try:
        simulator.go_down("refuse")
        wait_for(lambda: watcher.failed_polls >= 3, "three failed polls while IMDS refuses")
        simulator.come_back()
        simulator.inject_spot_notice()
        wait_for(lambda: len(notices) == 1, "the spot notice once IMDS is back")
    finally:
        watcher.stop()


def test_watcher_treats_a_scale_in_termination_as_a_notice() -> None:
    with ImdsSimulator(lifecycle_state=lambda _instance: "Terminated") as sim:
        notices: list[TerminationNotice] = []
        watcher = SpotWatcher(ImdsClient(sim.endpoint), EventLog(), 0.05, notices.append, print)
        watcher.poll_once()
    assert [n.source for n in notices] == ["scale-in"]


def test_the_simulated_lifecycle_state_asks_the_group_at_most_once_a_second_and_then_follows_it() -> None:
    from demo.imds import LIFECYCLE_REFRESH_S

    asked: list[str] = []
    held = {"state": "InService"}

    def group(instance_id: str) -> str:
        asked.append(instance_id)
        return held["state"]

    def at_most_once_a_second() -> None:
        # Counted against the time taken, not assumed: five reads can take over a second on a loaded machine.
        assert 1 <= len(asked) <= 1 + (time.monotonic() - began) // LIFECYCLE_REFRESH_S, asked

    with ImdsSimulator(SimulatedInstance(instance_id="i-1"), lifecycle_state=group) as sim:
        client = ImdsClient(sim.endpoint)
        began = time.monotonic()
        assert [client.get("autoscaling/target-lifecycle-state") for _ in range(5)] == ["InService"] * 5
        at_most_once_a_second()
        held["state"] = "Terminated"
        # A generous bound: the next refresh is a second away, on a loaded machine perhaps several.
        deadline = time.monotonic() + LIFECYCLE_REFRESH_S + 30
        while client.get("autoscaling/target-lifecycle-state") != "Terminated":
            assert time.monotonic() < deadline, "the group's decision never reached IMDS"
            time.sleep(0.05)
        at_most_once_a_second()


# -- the watcher with scripted IMDS answers: what the agent is told, how often, an outage's lines ----------


ACTION = "spot/instance-action"
LIFECYCLE = "autoscaling/target-lifecycle-state"
REBALANCE = "events/recommendations/rebalance"


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


def scripted_watcher(
    imds: ImdsClient, journal: Journal | None = None
) -> tuple[SpotWatcher, list[TerminationNotice], list[RebalanceRecommendation]]:
    notices: list[TerminationNotice] = []
    rebalances: list[RebalanceRecommendation] = []
    log = (journal or Journal()).log
    return SpotWatcher(imds, log, 0.02, notices.append, rebalances.append), notices, rebalances


def test_a_spot_notice_is_reported_once_with_its_action_and_time() -> None:
    imds = ScriptedImds()
    spot, notices, _ = scripted_watcher(imds)
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
    spot, notices, _ = scripted_watcher(imds)
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
    spot, notices, rebalances = scripted_watcher(imds)
    spot.poll_once()
    assert len(notices) == 1
    assert rebalances == [RebalanceRecommendation("2030-01-01T10:00:00Z")]


def test_the_watcher_thread_says_once_that_imds_is_down_once_that_it_is_back_and_still_reports() -> None:
    imds = ScriptedImds()
    journal = Journal()
    spot, notices, _ = scripted_watcher(imds, journal)
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
    spot, _, _ = scripted_watcher(ScriptedImds())
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

    spot, _, _ = scripted_watcher(Hung())
    spot.start()
    try:
        assert spot._thread.daemon
    finally:
        release.set()
        spot.stop()
