"""One writer per single-node job as one life lives it (bootstrap/standby.py), against the moto server: the
first life holds the lease, the next waits warm as the standby and takes over the moment the holder lets go
(or dies), any further one leaves; the holder renews, hands over when at risk, proves the lease before it
ends the job, and stops on its own clock when it cannot renew.

The module's clock is a fake one (`Clock`): every wait advances it, so a test of a five-second beat or a
sixty-second lease runs in milliseconds and its times are exact. The lease's own record (bootstrap/lease.py)
is test_lease.py's."""

from __future__ import annotations

import io
import json
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, ClassVar, cast

import boto3
import pytest
from botocore.exceptions import EndpointConnectionError

from bootstrap import standby as standby_module
from bootstrap.agent_config import AgentConfig, Prefixes
from bootstrap.eventlog import EventLog
from bootstrap.lease import StandbyRecord
from bootstrap.outcomes import Failure, LifeEnd
from bootstrap.standby import OneWriter, Role, wait_warm
from bootstrap.stops import StopRequests
from bootstrap.trainer import TrainerProcess
from tests.conftest import MotoServer

BUCKET = "trainstack-standby"
JOB = "demo-1a2b3c4d"
STATE = f"jobs/{JOB}/state/"
LEASE_KEY = STATE + "lease.json"
STANDBY_KEY = STATE + "standby.json"
STALE = 60.0
DRIFT = 10.0
T0 = 1_800_000_000.0
MONO0 = 1000.0


class Clock:
    """The module's `time`: monotonic and wall clocks that move only when something waits."""

    def __init__(self) -> None:
        self.mono = MONO0
        self.wall = T0

    def monotonic(self) -> float:
        return self.mono

    def time(self) -> float:
        return self.wall

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def advance(self, seconds: float) -> None:
        self.mono += seconds
        self.wall += seconds


@pytest.fixture()
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(standby_module, "time", fake)
    return fake


@pytest.fixture()
def s3(aws: MotoServer) -> Any:
    client = boto3.client("s3", region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    return client


class Log:
    """An EventLog whose events the test reads back."""

    def __init__(self) -> None:
        self.stream = io.StringIO()
        self.log = EventLog(stream=self.stream)

    @property
    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.stream.getvalue().splitlines()]

    def named(self, message: str) -> list[dict[str, Any]]:
        return [event for event in self.events if event["message"] == message]

    def one(self, message: str) -> dict[str, Any]:
        found = self.named(message)
        assert len(found) == 1, f"expected one event {message!r}, got {[e['message'] for e in self.events]}"
        return found[0]


class Flaky:
    """An S3 client whose calls (of the named operations, or all) fail while `down`, as botocore's do when the
    link is cut."""

    def __init__(self, client: Any, *operations: str) -> None:
        self._client = client
        self._operations = set(operations)
        self.down = False
        self.failures = 0

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._client, name)

        def call(**kwargs: Any) -> Any:
            if self.down and (not self._operations or name in self._operations):
                self.failures += 1
                raise EndpointConnectionError(endpoint_url="https://s3.example.invalid")
            return method(**kwargs)

        return call


def config() -> AgentConfig:
    return AgentConfig(
        region="us-east-1",
        bucket=BUCKET,
        group_name="g",
        topic_arn="arn:aws:sns:us-east-1:1:t",
        log_group="/l",
        prefixes=Prefixes(state=STATE),
        job_id=JOB,
    )


def writer(
    s3: Any, instance: str, log: Log | None = None, life: str = "", stale: float = STALE, **kwargs: Any
) -> tuple[OneWriter, Log]:
    log = log or Log()
    one = OneWriter(
        s3,
        config(),
        log.log,
        instance_id=instance,
        life_id=life or f"{instance}@life",
        stale_seconds=stale,
        **kwargs,
    )
    return one, log


def stored(s3: Any, key: str = LEASE_KEY) -> dict[str, Any] | None:
    try:
        body = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    except s3.exceptions.NoSuchKey:
        return None
    return dict(json.loads(body))


def record(s3: Any, key: str, **fields: Any) -> None:
    s3.put_object(Bucket=BUCKET, Key=key, Body=json.dumps(fields).encode())


def other_standby(s3: Any, instance: str) -> StandbyRecord:
    return StandbyRecord(
        s3, BUCKET, STANDBY_KEY, instance_id=instance, life_id=f"{instance}@life", stale_seconds=STALE
    )


def holding(s3: Any, clock: Clock, instance: str = "i-a") -> tuple[OneWriter, Log]:
    one, log = writer(s3, instance)
    assert one.take(floor=0) is Role.HOLDER
    return one, log


# -- who this life is for its job (`take`) ------------------------------------------------------------------


