"""One writer per job (bootstrap/lease.py): the promises `make mutate` found untested, against the moto
server with S3's other answers injected. A fence passes only for the exact token, life and instance that
acquired it; a record that is not a lease or a standby counts as absent, never crashes its reader; S3's
"not found" in its every spelling means absent, any other error is raised; a write S3 keeps refusing gives
up with the record's URI; what a lost lease says names who took it."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError

from bootstrap.lease import ATTEMPTS, JobLease, LeaseLostError, LeaseState, StandbyRecord, StandbyState
from tests.conftest import MotoServer

BUCKET = "trainstack-lease-mutants"
LEASE_KEY = "jobs/demo-1a2b3c4d/state/lease.json"
STANDBY_KEY = "jobs/demo-1a2b3c4d/state/standby.json"
LEASE_URI = f"s3://{BUCKET}/{LEASE_KEY}"
STANDBY_URI = f"s3://{BUCKET}/{STANDBY_KEY}"
STALE = 60.0
T0 = 1_800_000_000.0
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
        s3, BUCKET, STANDBY_KEY, instance_id=instance_id, life_id=life or f"{instance_id}@life",
        stale_seconds=STALE,
    )  # fmt: skip


def stored(s3: Any, key: str = LEASE_KEY) -> dict[str, Any]:
    return dict(json.loads(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()))


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
        assert (lost.value.holder, lost.value.token, lost.value.uri) == ("i-a", 3, LEASE_URI)
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
    assert (lost.value.holder, lost.value.token, lost.value.uri) == (nobody, 0, LEASE_URI)
    assert str(lost.value) == (
        f"{LEASE_URI}: lease lost to nobody (the lease is gone) (token 0): "
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


ACTS: dict[str, Callable[[Any], object]] = {
    "try_acquire": lambda s3: lease(s3, "i-a").try_acquire(T0),
    "standby claim": lambda s3: standby(s3, "i-b").claim(T0),
}


@pytest.mark.parametrize("act", ACTS, ids=list(ACTS))
def test_a_write_s3_keeps_refusing_gives_up_naming_the_record(s3: Any, act: str) -> None:
    """Every conditional write answered 412: someone keeps rewriting the record. The call gives up after
    ATTEMPTS reads-and-writes, naming the record, for the state poller to try again (never spins)."""
    faulty = Answers(s3)
    faulty.fail["put_object"] = lambda: s3_error("PutObject", "PreconditionFailed", 412)
    uri = LEASE_URI if act == "try_acquire" else STANDBY_URI
    with pytest.raises(RuntimeError) as gave_up:
        ACTS[act](faulty)
    assert str(gave_up.value) == f"{uri}: {ATTEMPTS} conditional writes lost in a row; will retry"
    assert faulty.calls["put_object"] == ATTEMPTS


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
