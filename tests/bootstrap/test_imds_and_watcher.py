"""IMDSv2 client and spot watcher against the simulator: tokens, 401/404 handling, outages, notices."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

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


def wait_for(condition: object, timeout: float = 30.0) -> None:
    """Waits for the watcher thread (polls of 50 ms); the bound only says when to give up: generous, since a
    loaded 2-core machine can stall a thread for seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(condition) and condition():
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def test_watcher_reports_a_notice_once_and_each_rebalance_once(simulator: ImdsSimulator) -> None:
    notices: list[TerminationNotice] = []
    rebalances: list[RebalanceRecommendation] = []
    watcher = SpotWatcher(ImdsClient(simulator.endpoint), EventLog(), 0.05, notices.append, rebalances.append)
    watcher.start()
    try:
        simulator.inject_rebalance()
        wait_for(lambda: len(rebalances) == 1)
        simulator.inject_spot_notice()
        wait_for(lambda: len(notices) == 1)
        polls = watcher.polls
        wait_for(lambda: watcher.polls > polls + 3)
    finally:
        watcher.stop()
    assert len(notices) == 1 and notices[0].source == "spot" and notices[0].action == "terminate"
    assert len(rebalances) == 1


class ScriptedImds(ImdsClient):
    """IMDS answers set by the test, read without a network: each `poll_once` sees what is set now."""

    def __init__(self) -> None:
        super().__init__("http://127.0.0.1:9")  # never contacted: `get` is replaced
        self.answers: dict[str, str] = {}

    def get(self, path: str) -> str | None:
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
        wait_for(lambda: watcher.failed_polls >= 3)
        simulator.come_back()
        simulator.inject_spot_notice()
        wait_for(lambda: len(notices) == 1)
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