def test_the_first_life_holds_the_next_waits_as_standby_and_a_third_leaves(s3: Any, clock: Clock) -> None:
    a, a_log = writer(s3, "i-a")
    assert a.role is None and not a.holding
    assert a.take(floor=0) is Role.HOLDER and a.role is Role.HOLDER and a.holding
    acquired = a_log.one("lease acquired")
    assert acquired["stage"] == "lease"
    assert (acquired["token"], acquired["uri"]) == (1, f"s3://{BUCKET}/{LEASE_KEY}")
    assert "from" not in acquired and "stop_step" not in acquired, "no lease was replaced"
    lease = stored(s3)
    assert lease is not None
    assert (lease["holder"], lease["life_id"], lease["job_id"]) == ("i-a", "i-a@life", JOB)
    assert lease["expires_at"] == T0 + STALE, "the lease is STALE seconds long"
    assert a.dead_holder() is None, "it replaced nobody"

    b, b_log = writer(s3, "i-b")
    assert b.take(floor=0) is Role.STANDBY and not b.holding
    waiting = b_log.one("the job's lease is held; waiting warm as its standby")
    assert (waiting["stage"], waiting["holder"]) == ("standby", "i-a")
    standby = stored(s3, STANDBY_KEY)
    assert standby is not None and (standby["instance_id"], standby["life_id"]) == ("i-b", "i-b@life")
    assert standby["ready_at"] is None, "claimed, not yet ready"

    c, c_log = writer(s3, "i-c")
    assert c.take(floor=0) is Role.SURPLUS and not c.holding
    leaving = c_log.one("the job has a holder and a standby already: this instance leaves")
    assert (leaving["stage"], leaving["holder"], leaving["standby"]) == ("standby", "i-a", "i-b")
    assert stored(s3, STANDBY_KEY) == standby, "the surplus instance left the standby's record alone"


def test_the_first_token_is_above_the_one_latest_json_carries(s3: Any, clock: Clock) -> None:
    a, a_log = writer(s3, "i-a")
    assert a.take(floor=7) is Role.HOLDER
    assert a_log.one("lease acquired")["token"] == 8 and a.lease.token == 8


def test_a_released_lease_is_taken_with_the_holders_stop_step_and_its_life_is_no_dead_holder(
    s3: Any, clock: Clock
) -> None:
    a, _ = holding(s3, clock)
    a.release(40)
    b, b_log = writer(s3, "i-b")
    assert b.take(floor=0) is Role.HOLDER
    acquired = b_log.one("lease acquired")
    assert (acquired["token"], acquired["from"], acquired["stop_step"]) == (2, "i-a", 40)
    assert b.dead_holder() is None, "the holder let go: its life ended on its own"


def test_a_holder_silent_past_its_expiry_is_the_dead_holder_of_the_life_that_takes_over(
    s3: Any, clock: Clock
) -> None:
    holding(s3, clock)
    b, _ = writer(s3, "i-b")
    clock.advance(STALE + DRIFT - 1)
    assert b.take(floor=0) is Role.STANDBY, "within its expiry and the drift margin the holder is alive"
    clock.advance(1)
    assert b.take(floor=0) is Role.HOLDER
    assert b.dead_holder() == "i-a@life", "its life is closed as interrupted at its heartbeat"


def test_a_lease_left_by_this_very_life_under_another_name_is_no_dead_holder(s3: Any, clock: Clock) -> None:
    """The life id is the ledger's: a lease naming this life (its instance renamed in the record) is never
    another life to close as interrupted."""
    record(
        s3, LEASE_KEY, holder="i-renamed", life_id="i-b@life", token=3, acquired_at=T0 - 100,
        heartbeat_at=T0 - 100, expires_at=T0 - 100 + STALE,
    )  # fmt: skip
    b, _ = writer(s3, "i-b")
    assert b.take(floor=0) is Role.HOLDER
    assert b.lease.replaced is not None and b.lease.replaced.holder == "i-renamed"
    assert b.dead_holder() is None


# -- a holder whose instance left the group (`instance_gone`) -----------------------------------------------


def test_a_holder_gone_from_the_group_is_taken_over_at_once_and_named_dead(s3: Any, clock: Clock) -> None:
    holding(s3, clock)
    asked: list[str] = []

    def gone(instance: str) -> bool:
        asked.append(instance)
        return True

    b, b_log = writer(s3, "i-b", instance_gone=gone)
    clock.advance(2)
    assert b.take(floor=5) is Role.HOLDER, "a live-looking lease of an instance the group no longer has"
    assert asked == ["i-a"]
    left = b_log.one("the lease's holder has left the group: taking over now")
    assert (left["stage"], left["holder"]) == ("lease", "i-a")
    assert b_log.one("lease acquired")["token"] == 6, "above the token latest.json carries"
    assert b.lease.own_deadline() == MONO0 + 2 + STALE, "its own deadline counts from this proof"
    assert b.dead_holder() == "i-a@life"


def test_a_life_that_can_ask_the_group_takes_a_free_lease_as_any_other(s3: Any, clock: Clock) -> None:
    asked: list[str] = []

    def gone(instance: str) -> bool:
        asked.append(instance)
        return True

    a, _ = writer(s3, "i-a", instance_gone=gone)
    assert a.take(floor=0) is Role.HOLDER and a.holding and asked == []


def test_the_lease_and_the_standby_record_last_the_stale_limit_given(s3: Any, clock: Clock) -> None:
    a, _ = writer(s3, "i-a", stale=20.0, drift_seconds=3.0)
    assert a.take(floor=0) is Role.HOLDER
    assert stored(s3)["expires_at"] == T0 + 20  # type: ignore[index]
    assert a.lease.own_deadline() == MONO0 + 20
    b, _ = writer(s3, "i-b", stale=20.0, drift_seconds=3.0)
    assert b.take(floor=0) is Role.STANDBY
    clock.advance(19)
    c, _ = writer(s3, "i-c", stale=20.0, drift_seconds=3.0)
    assert c.take(floor=0) is Role.SURPLUS, "the standby beat 19 s ago: alive"
    clock.advance(1)
    assert c.take(floor=0) is Role.STANDBY, "20 s without a beat: the standby is stale and replaced"
    clock.advance(2)
    d, _ = writer(s3, "i-d", stale=20.0, drift_seconds=3.0)
    assert d.take(floor=0) is not Role.HOLDER, "within the 3 s drift margin after the lease's expiry"
    clock.advance(1)
    assert d.take(floor=0) is Role.HOLDER


