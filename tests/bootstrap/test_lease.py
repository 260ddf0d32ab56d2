"""The job's lease and warm-standby record (bootstrap/lease.py) against the moto server: who may write the
job's checkpoints, when a lease may be taken, that of several lives racing exactly one wins, and that a
holder that lost its lease finds out. Times are injected (epoch seconds): no test sleeps."""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError

from bootstrap.agent_config import AgentConfig, Prefixes
from bootstrap.eventlog import EventLog
from bootstrap.lease import (
    ATTEMPTS,
    JobLease,
    LeaseExpiredError,
    LeaseLostError,
    StandbyRecord,
)
from bootstrap.lease import DRIFT_SECONDS as DRIFT
from bootstrap.standby import OneWriter, Role
from tests.conftest import MotoServer
from trainstack_job.records import LeaseState, StandbyState, is_conflict

BUCKET = "trainstack-lease"
LEASE_KEY = "jobs/demo-1a2b3c4d/state/lease.json"
STANDBY_KEY = "jobs/demo-1a2b3c4d/state/standby.json"
URI = f"s3://{BUCKET}/{LEASE_KEY}"
STALE = 60.0
T0 = 1_800_000_000.0


class RacingS3:
    """The S3 client that racing lives share, with two test hooks on one key.

    moto checks If-Match / If-None-Match and then stores the object in two steps, without a lock, on one of
    its request threads; S3 does both atomically. The lock around writes of the key gives moto S3's
    atomicity: which write gets in, and the 412 the others get, are still moto's conditional-write answers.
    `race` makes each of that many threads read the key once before any of them writes it.
    """

    def __init__(self, client: Any, key: str, race: int = 0) -> None:
        self._client = client
        self._key = key
        self._lock = threading.Lock()
        self._race = threading.Barrier(race, timeout=30) if race else None
        self._raced = threading.local()
        self.conflicts = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def race_done(self) -> None:
        """Reads after the race (the test's own checks) wait for nobody."""
        self._race = None

    def get_object(self, **kwargs: Any) -> Any:
        try:
            return self._client.get_object(**kwargs)
        finally:
            if self._race is not None and kwargs["Key"] == self._key and not getattr(self._raced, "v", 0):
                self._raced.v = 1
                self._race.wait(timeout=10)

    def _locked(self, call: Any, **kwargs: Any) -> Any:
        if kwargs["Key"] != self._key:
            return call(**kwargs)
        with self._lock:
            try:
                return call(**kwargs)
            except ClientError as exc:
                if is_conflict(exc):
                    self.conflicts += 1
                raise

    def put_object(self, **kwargs: Any) -> Any:
        return self._locked(self._client.put_object, **kwargs)

    def delete_object(self, **kwargs: Any) -> Any:
        return self._locked(self._client.delete_object, **kwargs)