def test_a_group_that_cannot_say_leaves_the_decision_to_the_stale_limit(s3: Any, clock: Clock) -> None:
    holding(s3, clock)

    def unknown(instance: str) -> bool:
        raise RuntimeError("DescribeAutoScalingGroups throttled")

    b, b_log = writer(s3, "i-b", instance_gone=unknown)
    assert b.take(floor=0) is Role.STANDBY
    still, _ = writer(s3, "i-c", instance_gone=lambda instance: False)
    assert still.take(floor=0) is Role.SURPLUS, "a holder still in the group is waited for"
    assert b_log.named("the lease's holder has left the group: taking over now") == []
    assert stored(s3) is not None and stored(s3)["holder"] == "i-a"  # type: ignore[index]


# -- the standby's wait (`wait_for_lease`) -----------------------------------------------------------------


class Waiting:
    """`stopping(timeout)` for wait_for_lease: each call waits `timeout` on the fake clock; `then` runs at
    the given call numbers (1-based); `stop_at` ends the wait."""

    def __init__(
        self,
        clock: Clock,
        stop_at: int | None = None,
        each: Callable[[], Any] | None = None,
        **then: Callable[[], Any],
    ) -> None:
        self.clock = clock
        self.each = each
        self.calls = 0
        self.timeouts: list[float] = []
        self.stop_at = stop_at
        self.then = {int(key.lstrip("_")): action for key, action in then.items()}

    def __call__(self, timeout: float) -> bool:
        self.calls += 1
        # The test's own deadline: a wait that never ends fails here, named, not at pytest's timeout.
        assert self.calls <= 1000, "the standby still waited after 1000 polls"
        self.timeouts.append(timeout)
        if self.each is not None:
            self.each()
        if self.calls in self.then:
            self.then[self.calls]()
        if self.stop_at is not None and self.calls >= self.stop_at:
            return True
        self.clock.advance(timeout)
        return False


def standing_by(s3: Any, clock: Clock, instance: str = "i-b", **kwargs: Any) -> tuple[OneWriter, Log]:
    one, log = writer(s3, instance, **kwargs)
    assert one.take(floor=0) is Role.STANDBY
    return one, log


def test_the_standby_takes_over_within_a_second_of_the_holders_release_at_its_stop_step(
    s3: Any, clock: Clock
) -> None:
    a, _ = holding(s3, clock)
    b, b_log = standing_by(s3, clock)
    b.ready()
    released_at: list[float] = []

    def release() -> None:
        a.release(57)
        released_at.append(clock.mono)

    waiting = Waiting(clock, _3=release)
    assert b.wait_for_lease(stopping=waiting, job_ended=lambda: False, floor=5) == 6, "above latest.json's"
    assert b.role is Role.HOLDER and b.holding
    assert b.lease.own_deadline() == clock.mono + STALE, "its own deadline counts from the take-over"
    assert set(waiting.timeouts) == {1.0}, "the lease is polled every second"
    assert clock.mono - released_at[0] <= 1.0, "taken over within a poll of the release"
    taken = b_log.one("lease taken over")
    assert taken["stage"] == "lease"
    assert (taken["token"], taken["stop_step"], taken["from"], taken["expired"]) == (6, 57, "i-a", False)
    assert stored(s3, STANDBY_KEY) is None, "the new holder is no standby any more: its record is gone"
    lease = stored(s3)
    assert lease is not None and (lease["holder"], lease["token"]) == ("i-b", 6)


def test_a_lease_deleted_by_hand_while_the_standby_waits_is_taken_above_latest_jsons_token(
    s3: Any, clock: Clock
) -> None:
    holding(s3, clock)
    b, b_log = standing_by(s3, clock)

    def deleted() -> None:
        s3.delete_object(Bucket=BUCKET, Key=LEASE_KEY)

    assert b.wait_for_lease(stopping=Waiting(clock, _2=deleted), job_ended=lambda: False, floor=4) == 5
    taken = b_log.one("lease taken over")
    assert (taken["token"], taken["stop_step"], taken["from"], taken["expired"]) == (5, None, None, False)


def test_the_standby_takes_over_a_silent_holder_exactly_at_its_expiry_plus_the_drift_margin(
    s3: Any, clock: Clock
) -> None:
    holding(s3, clock)
    b, b_log = standing_by(s3, clock)
    assert b.wait_for_lease(stopping=Waiting(clock), job_ended=lambda: False, floor=0) == 2
    assert clock.wall == T0 + STALE + DRIFT, "not a poll before the margin ends, nor a poll after"
    taken = b_log.one("lease taken over")
    assert (taken["stop_step"], taken["from"], taken["expired"]) == (None, "i-a", True)
    assert b.dead_holder() == "i-a@life"


def test_the_standby_takes_over_from_a_holder_that_left_the_group_within_a_beat(
    s3: Any, clock: Clock
) -> None:
    holding(s3, clock)
    gone = {"i-a": False}
    asked: list[float] = []

    def instance_gone(instance: str) -> bool:
        asked.append(clock.mono)
        return gone[instance]

    b, _ = standing_by(s3, clock, instance_gone=instance_gone)
    asked.clear()
    waiting = Waiting(clock, _11=lambda: gone.update({"i-a": True}))
    assert b.wait_for_lease(stopping=waiting, job_ended=lambda: False, floor=0) == 2
    # Gone at 10 s; the group is asked once per 5-second beat (an API call), so it is seen by 15 s.
    assert clock.mono - MONO0 <= 15.0, "the silent holder was waited for longer than a beat"
    assert clock.wall < T0 + STALE, "taken before the stale limit"
    assert len(asked) == 3 and asked == [MONO0 + 5.0, MONO0 + 10.0, MONO0 + 15.0], "once a beat"


def test_the_standby_leaves_within_a_beat_once_the_job_ended(s3: Any, clock: Clock) -> None:
    holding(s3, clock)
    b, b_log = standing_by(s3, clock)
    ended: list[float] = []

    def job_ended() -> bool:
        ended.append(clock.mono)
        return clock.mono >= MONO0 + 7

    assert b.wait_for_lease(stopping=Waiting(clock), job_ended=job_ended, floor=0) is None
    assert ended == [MONO0 + 5.0, MONO0 + 10.0], "asked every five seconds"
    event = b_log.one("the job ended while this standby waited")
    assert event["stage"] == "standby"
    assert b.role is Role.STANDBY and not b.holding


def test_a_waiting_standby_keeps_its_record_beating_so_the_holder_can_hand_over_to_it(
    s3: Any, clock: Clock
) -> None:
    a, _ = holding(s3, clock)
    b, _ = standing_by(s3, clock)
    b.ready()
    waiting = Waiting(clock, stop_at=75, each=lambda: a.lease.renew(clock.wall))
    assert b.wait_for_lease(stopping=waiting, job_ended=lambda: False, floor=0) is None
    # 74 s later (past the stale limit): the holder still sees a live, ready standby.
    a.at_risk = True
    standby = stored(s3, STANDBY_KEY)
    assert standby is not None and clock.wall - standby["heartbeat_at"] <= 5.0
    assert a.handover_due(clock.wall) == "handover"


def test_a_standby_replaced_by_another_leaves(s3: Any, clock: Clock) -> None:
    holding(s3, clock)
    b, b_log = standing_by(s3, clock)

    def replaced() -> None:
        s3.delete_object(Bucket=BUCKET, Key=STANDBY_KEY)
        assert other_standby(s3, "i-c").claim(clock.wall)

    assert b.wait_for_lease(stopping=Waiting(clock, _2=replaced), job_ended=lambda: False, floor=0) is None
    assert clock.mono - MONO0 <= 5.0
    assert b_log.one("another instance took over as standby; leaving")["stage"] == "standby"
    standby = stored(s3, STANDBY_KEY)
    assert standby is not None and standby["instance_id"] == "i-c", "the other standby's record is left"


def test_a_stop_ends_the_wait_without_the_lease(s3: Any, clock: Clock) -> None:
    a, _ = holding(s3, clock)
    b, _ = standing_by(s3, clock)
    a.release(3)  # free, but the stop came first
    assert b.wait_for_lease(stopping=Waiting(clock, stop_at=1), job_ended=lambda: False, floor=0) is None
    assert b.role is Role.STANDBY and stored(s3)["holder"] == "i-a"  # type: ignore[index]


def test_a_standby_keeps_waiting_through_an_s3_outage_says_so_once_and_takes_over_after(
    s3: Any, clock: Clock
) -> None:
    a, _ = holding(s3, clock)
    link = Flaky(s3)
    b, b_log = writer(link, "i-b")
    assert b.take(floor=0) is Role.STANDBY

    def cut() -> None:
        link.down = True

    def heal() -> None:
        link.down = False
        a.release(9)

    waiting = Waiting(clock, _1=cut, _12=heal)
    assert b.wait_for_lease(stopping=waiting, job_ended=lambda: False, floor=0) == 2
    assert link.failures >= 10
    said = b_log.one("cannot read the lease; will retry")
    assert said["stage"] == "standby" and "s3.example.invalid" in said["error"]
    assert b_log.one("lease taken over")["stop_step"] == 9


def test_a_single_failed_poll_of_the_lease_is_said(s3: Any, clock: Clock) -> None:
    a, _ = holding(s3, clock)
    link = Flaky(s3)
    b, b_log = writer(link, "i-b")
    assert b.take(floor=0) is Role.STANDBY

    def cut() -> None:
        link.down = True

    def heal() -> None:
        link.down = False
        a.release(1)

    assert b.wait_for_lease(stopping=Waiting(clock, _1=cut, _2=heal), job_ended=lambda: False, floor=0) == 2
    assert link.failures == 1
    assert b_log.one("cannot read the lease; will retry")["stage"] == "standby"


def test_end_standby_takes_a_standbys_record_with_it_and_a_failure_to_is_only_said(
    s3: Any, clock: Clock
) -> None:
    a, _ = holding(s3, clock)
    a.end_standby()
    b, _ = standing_by(s3, clock)
    a.end_standby()
    assert stored(s3, STANDBY_KEY) is not None, "the holder has no standby record to remove"
    b.end_standby()
    assert stored(s3, STANDBY_KEY) is None

    link = Flaky(s3, "delete_object")
    c, c_log = writer(link, "i-c")
    assert c.take(floor=0) is Role.STANDBY
    link.down = True
    c.end_standby()  # no exception: the record goes stale on its own
    said = c_log.one("could not clear the standby record")
    assert said["stage"] == "standby" and "s3.example.invalid" in said["error"]


# -- the holder: renewals, the hand-over, the proof before the job's end, the release --------------------


def test_poll_renews_the_holders_lease_and_says_nothing_while_all_is_well(s3: Any, clock: Clock) -> None:
    a, _ = holding(s3, clock)
    clock.advance(20)
    assert a.poll() is None
    lease = stored(s3)
    assert lease is not None and lease["heartbeat_at"] == T0 + 20 and lease["expires_at"] == T0 + 20 + STALE
    assert a.lease.own_deadline() == MONO0 + 20 + STALE, "the proof moved this life's own deadline"
    b, _ = standing_by(s3, clock)
    assert b.poll() is None
    assert stored(s3, STANDBY_KEY)["heartbeat_at"] == T0 + 20  # type: ignore[index]
    assert stored(s3)["heartbeat_at"] == T0 + 20, "a standby renews nothing"  # type: ignore[index]