@pytest.fixture()
def s3(aws: MotoServer) -> Any:
    client = boto3.client("s3", region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    return client


def lease(s3: Any, holder: str, life: str = "", **kwargs: Any) -> JobLease:
    return JobLease(
        s3, BUCKET, LEASE_KEY, holder=holder, life_id=life or f"{holder}@life", stale_seconds=STALE, **kwargs
    )


def standby(s3: Any, instance_id: str, life: str = "") -> StandbyRecord:
    return StandbyRecord(
        s3,
        BUCKET,
        STANDBY_KEY,
        instance_id=instance_id,
        life_id=life or f"{instance_id}@life",
        stale_seconds=STALE,
    )


def stored(s3: Any, key: str = LEASE_KEY) -> dict[str, Any]:
    return dict(json.loads(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()))


def etag(s3: Any, key: str = LEASE_KEY) -> str:
    return str(s3.head_object(Bucket=BUCKET, Key=key)["ETag"])


def absent(s3: Any, key: str) -> bool:
    try:
        s3.head_object(Bucket=BUCKET, Key=key)
    except ClientError:
        return True
    return False


# -- the lease ---------------------------------------------------------------------------------------


def test_the_first_life_acquires_token_1_and_a_second_waits_while_the_holder_beats(s3: Any) -> None:
    a, b = lease(s3, "i-a", job_id="demo-1a2b3c4d"), lease(s3, "i-b")
    assert a.try_acquire(T0) == 1 and a.token == 1 and a.replaced is None
    assert stored(s3) == {
        "holder": "i-a",
        "life_id": "i-a@life",
        "token": 1,
        "acquired_at": T0,
        "heartbeat_at": T0,
        "released_at": None,
        "stop_step": None,
        "job_id": "demo-1a2b3c4d",
        "expires_at": T0 + STALE,
    }
    assert b.try_acquire(T0 + 1) is None
    a.renew(T0 + 50)
    # The expiry moved with the renewal; another life waits past it by the clock-drift margin too.
    assert stored(s3)["expires_at"] == T0 + 50 + STALE
    assert b.try_acquire(T0 + 50 + STALE + DRIFT - 1) is None, "expired, but within the drift margin"
    assert stored(s3)["token"] == 1 and stored(s3)["heartbeat_at"] == T0 + 50
    state = b.read()
    assert state is not None and state.live(T0 + 109, STALE) and not state.live(T0 + 110, STALE)
    assert state.live(T0 + 119, STALE, DRIFT) and not state.live(T0 + 120, STALE, DRIFT)
    assert b.try_acquire(T0 + 50 + STALE + DRIFT) == 2


def test_an_expired_lease_is_taken_with_the_next_token_and_the_old_holder_learns_it_lost(s3: Any) -> None:
    a, b = lease(s3, "i-a"), lease(s3, "i-b")
    assert a.try_acquire(T0) == 1
    assert b.try_acquire(T0 + STALE + DRIFT) == 2, "a holder silent past its expiry and the margin is dead"
    assert b.replaced is not None and b.replaced.holder == "i-a"
    with pytest.raises(LeaseLostError) as lost:
        a.renew(T0 + STALE + 1)
    assert (lost.value.holder, lost.value.token) == ("i-b", 2)
    assert str(lost.value) == (
        f"{URI}: lease lost to i-b (token 2): this instance no longer writes the job's checkpoints"
    )
    with pytest.raises(LeaseLostError):
        a.check()
    assert b.check().token == 2
    assert stored(s3)["holder"] == "i-b", "the failed renewal wrote nothing"


def test_renew_keeps_the_token_and_only_moves_the_heartbeat(s3: Any) -> None:
    a = lease(s3, "i-a")
    a.try_acquire(T0)
    renewed = a.renew(T0 + 10)
    assert (renewed.token, renewed.acquired_at, renewed.heartbeat_at) == (1, T0, T0 + 10)
    assert stored(s3)["heartbeat_at"] == T0 + 10
    assert a.try_acquire(T0 + 11) == 1, "asking again while holding is the same token, nothing written"
    assert stored(s3)["heartbeat_at"] == T0 + 10


def test_release_hands_over_at_once_with_the_stop_step_and_is_idempotent(s3: Any) -> None:
    a, b = lease(s3, "i-a"), lease(s3, "i-b")
    a.try_acquire(T0)
    assert a.release(T0 + 5, stop_step=120) is True
    after = etag(s3)
    assert stored(s3)["released_at"] == T0 + 5 and stored(s3)["stop_step"] == 120
    assert a.release(T0 + 6, stop_step=121) is True and etag(s3) == after, "a second release writes nothing"
    with pytest.raises(LeaseLostError, match=r"lease lost to i-a \(released\) \(token 1\)"):
        a.check()  # released: the persister may not write any more
    assert b.try_acquire(T0 + 6) == 2, "a released lease is taken at once, no expiry to wait for"
    assert b.replaced is not None and b.replaced.stop_step == 120
    taken = etag(s3)
    assert a.release(T0 + 7, stop_step=122) is False and etag(s3) == taken, "not ours: nothing written"
    with pytest.raises(LeaseLostError):
        a.renew(T0 + 7)


def test_release_after_losing_the_lease_returns_false_without_raising(s3: Any) -> None:
    a, b = lease(s3, "i-a"), lease(s3, "i-b")
    a.try_acquire(T0)
    assert b.try_acquire(T0 + STALE + DRIFT) == 2
    assert a.release(T0 + STALE + 1, stop_step=5) is False
    assert stored(s3)["released_at"] is None and stored(s3)["holder"] == "i-b"


def test_an_earlier_agent_on_the_same_instance_is_dead_and_its_lease_is_taken_at_once(s3: Any) -> None:
    lease(s3, "i-a", "i-a@first").try_acquire(T0)
    restarted = lease(s3, "i-a", "i-a@second")  # systemd restarted the agent: one agent per instance
    assert restarted.try_acquire(T0 + 1) == 2


def test_a_lease_deleted_or_damaged_by_hand_never_hands_out_a_used_token(s3: Any) -> None:
    s3.put_object(Bucket=BUCKET, Key=LEASE_KEY, Body=b"{not json")
    a = lease(s3, "i-a")
    assert a.read() is None
    assert a.try_acquire(T0, floor=7) == 8, "latest.json carried token 7: the next token is above it"
    assert stored(s3)["token"] == 8


def test_check_propagates_a_read_error_instead_of_calling_the_lease_lost(s3: Any) -> None:
    a = JobLease(s3, "no-such-bucket", LEASE_KEY, holder="i-a", life_id="i-a@life")
    with pytest.raises(ClientError) as error:
        a.check()
    assert not isinstance(error.value, LeaseLostError)
    assert error.value.response["Error"]["Code"] == "NoSuchBucket"


def test_lease_state_refuses_what_is_not_a_lease() -> None:
    good = {"holder": "i-a", "life_id": "x", "token": 1, "acquired_at": T0, "heartbeat_at": T0}
    assert LeaseState.from_record(good) == LeaseState("i-a", "x", 1, T0, T0)
    for broken in ({**good, "token": True}, {**good, "token": "1"}, {**good, "holder": None}, [good], None):
        assert LeaseState.from_record(broken) is None


@pytest.mark.parametrize("stale_holder", [False, True], ids=["absent", "expired"])
def test_of_four_lives_acquiring_at_once_exactly_one_wins(s3: Any, stale_holder: bool) -> None:
    now = T0
    if stale_holder:
        lease(s3, "i-old").try_acquire(T0 - 10 * STALE)
        s3.put_object(  # an expired lease with an old token: the winner writes the one after it
            Bucket=BUCKET, Key=LEASE_KEY, Body=json.dumps({**stored(s3), "token": 5}).encode()
        )
    racing = RacingS3(s3, LEASE_KEY, race=4)
    lives = [lease(racing, f"i-{n}") for n in range(4)]
    start = threading.Barrier(4, timeout=30)

    def acquire(life: JobLease) -> int | None:
        start.wait(timeout=10)
        return life.try_acquire(now)

    with ThreadPoolExecutor(4) as pool:
        tokens = list(pool.map(acquire, lives))
    racing.race_done()
    expected = 6 if stale_holder else 1
    winners = [n for n, token in enumerate(tokens) if token is not None]
    assert len(winners) == 1 and tokens[winners[0]] == expected, tokens
    assert racing.conflicts == 3, "every loser's write was refused by S3, not skipped by a stale read"
    assert stored(s3)["holder"] == f"i-{winners[0]}" and stored(s3)["token"] == expected
    assert lives[winners[0]].check().token == expected
    for n, life in enumerate(lives):
        if n != winners[0]:
            assert life.held_token is None
            with pytest.raises(LeaseLostError):
                life.check()


# -- the standby record ------------------------------------------------------------------------------


def test_one_standby_at_a_time_and_a_stale_one_is_replaced(s3: Any) -> None:
    b, c = standby(s3, "i-b"), standby(s3, "i-c")
    assert b.read() is None and b.ready(T0) is None
    assert b.claim(T0) is True
    assert stored(s3, STANDBY_KEY) == {
        "instance_id": "i-b",
        "life_id": "i-b@life",
        "since": T0,
        "ready_at": None,
        "heartbeat_at": T0,
    }
    assert c.claim(T0 + 1) is False, "a live standby is already waiting: the third instance is surplus"
    other = c.live_other(T0 + 1, "i-c")
    assert other is not None and other.instance_id == "i-b"
    assert b.live_other(T0 + 1) is None, "its own record is not another standby"
    assert b.ready(T0 + 1) is None, "claimed but not prepared yet"
    assert b.heartbeat(T0 + 30) is True
    assert c.claim(T0 + 30 + STALE - 1) is False
    assert c.claim(T0 + 30 + STALE) is True, "silent for the stale limit: replaced"
    assert c.live_other(T0 + 30 + STALE) is None
    assert b.heartbeat(T0 + 100) is False and b.mark_ready(T0 + 100) is False, "b was replaced"
    assert b.clear() is False and stored(s3, STANDBY_KEY)["instance_id"] == "i-c"


def test_a_ready_standby_is_what_the_holder_hands_over_to_and_clear_removes_only_ones_own(s3: Any) -> None:
    b = standby(s3, "i-b")
    holder_view = standby(s3, "i-a")
    b.claim(T0)
    assert b.mark_ready(T0 + 20) is True
    ready = holder_view.ready(T0 + 25)
    assert ready is not None and (ready.instance_id, ready.since, ready.ready_at) == ("i-b", T0, T0 + 20)
    assert holder_view.ready(T0 + 20 + STALE) is None, "a ready standby that stopped beating is not ready"
    assert b.claim(T0 + 30) is True, "claiming again keeps since and ready_at"
    assert stored(s3, STANDBY_KEY)["since"] == T0 and stored(s3, STANDBY_KEY)["ready_at"] == T0 + 20
    assert holder_view.clear() is False and not absent(s3, STANDBY_KEY)
    assert b.clear() is True and absent(s3, STANDBY_KEY)
    assert b.clear() is False


def test_a_restarted_agent_on_the_same_instance_reclaims_its_standby_record(s3: Any) -> None:
    standby(s3, "i-b", "i-b@first").claim(T0)
    standby(s3, "i-b", "i-b@first").mark_ready(T0 + 1)
    again = standby(s3, "i-b", "i-b@second")
    assert again.claim(T0 + 2) is True
    assert stored(s3, STANDBY_KEY) == {
        "instance_id": "i-b",
        "life_id": "i-b@second",
        "since": T0 + 2,
        "ready_at": None,
        "heartbeat_at": T0 + 2,
    }, "a new life starts its wait afresh: not ready until it prepared the job again"


def test_clear_does_not_delete_a_record_rewritten_after_it_was_read(s3: Any) -> None:
    b = standby(s3, "i-b")
    b.claim(T0)

    class Interleaved(RacingS3):
        """Another instance's claim lands between b's read and b's delete."""

        def delete_object(self, **kwargs: Any) -> Any:
            body = {**stored(s3, STANDBY_KEY), "instance_id": "i-c", "life_id": "i-c@life"}
            s3.put_object(Bucket=BUCKET, Key=STANDBY_KEY, Body=json.dumps(body).encode())
            return super().delete_object(**kwargs)

    interleaved = Interleaved(s3, STANDBY_KEY)
    late = StandbyRecord(interleaved, BUCKET, STANDBY_KEY, instance_id="i-b", life_id="i-b@life")
    assert late.clear() is False
    assert interleaved.conflicts == 1, "the delete was conditional on the ETag read"
    assert stored(s3, STANDBY_KEY)["instance_id"] == "i-c"


def test_of_three_standbys_claiming_at_once_exactly_one_waits(s3: Any) -> None:
    racing = RacingS3(s3, STANDBY_KEY, race=3)
    records = [standby(racing, f"i-{n}") for n in range(3)]
    start = threading.Barrier(3, timeout=30)

    def claim(record: StandbyRecord) -> bool:
        start.wait(timeout=10)
        return record.claim(T0)

    with ThreadPoolExecutor(3) as pool:
        claimed = list(pool.map(claim, records))
    assert claimed.count(True) == 1, claimed
    assert racing.conflicts == 2
    assert stored(s3, STANDBY_KEY)["instance_id"] == f"i-{claimed.index(True)}"


def test_a_holder_whose_instance_left_the_group_is_taken_over_before_the_stale_limit(s3: Any) -> None:
    """A live-looking lease whose instance the group no longer has (killed without a word): the standby
    need not wait the stale limit; a holder still in the group (draining its notice) is waited for."""
    config = AgentConfig(
        region="us-east-1", bucket=BUCKET, group_name="g", topic_arn="arn:aws:sns:us-east-1:1:t",
        log_group="/l", prefixes=Prefixes(state=LEASE_KEY.rsplit("/", 1)[0] + "/"),
    )  # fmt: skip
    holder = JobLease(s3, BUCKET, LEASE_KEY, holder="i-dead", life_id="i-dead@1")
    assert holder.try_acquire(T0) == 1
    in_group = {"i-dead": True}
    writer = OneWriter(
        s3, config, EventLog(stream=io.StringIO()), instance_id="i-new", life_id="i-new@2",
        stale_seconds=STALE, instance_gone=lambda instance: not in_group[instance],
    )  # fmt: skip
    assert writer.take(floor=0) is not Role.HOLDER, "a holder still in the group is waited for"
    in_group["i-dead"] = False
    assert writer._acquire(T0 + 2, floor=0) == 2
    assert writer.dead_holder() == "i-dead@1", "its life is closed as interrupted at its heartbeat"


# -- the holder's own clock (docs/internals.md, "A partition: the holder stops on its own clock") ---------


class Unreachable:
    """The S3 client of an instance whose link is cut: every call fails as botocore does then."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.cut = False

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._client, name)

        def call(**kwargs: Any) -> Any:
            if self.cut:
                from botocore.exceptions import EndpointConnectionError

                raise EndpointConnectionError(endpoint_url="https://s3.example.invalid")
            return method(**kwargs)

        return call


def test_every_proof_sets_the_holders_own_deadline_from_its_monotonic_clock(s3: Any) -> None:
    a = lease(s3, "i-a")
    assert a.own_deadline() is None and a.expired(), "never proved: never held by its own clock"
    assert a.try_acquire(T0, proof_at=100.0) == 1
    assert a.own_deadline() == 100.0 + STALE
    assert not a.expired(100.0 + STALE - 0.001) and a.expired(100.0 + STALE)
    assert a.unproven_seconds(130.0) == 30.0
    a.renew(T0 + 20, proof_at=120.0)
    assert a.own_deadline() == 120.0 + STALE
    a.renew(T0 + 21, proof_at=110.0)  # a slow renewal's answer: the proof never moves back
    assert a.own_deadline() == 120.0 + STALE
    assert stored(s3)["expires_at"] == T0 + 21 + STALE


def test_check_renews_once_half_the_lease_is_unproven_and_past_the_deadline_an_outage_is_an_expiry(
    s3: Any,
) -> None:
    link = Unreachable(s3)
    a = lease(link, "i-a")
    a.try_acquire(time.time() - STALE / 2)  # check() renews with the wall clock: the lease is that old
    written = etag(s3)
    a.check()
    assert etag(s3) == written, "fresh proof: the fence is one GET, nothing written"
    assert a.proven_at is not None
    a.proven_at -= STALE / 2  # the state poller has not renewed for half the lease
    a.check()
    assert etag(s3) != written, "half the lease unproven: the fence renews"
    link.cut = True
    a.proven_at -= STALE / 2  # within the deadline: an outage is an outage, the caller retries
    from botocore.exceptions import EndpointConnectionError

    with pytest.raises(EndpointConnectionError):
        a.check()
    a.proven_at -= STALE / 2  # past the deadline: the holder must assume the lease is gone
    with pytest.raises(LeaseExpiredError, match=r"lease not renewed for 6\d\.\d s, past its expiry"):
        a.check()


def test_a_holder_past_its_own_deadline_and_a_taker_past_the_margin_race_and_exactly_one_wins(
    s3: Any,
) -> None:
    """The partition healed just as the taker's wait ended: the holder's renewal and the taker's acquisition
    are both conditional writes on the lease, so one gets in and the other learns it at once."""
    a = lease(s3, "i-a")
    a.try_acquire(T0)
    racing = RacingS3(s3, LEASE_KEY, race=2)
    a._s3 = racing  # from here on both lives read before either writes
    b = lease(racing, "i-b")
    outcomes: dict[str, Any] = {}

    def renew() -> None:
        try:
            outcomes["a"] = a.renew(T0 + STALE + DRIFT).token
        except LeaseLostError as exc:
            outcomes["a"] = exc

    def take() -> None:
        outcomes["b"] = b.try_acquire(T0 + STALE + DRIFT)

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda f: f(), [renew, take]))
    racing.race_done()
    holder = stored(s3)["holder"]
    if holder == "i-a":
        assert outcomes == {"a": 1, "b": None}
    else:
        assert outcomes["b"] == 2 and isinstance(outcomes["a"], LeaseLostError)
    assert racing.conflicts == 1


def test_the_records_own_expiry_governs_and_a_record_without_one_expires_from_its_heartbeat(s3: Any) -> None:
    """A holder configured with a longer lease writes a later `expires_at`: a taker with a shorter stale
    limit still waits for it. A record from before leases carried their expiry ends `stale_seconds` after
    its heartbeat, and is renewed and taken like any other."""
    long = JobLease(s3, BUCKET, LEASE_KEY, holder="i-a", life_id="i-a@life", stale_seconds=120.0)
    long.try_acquire(T0)
    b = lease(s3, "i-b")
    assert b.try_acquire(T0 + STALE + DRIFT) is None, "taken at the taker's limit, before the record's expiry"
    assert b.try_acquire(T0 + 120 + DRIFT) == 2
    older = {k: v for k, v in stored(s3).items() if k != "expires_at"} | {"heartbeat_at": T0 + 200}
    s3.put_object(Bucket=BUCKET, Key=LEASE_KEY, Body=json.dumps(older).encode())
    state = b.read()
    assert state is not None and state.expires_at is None and state.expiry(STALE) == T0 + 200 + STALE
    assert state.live(T0 + 200 + STALE + DRIFT - 1, STALE, DRIFT)
    assert b.renew(T0 + 210).expires_at == T0 + 210 + STALE, "a renewal writes the expiry it lacked"
    s3.put_object(Bucket=BUCKET, Key=LEASE_KEY, Body=json.dumps(older).encode())
    c = lease(s3, "i-c")
    assert c.try_acquire(T0 + 200 + STALE + DRIFT - 1) is None
    assert c.try_acquire(T0 + 200 + STALE + DRIFT) == 3


def test_a_record_whose_expiry_is_not_a_number_is_no_lease(s3: Any) -> None:
    a = lease(s3, "i-a")
    a.try_acquire(T0)
    record = stored(s3)
    for bad in ("soon", True, [T0]):
        assert LeaseState.from_record(record | {"expires_at": bad}) is None, bad
    assert LeaseState.from_record(record | {"expires_at": int(T0) + 60}) is not None
    parsed = LeaseState.from_record(record | {"expires_at": int(T0) + 60})
    assert parsed is not None and isinstance(parsed.expires_at, float) and parsed.expires_at == T0 + 60


def test_an_acquisition_whose_answer_was_lost_holds_no_proof_until_it_renews(s3: Any) -> None:
    """The put got in but its answer was lost: asking again returns the token, but proves nothing new
    (the stored expiry may be older than this call); the next renewal proves it."""
    lease(s3, "i-a").try_acquire(T0)
    again = lease(s3, "i-a")
    assert again.unproven_seconds() == float("inf") and again.own_deadline() is None
    assert again.try_acquire(T0 + 1) == 1 and again.own_deadline() is None and again.expired()
    again.renew(T0 + 2, proof_at=500.0)
    assert again.own_deadline() == 500.0 + STALE


def test_below_half_the_lease_unproven_the_fence_only_reads(s3: Any) -> None:
    a = lease(s3, "i-a")
    a.try_acquire(time.time() - STALE / 2)
    written = etag(s3)
    assert a.proven_at is not None
    a.proven_at -= STALE * 0.4
    a.check()
    assert etag(s3) == written, "renewed before half the lease went unproven"


def test_an_expiry_names_the_holder_its_token_the_lease_and_how_long_it_went_unproven(s3: Any) -> None:
    error = LeaseExpiredError("i-a", 3, URI, 61.25)
    assert isinstance(error, LeaseLostError)
    assert (error.holder, error.token, error.uri, error.unproven_seconds) == ("i-a", 3, URI, 61.25)
    assert str(error) == (
        f"{URI}: lease not renewed for 61.2 s, past its expiry on this instance's clock: "
        "this instance stops writing the job's checkpoints"
    )
    bare = LeaseExpiredError("i-a", 3)
    assert bare.uri == "" and bare.unproven_seconds == 0.0
    assert str(bare).startswith("lease not renewed for 0.0 s,")
    link = Unreachable(s3)
    a = lease(link, "i-a")
    a.try_acquire(T0)
    link.cut = True
    assert a.proven_at is not None
    a.proven_at -= STALE
    with pytest.raises(LeaseExpiredError) as expired:
        a.check()
    assert (expired.value.holder, expired.value.token, expired.value.uri) == ("i-a", 1, URI)


# == each record's fields, the exact fence, S3's every answer ================================================
# With S3's other answers injected: a fence passes only for the exact token, life and instance that acquired
# it; a record that is not a lease or a standby counts as absent, never crashes its reader; S3's "not found"
# in its every spelling means absent, any other error is raised; a write S3 keeps refusing gives up with the
# record's URI; what a lost lease says names who took it.


STANDBY_URI = f"s3://{BUCKET}/{STANDBY_KEY}"
# Every spelling of "no such object" S3 and the proxies in front of it answer with (a GET's NoSuchKey, a
# HEAD-style bare 404, and the "NotFound" some SDK paths report).
NOT_FOUND = ("NoSuchKey", "404", "NotFound")
# Other answers, with their HTTP status (None: an answer without an error body, as a bare 500 arrives).
STATUS = {None: 500, "InternalError": 500, "AccessDenied": 403}


def s3_error(operation: str, code: str | None, status: int | None = None) -> ClientError:
    """What botocore raises for an S3 answer; `code` None: an answer without an error body."""
    response: dict[str, Any] = {}
    if code is not None:
        response["Error"] = {"Code": code, "Message": f"injected {code}"}
    if status is not None:
        response["ResponseMetadata"] = {"HTTPStatusCode": status}
    return ClientError(response, operation)  # type: ignore[arg-type]


class Answers:
    """The moto client with injected answers: `fail[name]` gives the error the next call of that S3 method
    raises (None: the call goes through to moto); `after_get` runs after each read (another writer)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.fail: dict[str, Callable[[], ClientError | None]] = {}
        self.after_get: Callable[[], None] | None = None
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def _call(self, name: str, **kwargs: Any) -> Any:
        self.calls[name] = self.calls.get(name, 0) + 1
        error = self.fail[name]() if name in self.fail else None
        if error is not None:
            raise error
        return getattr(self._client, name)(**kwargs)

    def get_object(self, **kwargs: Any) -> Any:
        response = self._call("get_object", **kwargs)
        if self.after_get is not None:
            self.after_get()
        return response

    def put_object(self, **kwargs: Any) -> Any:
        return self._call("put_object", **kwargs)

    def delete_object(self, **kwargs: Any) -> Any:
        return self._call("delete_object", **kwargs)


def rewrite(s3: Any, key: str = LEASE_KEY, **changes: Any) -> None:
    """Another writer (or a hand edit) changes the stored record."""
    s3.put_object(Bucket=BUCKET, Key=key, Body=json.dumps({**stored(s3, key), **changes}).encode())


GOOD_LEASE = {
    "holder": "i-a", "life_id": "i-a@life", "token": 3, "acquired_at": T0, "heartbeat_at": T0 + 5,
    "released_at": T0 + 9, "stop_step": 120, "job_id": "demo-1a2b3c4d",
}  # fmt: skip
GOOD_STANDBY = {
    "instance_id": "i-b", "life_id": "i-b@life", "since": T0, "ready_at": T0 + 1, "heartbeat_at": T0,
}  # fmt: skip


# -- what a stored record is -------------------------------------------------------------------------


def test_a_lease_record_reads_back_as_written_with_every_field() -> None:
    state = LeaseState.from_record(GOOD_LEASE)
    assert state == LeaseState("i-a", "i-a@life", 3, T0, T0 + 5, T0 + 9, 120, "demo-1a2b3c4d")
    assert state is not None and LeaseState.from_record(state.to_record()) == state
    standby_state = StandbyState.from_record(GOOD_STANDBY)
    assert standby_state == StandbyState("i-b", "i-b@life", T0, T0 + 1, T0)
    assert standby_state is not None and StandbyState.from_record(standby_state.to_record()) == standby_state


@pytest.mark.parametrize(
    "field, value",
    [
        ("acquired_at", "yesterday"),
        ("heartbeat_at", [T0]),
        ("released_at", "soon"),
        ("released_at", True),
        ("stop_step", "120"),
        ("stop_step", 120.5),
        ("job_id", 7),
    ],
)
def test_a_lease_field_of_the_wrong_type_makes_the_record_no_lease(field: str, value: Any) -> None:
    """A hand-edited or truncated lease counts as absent (replaced by the next conditional write); it must
    never crash the reader nor come back with a field of the wrong type."""
    assert LeaseState.from_record({**GOOD_LEASE, field: value}) is None


@pytest.mark.parametrize(
    "broken",
    [
        {k: v for k, v in GOOD_STANDBY.items() if k != "instance_id"},
        {k: v for k, v in GOOD_STANDBY.items() if k != "life_id"},
        {k: v for k, v in GOOD_STANDBY.items() if k != "since"},
        {k: v for k, v in GOOD_STANDBY.items() if k != "heartbeat_at"},
        {**GOOD_STANDBY, "instance_id": 5},
        {**GOOD_STANDBY, "since": "then"},
        {**GOOD_STANDBY, "heartbeat_at": None},
        {**GOOD_STANDBY, "ready_at": "now"},
        {**GOOD_STANDBY, "ready_at": False},
        [GOOD_STANDBY],
    ],
)
def test_a_standby_record_with_a_field_missing_or_wrong_is_no_standby(broken: Any) -> None:
    assert StandbyState.from_record(broken) is None


def test_a_damaged_standby_record_is_replaced_by_the_next_claim(s3: Any) -> None:
    s3.put_object(Bucket=BUCKET, Key=STANDBY_KEY, Body=json.dumps({**GOOD_STANDBY, "ready_at": "x"}).encode())
    record = standby(s3, "i-c")
    assert record.read() is None and record.live_other(T0) is None
    assert record.claim(T0) is True and stored(s3, STANDBY_KEY)["instance_id"] == "i-c"


def test_the_lease_and_the_standby_are_stored_as_json(s3: Any) -> None:
    """An operator reads them in the console or with `aws s3 cp … -`: typed as JSON, not as bytes."""
    lease(s3, "i-a").try_acquire(T0)
    standby(s3, "i-b").claim(T0)
    for key in (LEASE_KEY, STANDBY_KEY):
        assert s3.head_object(Bucket=BUCKET, Key=key)["ContentType"] == "application/json"


# -- the fence ---------------------------------------------------------------------------------------


def test_the_fence_passes_only_for_the_token_this_life_acquired(s3: Any) -> None:
    """A lease naming this life and instance under another token is not this life's: its persister, fenced
    with the token it acquired, must not write (the lease was taken and handed back in between)."""
    a = lease(s3, "i-a")
    assert a.try_acquire(T0) == 1
    rewrite(s3, token=3)
    for act in (a.check, lambda: a.renew(T0 + 1)):
        with pytest.raises(LeaseLostError) as lost:
            act()
        assert (lost.value.holder, lost.value.token, lost.value.uri) == ("i-a", 3, URI)
    assert a.release(T0 + 2, stop_step=5) is False
    assert stored(s3)["released_at"] is None, "a release of a lease not ours writes nothing"


def test_an_earlier_agent_on_this_instance_loses_the_fence_to_the_restarted_one(s3: Any) -> None:
    """Same instance, another life: the restarted agent took the lease, the earlier one is fenced out."""
    first = lease(s3, "i-a", "i-a@first")
    assert first.try_acquire(T0) == 1
    assert lease(s3, "i-a", "i-a@second").try_acquire(T0 + 1) == 2
    with pytest.raises(LeaseLostError, match=r"lease lost to i-a \(token 2\)"):
        first.check()


def test_a_lease_deleted_under_its_holder_is_lost_to_nobody(s3: Any) -> None:
    a = lease(s3, "i-a")
    a.try_acquire(T0)
    s3.delete_object(Bucket=BUCKET, Key=LEASE_KEY)
    with pytest.raises(LeaseLostError) as lost:
        a.check()
    nobody = "nobody (the lease is gone)"
    assert (lost.value.holder, lost.value.token, lost.value.uri) == (nobody, 0, URI)
    assert str(lost.value) == (
        f"{URI}: lease lost to nobody (the lease is gone) (token 0): "
        "this instance no longer writes the job's checkpoints"
    )


def test_a_lost_lease_without_a_uri_says_so_in_one_line() -> None:
    lost = LeaseLostError("i-b", 4)
    assert lost.uri == "" and (lost.holder, lost.token) == ("i-b", 4)
    assert str(lost) == "lease lost to i-b (token 4): this instance no longer writes the job's checkpoints"


# -- acquiring ---------------------------------------------------------------------------------------


def test_a_life_that_finds_a_live_holder_replaced_nothing(s3: Any) -> None:
    lease(s3, "i-a").try_acquire(T0)
    b = lease(s3, "i-b")
    assert b.try_acquire(T0 + 1) is None
    assert b.replaced is None and b.held_token is None


def test_naming_a_gone_life_frees_only_that_lives_lease(s3: Any) -> None:
    """`gone` is the life whose instance left the group; any other live holder is still waited for."""
    lease(s3, "i-a").try_acquire(T0)
    b = lease(s3, "i-b")
    assert b.try_acquire(T0 + 1, gone="i-x@life") is None
    assert stored(s3)["holder"] == "i-a"
    assert b.try_acquire(T0 + 1, gone="i-a@life") == 2


def test_a_life_asking_again_after_its_acquiring_write_lost_its_answer_holds_the_token(s3: Any) -> None:
    """The put got in but its answer was lost (the agent retries with a fresh view of the same life): the
    lease is this life's, and its token is what the persister is fenced with."""
    lease(s3, "i-a").try_acquire(T0)
    again = lease(s3, "i-a")
    assert again.try_acquire(T0 + 1) == 1
    assert again.token == 1 and again.check().token == 1


# -- S3's answers ------------------------------------------------------------------------------------


@pytest.mark.parametrize("code", NOT_FOUND)
def test_every_spelling_of_not_found_is_an_absent_record(s3: Any, code: str) -> None:
    faulty = Answers(s3)
    faulty.fail["get_object"] = lambda: s3_error("GetObject", code, 404)
    assert lease(faulty, "i-a").read() is None
    assert standby(faulty, "i-b").read() is None


@pytest.mark.parametrize("code", list(STATUS))
def test_any_other_read_error_is_raised_never_taken_for_an_absent_lease(s3: Any, code: str | None) -> None:
    """Taking an unreadable lease for an absent one would let a second writer in."""
    faulty = Answers(s3)
    faulty.fail["get_object"] = lambda: s3_error("GetObject", code, STATUS[code])
    a = lease(faulty, "i-a")
    with pytest.raises(ClientError):
        a.try_acquire(T0)
    assert faulty.calls.get("put_object", 0) == 0, "nothing written on a read that failed"


@pytest.mark.parametrize("code", NOT_FOUND)
def test_a_standby_record_already_gone_when_cleared_counts_as_cleared(s3: Any, code: str) -> None:
    record = standby(s3, "i-b")
    record.claim(T0)
    faulty = Answers(s3)
    faulty.fail["delete_object"] = lambda: s3_error("DeleteObject", code, 404)
    assert standby(faulty, "i-b").clear() is True


@pytest.mark.parametrize("code", list(STATUS))
def test_a_failed_delete_of_the_standby_record_is_raised(s3: Any, code: str | None) -> None:
    standby(s3, "i-b").claim(T0)
    faulty = Answers(s3)
    faulty.fail["delete_object"] = lambda: s3_error("DeleteObject", code, STATUS[code])
    with pytest.raises(ClientError):
        standby(faulty, "i-b").clear()
    assert stored(s3, STANDBY_KEY)["instance_id"] == "i-b"


def test_a_delete_refused_for_a_record_rewritten_meanwhile_reads_again_and_leaves_it(s3: Any) -> None:
    """412 on the conditional delete: another life claimed in between; the next read shows it is not ours."""
    standby(s3, "i-b").claim(T0)
    faulty = Answers(s3)
    refusals = iter([s3_error("DeleteObject", "PreconditionFailed", 412)])

    def refuse_once() -> ClientError | None:
        error = next(refusals, None)
        if error is not None:
            rewrite(s3, STANDBY_KEY, instance_id="i-c", life_id="i-c@life")
        return error

    faulty.fail["delete_object"] = refuse_once
    assert standby(faulty, "i-b").clear() is False
    assert faulty.calls["delete_object"] == 1 and stored(s3, STANDBY_KEY)["instance_id"] == "i-c"


ACTS = ("try_acquire", "standby claim", "renew", "release", "standby heartbeat")


def _prepared(act: str, s3: Any) -> Callable[[], object]:
    """The act, on a record first set up through `s3` (its writes go through until the test fails them)."""
    if act in ("renew", "release"):
        held = lease(s3, "i-a")
        held.try_acquire(T0)
        return (lambda: held.renew(T0 + 1)) if act == "renew" else (lambda: held.release(T0 + 1, None))
    if act == "standby heartbeat":
        waiting = standby(s3, "i-b")
        waiting.claim(T0)
        return lambda: waiting.heartbeat(T0 + 1)
    if act == "try_acquire":
        return lambda: lease(s3, "i-a").try_acquire(T0)
    return lambda: standby(s3, "i-b").claim(T0)


@pytest.mark.parametrize("act", ACTS)
def test_a_write_s3_keeps_refusing_gives_up_naming_the_record(s3: Any, act: str) -> None:
    """Every conditional write answered 412: someone keeps rewriting the record. The call gives up after
    ATTEMPTS reads-and-writes, naming the record, for the state poller to try again (never spins)."""
    faulty = Answers(s3)
    run = _prepared(act, faulty)
    faulty.calls.clear()
    faulty.fail["put_object"] = lambda: s3_error("PutObject", "PreconditionFailed", 412)
    uri = STANDBY_URI if act.startswith("standby") else URI
    with pytest.raises(RuntimeError) as gave_up:
        run()
    assert str(gave_up.value) == f"{uri}: {ATTEMPTS} conditional writes lost in a row; will retry"
    assert faulty.calls["put_object"] == ATTEMPTS


def test_clearing_a_standby_record_that_is_not_one_removes_nothing(s3: Any) -> None:
    s3.put_object(Bucket=BUCKET, Key=STANDBY_KEY, Body=b"{not json")
    assert standby(s3, "i-b").clear() is False
    assert s3.get_object(Bucket=BUCKET, Key=STANDBY_KEY)["Body"].read() == b"{not json"


def test_a_delete_s3_keeps_refusing_gives_up_naming_the_record(s3: Any) -> None:
    standby(s3, "i-b").claim(T0)
    faulty = Answers(s3)
    faulty.fail["delete_object"] = lambda: s3_error("DeleteObject", "ConditionalRequestConflict", 409)
    with pytest.raises(RuntimeError, match=f"^{STANDBY_URI}: {ATTEMPTS} conditional writes lost in a row"):
        standby(faulty, "i-b").clear()


# -- the standby record ------------------------------------------------------------------------------


def test_another_standby_is_judged_against_the_instance_asked_about(s3: Any) -> None:
    """`live_other(now, me)`: the holder asks whether a standby other than `me` waits; its own record
    view belongs to another instance."""
    standby(s3, "i-b").claim(T0)
    holder_view = standby(s3, "i-a")
    assert holder_view.live_other(T0 + 1, me="i-b") is None, "i-b's own record is not another standby"
    other = holder_view.live_other(T0 + 1)
    assert other is not None and other.instance_id == "i-b"