def test_poll_says_lease_lost_once_another_life_holds_it(s3: Any, clock: Clock) -> None:
    a, a_log = holding(s3, clock)
    clock.advance(STALE + DRIFT)
    taker, _ = writer(s3, "i-b")
    assert taker.take(floor=0) is Role.HOLDER
    assert a.poll() == "lease_lost"
    lost = a_log.one("lease lost: this instance stops writing the job")
    assert lost["stage"] == "lease" and "i-b" in lost["error"]


def test_an_at_risk_holder_hands_over_only_to_a_ready_standby_of_another_instance(
    s3: Any, clock: Clock
) -> None:
    a, a_log = holding(s3, clock)
    b, _ = standing_by(s3, clock)
    b.ready()
    assert a.poll() is None and a.handover_due() is None, "no rebalance recommendation: no hand-over"
    b.standby.clear()
    assert b.take(floor=0) is Role.STANDBY
    a.at_risk = True
    assert a.poll() is None and a.handover_due() is None, "the standby is not ready yet"
    b.ready()
    a.at_risk = True
    assert a.handover_due() == "handover"
    assert a.poll() == "handover"
    said = a_log.named("a standby is ready: handing over at the next step boundary")
    assert said and said[0]["stage"] == "handover" and said[0]["standby"] == "i-b"
    b.at_risk = True
    assert b.handover_due() is None, "a standby hands nothing over"
    assert a.handover_due(clock.wall + STALE) is None, (
        "judged at the time given: by then the standby is stale"
    )
    clock.advance(STALE)
    assert a.handover_due() is None, "a ready standby that stopped beating is not ready"


def test_a_holder_never_hands_over_to_its_own_instance(s3: Any, clock: Clock) -> None:
    a, _ = holding(s3, clock)
    mine = StandbyRecord(s3, BUCKET, STANDBY_KEY, instance_id="i-a", life_id="i-a@other", stale_seconds=STALE)
    assert mine.claim(clock.wall) and mine.mark_ready(clock.wall)
    a.at_risk = True
    assert a.handover_due(clock.wall) is None


def test_confirm_proves_the_lease_before_an_end_of_the_job(s3: Any, clock: Clock) -> None:
    a, _ = holding(s3, clock)
    clock.advance(30)
    assert a.confirm() is True
    lease = stored(s3)
    assert lease is not None and lease["expires_at"] == T0 + 30 + STALE
    assert a.lease.own_deadline() == MONO0 + 30 + STALE
    b, _ = standing_by(s3, clock)
    assert b.confirm() is False, "a life that holds no lease ends no job"


def test_confirm_says_false_once_another_life_holds_the_lease(s3: Any, clock: Clock) -> None:
    a, a_log = holding(s3, clock)
    clock.advance(STALE + DRIFT)
    taker, _ = writer(s3, "i-b")
    assert taker.take(floor=0) is Role.HOLDER
    assert a.confirm() is False
    lost = a_log.one("lease lost before the job's end: this life ends superseded")
    assert lost["stage"] == "lease" and "i-b" in lost["error"]


def test_confirm_retries_an_outage_and_proves_the_lease_once_s3_answers(s3: Any, clock: Clock) -> None:
    link = Flaky(s3)
    a, a_log = writer(link, "i-a")
    assert a.take(floor=0) is Role.HOLDER
    link.down = True
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock.advance(seconds)
        if len(slept) == 3:
            link.down = False

    clock.sleep = sleep  # type: ignore[method-assign]
    assert a.confirm(retry_seconds=2.0) is True
    assert slept == [2.0, 2.0, 2.0]
    assert a_log.named("lease lost before the job's end: this life ends superseded") == []


def test_confirm_gives_up_before_the_lease_ends_by_this_instances_clock(s3: Any, clock: Clock) -> None:
    link = Flaky(s3)
    a, a_log = writer(link, "i-a")
    assert a.take(floor=0) is Role.HOLDER
    link.down = True
    assert a.confirm() is None
    # Retried every second until the next try would end past the own deadline (STALE after the proof).
    assert clock.mono == MONO0 + STALE - 1.0
    said = a_log.one(
        "cannot prove the lease before its expiry on this instance's clock: the job's end is left to the "
        "next life"
    )
    assert said["stage"] == "lease" and "s3.example.invalid" in said["error"]


class Ticks:
    """`done(timeout)` / a `threading.Event` for the holder's loops: each wait moves the fake clock by `step`
    (None: the timeout asked for) and the loop ends after `count` waits; `then` runs at the given waits."""

    def __init__(self, clock: Clock, count: int, step: float | None = None, **then: Callable[[], Any]):
        self.clock = clock
        self.count = count
        self.step = step
        self.calls = 0
        self.timeouts: list[float] = []
        self.then = {int(key.lstrip("_")): action for key, action in then.items()}

    def __call__(self, timeout: float) -> bool:
        self.calls += 1
        self.timeouts.append(timeout)
        if self.calls in self.then:
            self.then[self.calls]()
        if self.calls >= self.count:
            return True
        self.clock.advance(self.step if self.step is not None else timeout)
        return False

    def wait(self, timeout: float) -> bool:
        return self(timeout)


def test_keep_renews_the_lease_while_the_end_is_acted_on_and_rides_out_an_outage(
    s3: Any, clock: Clock
) -> None:
    link = Flaky(s3)
    a, _ = writer(link, "i-a")
    assert a.take(floor=0) is Role.HOLDER

    def cut() -> None:
        link.down = True

    def heal() -> None:
        link.down = False

    done = Ticks(clock, count=6, _2=cut, _4=heal)
    a.keep(cast(threading.Event, done), every_seconds=10.0)
    assert done.timeouts == [10.0] * 6
    lease = stored(s3)
    # Renewed after the waits at 10 s (before the cut), 40 s and 50 s; the outage's two failed quietly.
    assert lease is not None and lease["heartbeat_at"] == T0 + 50 and lease["expires_at"] == T0 + 50 + STALE
    assert a.lease.own_deadline() == MONO0 + 50 + STALE


def test_keep_renews_nothing_for_a_life_that_does_not_hold_the_lease(s3: Any, clock: Clock) -> None:
    holding(s3, clock)
    b, _ = standing_by(s3, clock)
    done = Ticks(clock, count=5)
    b.keep(cast(threading.Event, done), every_seconds=10.0)
    assert done.calls == 1, "it returned at its first tick"
    assert stored(s3)["heartbeat_at"] == T0  # type: ignore[index]


def test_release_lets_the_lease_go_with_the_stop_step(s3: Any, clock: Clock) -> None:
    a, a_log = holding(s3, clock)
    clock.advance(12)
    a.release(31)
    lease = stored(s3)
    assert lease is not None and (lease["released_at"], lease["stop_step"]) == (T0 + 12, 31)
    said = a_log.one("lease released")
    assert (said["stage"], said["stop_step"]) == ("lease", 31)


def test_only_the_holder_releases_and_a_lost_lease_is_not_said_released(s3: Any, clock: Clock) -> None:
    a, a_log = holding(s3, clock)
    b, b_log = standing_by(s3, clock)
    b.release(5)
    assert stored(s3)["released_at"] is None and b_log.named("lease released") == []  # type: ignore[index]
    clock.advance(STALE + DRIFT)
    taker, _ = writer(s3, "i-c")
    assert taker.take(floor=0) is Role.HOLDER
    a.release(5)
    assert a_log.named("lease released") == []
    assert stored(s3)["holder"] == "i-c" and stored(s3)["released_at"] is None  # type: ignore[index]


def test_a_release_s3_refuses_is_said_and_left_to_expire(s3: Any, clock: Clock) -> None:
    link = Flaky(s3)
    a, a_log = writer(link, "i-a")
    assert a.take(floor=0) is Role.HOLDER
    link.down = True
    a.release(8)  # no exception
    said = a_log.one("could not release the lease; it expires on its own")
    assert said["stage"] == "lease" and "s3.example.invalid" in said["error"]
    assert a_log.named("lease released") == []


# -- the holder's own clock (`watch_own_clock`) -------------------------------------------------------------


def test_half_the_lease_unrenewed_asks_the_trainer_to_stop_and_kills_it_at_the_leases_end(
    s3: Any, clock: Clock
) -> None:
    a, a_log = holding(s3, clock)
    stops = StopRequests(a_log.log, deadline_seconds=100)
    seen: list[tuple[float, str | None, float | None]] = []

    def look() -> None:
        seen.append((clock.mono, stops.reason, stops.kill_at))

    # 0.25 s a tick (exact in binary): 120 ticks reach half the lease, 30 s.
    done = Ticks(clock, count=125, step=0.25, **{f"_{n}": look for n in (120, 121)})
    a.watch_own_clock(stops, done)
    assert all(timeout <= 0.5 for timeout in done.timeouts), "the own clock is looked at often"
    assert seen[0] == (MONO0 + 29.75, None, None), "nothing before half the lease"
    assert seen[1] == (MONO0 + 30.0, "lease_expiring", MONO0 + STALE)
    asked = a_log.one("stop requested")
    assert (asked["reason"], asked["unrenewed_s"], asked["kill_in_s"]) == ("lease_expiring", 30.0, 30.0)


def test_a_stop_under_way_is_kept_but_must_end_before_the_lease_does(s3: Any, clock: Clock) -> None:
    a, a_log = holding(s3, clock)
    stops = StopRequests(a_log.log, deadline_seconds=100)
    stops.request("spot_interruption")
    a.watch_own_clock(stops, Ticks(clock, count=200, step=0.25))
    assert stops.reason == "spot_interruption" and stops.kill_at == MONO0 + STALE
    assert [e["reason"] for e in a_log.named("stop requested")] == ["spot_interruption"]


def test_a_renewal_after_the_kill_time_was_set_moves_the_kill_with_the_lease(s3: Any, clock: Clock) -> None:
    a, a_log = holding(s3, clock)
    stops = StopRequests(a_log.log, deadline_seconds=100)
    kills: list[float | None] = []

    def renew() -> None:
        a.lease.renew(clock.wall, proof_at=clock.mono)

    done = Ticks(
        clock, count=140, step=0.25, _125=lambda: kills.append(stops.kill_at), _130=renew,
        _132=lambda: kills.append(stops.kill_at),
    )  # fmt: skip
    a.watch_own_clock(stops, done)
    assert kills == [MONO0 + STALE, MONO0 + 32.25 + STALE]


def test_a_standby_that_takes_over_is_watched_on_its_clock_from_then_on(s3: Any, clock: Clock) -> None:
    a, _ = holding(s3, clock)
    b, b_log = standing_by(s3, clock)
    stops = StopRequests(b_log.log, deadline_seconds=100)
    taken: list[float] = []

    def take_over() -> None:
        a.release(3)
        assert b.take(floor=0) is Role.HOLDER
        taken.append(clock.mono)

    b.watch_own_clock(stops, Ticks(clock, count=400, step=0.25, _20=take_over))
    assert stops.reason == "lease_expiring", "the new holder stops on its own clock too"
    assert stops.kill_at == taken[0] + STALE


def test_a_life_that_holds_no_lease_never_stops_on_its_clock(s3: Any, clock: Clock) -> None:
    holding(s3, clock)
    b, b_log = standing_by(s3, clock)
    stops = StopRequests(b_log.log, deadline_seconds=100)
    b.watch_own_clock(stops, Ticks(clock, count=400, step=0.25))
    assert stops.reason is None and stops.kill_at is None


def test_a_renewed_lease_keeps_the_trainer_running(s3: Any, clock: Clock) -> None:
    a, a_log = holding(s3, clock)
    stops = StopRequests(a_log.log, deadline_seconds=100)

    def renew() -> None:
        a.lease.renew(clock.wall, proof_at=clock.mono)

    a.watch_own_clock(stops, Ticks(clock, count=200, step=0.25, _100=renew))
    assert stops.reason is None and stops.kill_at is None


# -- the standby's warm wait (`wait_warm`) -------------------------------------------------------------


class FakeTrainer:
    """The gated trainer as wait_warm sees it: says `standby: warm` after `warm_after` polls, exits with
    `exit_code` after `exit_after` polls, exits 75 when asked to stop unless `stubborn`."""

    argv: ClassVar[list[str]] = ["python", "-m", "training"]

    def __init__(
        self,
        warm_after: int | None = 3,
        exit_after: int | None = None,
        exit_code: int = 1,
        stubborn: bool = False,
        on_poll: Callable[[], Any] | None = None,
    ) -> None:
        self.tail: deque[str] = deque(maxlen=40)
        self.started: list[bool] = []
        self.polls = 0
        self.code: int | None = None
        self.warm_after = warm_after
        self.exit_after = exit_after
        self.exit_code = exit_code
        self.stubborn = stubborn
        self.on_poll = on_poll
        self.stop_requests = 0
        self.waits: list[float] = []
        self.killed = False

    def start(self, gated: bool = False) -> None:
        self.started.append(gated)

    def poll(self) -> int | None:
        assert self.started, "poll() of a trainer never started"
        self.polls += 1
        assert self.polls <= 20_000, "the standby still polled its gated trainer after 20,000 polls"
        if self.on_poll is not None:
            self.on_poll()
        if self.warm_after is not None and self.polls == self.warm_after:
            self.tail.append("standby: warm; waiting at the start gate")
        if self.exit_after is not None and self.polls >= self.exit_after and self.code is None:
            self.code = self.exit_code
        return self.code

    def request_stop(self) -> None:
        self.stop_requests += 1
        if not self.stubborn:
            self.code = 75

    def wait(self, timeout: float | None = None) -> int | None:
        self.waits.append(timeout or 0.0)
        return self.code

    def kill(self) -> None:
        self.killed = True
        self.code = -9


class FakeStops(StopRequests):
    """The life's stop requests, whose waits move the fake clock; `at` runs at the given wait numbers."""

    def __init__(self, log: EventLog, clock: Clock, **at: Callable[[], Any]) -> None:
        super().__init__(log, deadline_seconds=100)
        self.clock = clock
        self.waits = 0
        self.at = {int(key.lstrip("_")): action for key, action in at.items()}

    def wait(self, timeout: float) -> bool:
        self.waits += 1
        assert self.waits <= 1000, "the standby still waited after 1000 polls"
        if self.waits in self.at:
            self.at[self.waits]()
        if self.is_set():
            return True
        self.clock.advance(timeout)
        return self.is_set()


def warm(
    one: OneWriter,
    trainer: FakeTrainer,
    stops: StopRequests,
    log: Log,
    *,
    gated: bool = True,
    job_ended: Callable[[], bool] = lambda: False,
) -> LifeEnd | Failure | None:
    return wait_warm(
        one, cast(TrainerProcess, trainer), stops, log.log, gated=gated, job_ended=job_ended, floor=0
    )


def test_a_gated_standby_is_ready_once_warm_and_takes_over_at_the_release(s3: Any, clock: Clock) -> None:
    a, _ = holding(s3, clock)
    b, b_log = standing_by(s3, clock)
    ready_seen: list[bool] = []
    trainer = FakeTrainer(
        warm_after=4, on_poll=lambda: ready_seen.append(a.standby.ready(clock.wall) is not None)
    )
    stops = FakeStops(b_log.log, clock, _2=lambda: a.release(12))
    assert warm(b, trainer, stops, b_log) is None
    assert b.holding and trainer.started == [True], "the built-in trainer started gated"
    assert ready_seen[:4] == [False] * 4, "never ready before the trainer is warm"
    assert ready_seen[4:] and all(ready_seen[4:]), "ready once it is"
    standby_ready = b_log.one("standby ready")
    assert standby_ready["stage"] == "standby" and standby_ready["warm_s"] == 0.4, "ready at the warm line"
    starting = b_log.one("trainer starting gated (standby)")
    assert (starting["stage"], starting["argv"]) == ("train", FakeTrainer.argv)
    assert trainer.stop_requests == 0 and not trainer.killed, "the new holder's trainer goes on"
    assert b_log.one("lease taken over")["stop_step"] == 12


def test_a_stop_before_the_gated_start_starts_nothing_and_takes_the_record_away(
    s3: Any, clock: Clock
) -> None:
    holding(s3, clock)
    b, b_log = standing_by(s3, clock)
    stops = FakeStops(b_log.log, clock)
    stops.request("spot_interruption")
    trainer = FakeTrainer()
    assert warm(b, trainer, stops, b_log) is LifeEnd.STANDBY_ENDED
    assert trainer.started == []
    assert stored(s3, STANDBY_KEY) is None
    assert b_log.named("standby ready") == []


def test_a_gated_trainer_that_exits_while_waiting_is_a_failure_with_its_last_lines(
    s3: Any, clock: Clock
) -> None:
    holding(s3, clock)
    b, b_log = standing_by(s3, clock)
    trainer = FakeTrainer(warm_after=2, exit_after=5, exit_code=3)
    trainer.tail.extend(f"line {n}" for n in range(30))
    ended = warm(b, trainer, FakeStops(b_log.log, clock), b_log)
    assert isinstance(ended, Failure)
    assert ended.outcome is LifeEnd.FAILED
    assert ended.reason == "trainer exited 3 while waiting as the standby"
    assert ended.lines == list(trainer.tail)[-25:] and len(ended.lines) == 25
    assert stored(s3, STANDBY_KEY) is None and not b.holding
    assert trainer.stop_requests == 0 and not trainer.killed


def test_a_stop_while_waiting_warm_ends_the_standby_and_its_gated_trainer(s3: Any, clock: Clock) -> None:
    holding(s3, clock)
    b, b_log = standing_by(s3, clock)
    trainer = FakeTrainer()
    stops = FakeStops(b_log.log, clock, _3=lambda: stops.request("spot_interruption"))
    assert warm(b, trainer, stops, b_log) is LifeEnd.STANDBY_ENDED
    assert trainer.stop_requests == 1 and trainer.code == 75 and not trainer.killed
    assert stored(s3, STANDBY_KEY) is None


def test_a_standby_whose_job_ended_stops_its_gated_trainer_and_kills_one_that_will_not(
    s3: Any, clock: Clock
) -> None:
    holding(s3, clock)
    b, b_log = standing_by(s3, clock)
    polite = FakeTrainer()
    assert (
        warm(b, polite, FakeStops(b_log.log, clock), b_log, job_ended=lambda: True) is LifeEnd.STANDBY_ENDED
    )
    assert polite.stop_requests == 1 and polite.waits == [30] and not polite.killed
    assert stored(s3, STANDBY_KEY) is None

    c, c_log = standing_by(s3, clock, instance="i-c")
    stubborn = FakeTrainer(stubborn=True)
    ended = warm(c, stubborn, FakeStops(c_log.log, clock), c_log, job_ended=lambda: True)
    assert ended is LifeEnd.STANDBY_ENDED, "a gated trainer killed at the end is no failure"
    assert stubborn.stop_requests == 1 and stubborn.waits == [30] and stubborn.killed
    assert stored(s3, STANDBY_KEY) is None


def test_a_trainer_that_never_warms_up_makes_the_standby_ready_after_ten_minutes(
    s3: Any, clock: Clock
) -> None:
    a, _ = holding(s3, clock)
    b, b_log = standing_by(s3, clock)
    trainer = FakeTrainer(warm_after=None)
    stops = FakeStops(b_log.log, clock, _1=lambda: a.release(4))
    assert warm(b, trainer, stops, b_log) is None
    warm_s = b_log.one("standby ready")["warm_s"]
    assert 600.0 <= warm_s <= 600.2, "ready at the warm-up limit, not before, not much later"


def test_a_gated_trainer_that_dies_while_warming_up_is_a_failure_at_once(s3: Any, clock: Clock) -> None:
    holding(s3, clock)
    b, b_log = standing_by(s3, clock)
    trainer = FakeTrainer(warm_after=None, exit_after=3, exit_code=1)
    ended = warm(b, trainer, FakeStops(b_log.log, clock), b_log)
    assert isinstance(ended, Failure) and ended.reason == "trainer exited 1 while waiting as the standby"
    assert clock.mono - MONO0 < 5, "not after the ten-minute warm-up limit"


def test_a_stop_during_the_warm_up_ends_the_standby_at_once(s3: Any, clock: Clock) -> None:
    holding(s3, clock)
    b, b_log = standing_by(s3, clock)
    stops = FakeStops(b_log.log, clock)
    trainer = FakeTrainer(
        warm_after=None, on_poll=lambda: stops.request("cancel") if trainer.polls == 3 else None
    )
    assert warm(b, trainer, stops, b_log) is LifeEnd.STANDBY_ENDED
    assert b_log.one("standby ready")["warm_s"] <= 0.3
    assert trainer.polls <= 5


def test_a_user_jobs_standby_starts_nothing_until_it_holds_the_lease(s3: Any, clock: Clock) -> None:
    a, _ = holding(s3, clock)
    b, b_log = standing_by(s3, clock)
    trainer = FakeTrainer()
    stops = FakeStops(b_log.log, clock, _2=lambda: a.release(6))
    assert warm(b, trainer, stops, b_log, gated=False) is None
    assert trainer.started == [] and b.holding
    assert b_log.one("standby ready")["warm_s"] == 0.0
    assert b_log.named("trainer starting gated (standby)") == []
    # A user job's standby that is stopped ends without a failure and starts nothing either.
    c, c_log = standing_by(s3, clock, instance="i-c")
    stopped = FakeStops(c_log.log, clock, _2=lambda: stopped.request("cancel"))
    assert warm(c, FakeTrainer(), stopped, c_log, gated=False) is LifeEnd.STANDBY_ENDED
    assert stored(s3, STANDBY_KEY) is None
