"""The job ledger (bootstrap/ledger.py): what a life's record says when it opens and when the next life
closes it (crashed here, vanished elsewhere, a lease holder that died), what every life cost (legacy lives,
price notes, standby waits, hand-overs), the counters a crash loop and the interruption rate read, and the
store's conditional write: two writers never lose each other's change. Mostly in memory; the store against
the moto server with S3's other answers injected. `make mutate ledger` runs these with the ledger's other
tests (bench/mutate.py)."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError

from bootstrap.imds import InstanceIdentity
from bootstrap.ledger import JobLedger, LedgerStore
from bootstrap.pricing import LifeQuote
from tests.conftest import MotoServer
from trainstack_job.contract import JobStatus, LifeOutcome
from trainstack_job.records import Progress, is_conflict
from trainstack_job.throughput import ThroughputStore, ThroughputTable

T0 = datetime(2030, 1, 1, tzinfo=timezone.utc)
BUCKET = "trainstack-ledger"
KEY = "jobs/demo-1a2b3c4d/state/ledger.json"
URI = f"s3://{BUCKET}/{KEY}"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def iso_at(seconds: float) -> str:
    """A moment as the ledger writes it (UTC, milliseconds, `Z`)."""
    return at(seconds).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def node(instance_id: str = "i-a", lifecycle: str = "spot") -> InstanceIdentity:
    return InstanceIdentity(instance_id, "g5.xlarge", "us-east-1a", "us-east-1", lifecycle)


def life_of(ledger: JobLedger, instance_id: str) -> dict[str, Any]:
    return next(x for x in ledger.lives if x["instance_id"] == instance_id)


def opened(instance_id: str, seconds: float, price: float | None = 1.0, **data: Any) -> JobLedger:
    """A ledger with one life of `instance_id` opened at T0 + seconds (on top of `data`, if given)."""
    ledger = JobLedger(data or None)
    ledger.begin_life(node(instance_id), price, at(seconds))
    return ledger


# -- a new ledger and a new life ---------------------------------------------------------------------


def test_a_new_ledger_is_a_running_job_with_nothing_spent_and_no_life() -> None:
    ledger = JobLedger()
    assert ledger.data == {
        "status": "running",
        "lives": [],
        "interruptions": 0,
        "consecutive_failures": 0,
        "total_cost_usd": 0.0,
        "standby_cost_usd": 0.0,
        "handovers": 0,
    }
    assert ledger.current_life() is None and ledger.previous_life() is None
    ledger.begin_life(node(), 1.0, T0)
    assert JobLedger(ledger.data, life_id="i-x@never").current_life() is None, "a life id not in the ledger"


@pytest.mark.parametrize("lifecycle, option", [("spot", "spot"), ("on-demand", "on-demand")])
def test_a_life_opens_with_every_field_an_operator_and_the_cost_cap_read(lifecycle: str, option: str) -> None:
    ledger = JobLedger()
    life_id = ledger.begin_life(node("i-a", lifecycle), 0.75, at(0))
    assert life_id == f"i-a@{iso_at(0)}"
    assert ledger.current_life() == {
        "life_id": life_id,
        "instance_id": "i-a",
        "instance_type": "g5.xlarge",
        "az": "us-east-1a",
        "lifecycle": lifecycle,
        "started_at": iso_at(0),
        "heartbeat_at": iso_at(0),
        "ended_at": None,
        "purchase_option": option,
        "price_source": None,
        "price_usd_per_hour": 0.75,
        "storage_usd_per_hour": 0.0,
        "instance_cost_usd": 0.0,
        "storage_cost_usd": 0.0,
        "cost_usd": 0.0,
        "priced_at": iso_at(0),
        "outcome": "running",
    }
    assert ledger.data["updated_at"] == iso_at(0) and ledger.total_cost_usd == 0.0


def test_the_life_before_is_the_last_one_for_a_reader_that_is_no_life() -> None:
    ledger = JobLedger()
    for index, instance_id in enumerate(("i-a", "i-b", "i-c")):
        ledger = JobLedger(ledger.data)
        ledger.begin_life(node(instance_id), 1.0, at(index * 120))
        ledger.end_life(LifeOutcome.PREEMPTED, at(index * 120 + 60))
    reader = JobLedger(ledger.data)  # the CLI, the capacity function: no life of their own
    previous = reader.previous_life()
    assert previous is not None and previous["instance_id"] == "i-c"


def test_a_queued_job_runs_again_when_its_next_life_begins() -> None:
    """A job that yielded its instance to a `--now` job waits as queued; its next life resumes it."""
    ledger = opened("i-a", 0, status=JobStatus.QUEUED.value)
    assert ledger.data["status"] == "running" and ledger.status == "running"


def test_a_store_never_read_reports_an_empty_running_ledger(aws: MotoServer) -> None:
    """What the agent reports from when S3 was unreachable from the start."""
    store = LedgerStore(boto3.client("s3", region_name="us-east-1"), BUCKET, KEY)
    assert store.last.status == "running" and store.last.total_cost_usd == 0.0 and store.last.lives == []


# -- closing the lives the next life finds still running ---------------------------------------------


def test_a_crashed_agents_life_here_fails_at_its_last_heartbeat_and_counts_one_more_failure() -> None:
    ledger = opened("i-a", 0, consecutive_failures=2)
    ledger.update_cost(at(3600))  # its last heartbeat, one hour in
    ledger = JobLedger(ledger.data)
    ledger.begin_life(node("i-a"), 1.0, at(7200))  # systemd restarted the agent on the same instance
    crashed = ledger.lives[0]
    assert crashed["outcome"] == "failed" and crashed["ended_at"] == iso_at(3600)
    assert crashed["cost_usd"] == pytest.approx(1.0), "billed to its last heartbeat, not to now"
    assert ledger.consecutive_failures == 3


def test_a_crashed_life_with_no_heartbeat_on_record_ends_when_the_next_life_starts() -> None:
    ledger = opened("i-a", 0)
    del ledger.data["lives"][0]["heartbeat_at"]  # a ledger from before heartbeats
    ledger = JobLedger(ledger.data)
    ledger.begin_life(node("i-a"), 1.0, at(1800))
    assert ledger.lives[0]["ended_at"] == iso_at(1800) and ledger.lives[0]["outcome"] == "failed"


def test_a_vanished_life_with_no_heartbeat_on_record_is_interrupted_at_its_start() -> None:
    ledger = opened("i-a", 0)
    del ledger.data["lives"][0]["heartbeat_at"]
    ledger = JobLedger(ledger.data)
    ledger.begin_life(node("i-b"), 1.0, at(1800), stale_after_seconds=60)
    vanished = ledger.lives[0]
    assert vanished["outcome"] == "interrupted" and vanished["ended_at"] == iso_at(0)
    assert vanished["closed_by"] == "i-b" and vanished["cost_usd"] == 0.0
    assert ledger.interruptions == 1


def test_a_life_silent_for_exactly_the_stale_limit_is_dead_as_the_lease_judges_it() -> None:
    """The lease takes a holder silent for `stale` seconds as dead (`now - heartbeat < stale` is live); the
    ledger closes the same life at the same moment, never a poll later."""
    ledger = opened("i-a", 0)
    ledger = JobLedger(ledger.data)
    ledger.begin_life(node("i-b"), 1.0, at(59.999), stale_after_seconds=60)
    assert ledger.lives[0]["outcome"] == "running", "still beating: runs beside the new life"
    ledger = JobLedger(ledger.data)
    ledger.begin_life(node("i-c"), 1.0, at(60), stale_after_seconds=60)
    assert life_of(ledger, "i-a")["outcome"] == "interrupted"


def test_a_crashed_standbys_wait_is_settled_when_the_next_life_closes_it() -> None:
    ledger = opened("i-a", 0)
    ledger.mark_standby(at(0))
    ledger.update_cost(at(1800))
    ledger = JobLedger(ledger.data)
    ledger.begin_life(node("i-a"), 1.0, at(3600))
    crashed = ledger.lives[0]
    assert "standby_cost_from_usd" not in crashed, "no wait left open"
    assert crashed["standby_seconds"] == 1800.0 and crashed["standby_cost_usd"] == pytest.approx(0.5)


def test_a_dead_lease_holders_life_is_closed_once_as_interrupted_at_its_last_heartbeat() -> None:
    ledger = opened("i-a", 0)
    life_id = ledger.lives[0]["life_id"]
    ledger.update_cost(at(600))
    ledger = JobLedger(ledger.data)
    assert ledger.close_dead_holder("i-x@never", "i-b") is False
    assert ledger.close_dead_holder(life_id, "i-b") is True
    closed = ledger.lives[0]
    assert (closed["outcome"], closed["ended_at"], closed["closed_by"]) == ("interrupted", iso_at(600), "i-b")
    assert closed["cost_usd"] == round(600 / 3600, 6)
    assert ledger.interruptions == 1
    assert ledger.close_dead_holder(life_id, "i-b") is False, "closed once"
    assert ledger.interruptions == 1


# -- what each life cost -----------------------------------------------------------------------------


def legacy_life(instance_id: str, started: float, price: float | None) -> dict[str, Any]:
    """A life written before per-option pricing: one price, no `priced_at`."""
    return {
        "life_id": f"{instance_id}@{iso_at(started)}", "instance_id": instance_id, "lifecycle": "spot",
        "started_at": iso_at(started), "heartbeat_at": iso_at(started + 5400), "ended_at": None,
        "price_usd_per_hour": price, "cost_usd": 0.25, "outcome": "running",
    }  # fmt: skip


def test_a_legacy_life_is_billed_time_times_its_one_price_as_it_was_then() -> None:
    ledger = JobLedger({"lives": [legacy_life("i-old", 0, 0.123456789), legacy_life("i-free", 0, None)]})
    ledger.begin_life(node("i-new"), 1.0, at(7200))
    assert life_of(ledger, "i-old")["cost_usd"] == round(1.5 * 0.123456789, 6) == 0.185185
    assert life_of(ledger, "i-free")["cost_usd"] == 0.25, "no price: left as it was"
    assert ledger.total_cost_usd == pytest.approx(0.185185 + 0.25)


def test_figures_are_kept_to_the_stated_precision_and_the_total_is_their_sum() -> None:
    """Components to 9 decimals (sums of many heartbeats stay exact), costs and totals to a millionth of a
    dollar, standby seconds to the millisecond its timestamps carry."""
    ledger = opened("i-a", 0, price=1 / 3)
    ledger.mark_standby(at(0))
    ledger.update_cost(at(3600))
    life = ledger.lives[0]
    assert life["instance_cost_usd"] == round(1 / 3, 9)
    assert life["cost_usd"] == round(1 / 3, 6) == ledger.total_cost_usd == ledger.standby_cost_usd
    quote = LifeQuote("spot", "meter", 0.5, 2 / 3, 1 / 7)
    ledger.update_cost(at(7200), quote)
    assert life["instance_cost_usd"] == round(2 / 3, 9)
    assert life["storage_cost_usd"] == 0.0 and life["storage_usd_per_hour"] == 1 / 7
    ledger.update_cost(at(10800.333))
    storage = round(1 / 7 * 3600.333 / 3600, 9)
    assert life["storage_cost_usd"] == storage
    instance = round(2 / 3 + 0.5 * 3600.333 / 3600, 9)
    assert life["cost_usd"] == round(instance + storage, 6) == ledger.total_cost_usd
    ledger.end_standby(at(10800.333))
    assert life["standby_seconds"] == 10800.333
    assert life["standby_cost_usd"] == round(instance + storage, 6) == ledger.standby_cost_usd


def test_a_price_note_is_kept_while_the_quotes_carry_it_and_dropped_after() -> None:
    ledger = opened("i-a", 0)
    ledger.update_cost(at(60), LifeQuote("spot", "history", 0.5, None, 0.0, "no price history: cap price"))
    assert ledger.lives[0]["price_note"] == "no price history: cap price"
    ledger.update_cost(at(120), LifeQuote("spot", "history", 0.5, None, 0.0))
    assert "price_note" not in ledger.lives[0]


def test_a_reader_that_is_no_life_refreshes_the_jobs_total() -> None:
    ledger = opened("i-a", 0)
    ledger.update_cost(at(3600))
    reader = JobLedger(ledger.data)
    assert reader.update_cost(at(7200)) == pytest.approx(1.0), "no life of its own to bill"
    assert reader.data["updated_at"] == iso_at(7200)


# -- the warm standby's cost ---------------------------------------------------------------------------


def test_a_standby_costs_only_what_accrued_while_it_waited_and_waits_once() -> None:
    ledger = opened("i-a", 0, price=1.0)
    ledger.update_cost(at(3600))  # one hour preparing: not waiting yet
    ledger.mark_standby(at(3600))
    ledger.mark_standby(at(5400))  # marked again: the first mark counts
    assert ledger.lives[0]["standby_since"] == iso_at(3600)
    ledger.end_standby(at(7200))
    assert ledger.lives[0]["standby_cost_usd"] == pytest.approx(1.0)
    assert ledger.lives[0]["standby_seconds"] == 3600.0
    assert ledger.standby_cost_usd == pytest.approx(1.0)
    ledger.mark_standby(at(9000))  # a life waits once: it took the lease, or it left
    ledger.end_standby(at(10800))
    assert ledger.lives[0]["standby_cost_usd"] == pytest.approx(1.0) == ledger.standby_cost_usd


def test_a_wait_that_ends_as_it_starts_cost_nothing_and_took_no_time() -> None:
    ledger = opened("i-a", 0, price=None)  # no price known: nothing billed
    ledger.mark_standby(at(10))
    ledger.end_standby(at(10))
    assert ledger.lives[0]["standby_seconds"] == 0.0 and ledger.lives[0]["standby_cost_usd"] == 0.0
    ledger.mark_standby(at(20))
    ledger.end_standby(at(80))
    assert ledger.lives[0]["standby_cost_usd"] == 0.0, "a life with no price waits for free"


def test_an_ended_life_is_never_marked_waiting() -> None:
    ledger = opened("i-a", 0)
    ledger.end_life(LifeOutcome.SURPLUS, at(60))
    ledger.mark_standby(at(70))
    assert "standby_since" not in ledger.lives[0] and ledger.standby_cost_usd == 0.0


def test_the_standby_total_adds_every_open_wait_and_hand_overs_count_only_hand_overs() -> None:
    a = opened("i-a", -1800, price=1.0)
    life_a = a.lives[0]["life_id"]
    a.mark_standby(at(0))  # half an hour preparing (0.50 USD) before it waits
    b = JobLedger(a.data)
    life_b = b.begin_life(node("i-b"), 2.0, at(0), stale_after_seconds=60)
    b.mark_standby(at(0))
    assert b.data["standby_cost_usd"] == 0.0, "two waits that just began cost nothing yet"
    a = JobLedger(b.data, life_a)
    a.update_cost(at(1800))
    b = JobLedger(a.data, life_b)
    b.update_cost(at(1800))
    assert b.data["standby_cost_usd"] == pytest.approx(0.5 + 1.0), "both open waits, each from its mark"
    assert b.handovers == 0
    b.end_life(LifeOutcome.HANDED_OVER, at(1800))
    assert b.handovers == 1 and b.data["handovers"] == 1


def test_an_early_call_is_a_programming_error_that_says_which_call() -> None:
    ledger = JobLedger()
    with pytest.raises(RuntimeError, match=r"^mark_standby\(\) before begin_life\(\)$"):
        ledger.mark_standby(T0)
    with pytest.raises(RuntimeError, match=r"^end_standby\(\) before begin_life\(\)$"):
        ledger.end_standby(T0)
    with pytest.raises(RuntimeError, match=r"^end_life\(\) before begin_life\(\)$"):
        ledger.end_life(LifeOutcome.COMPLETED, T0)


# -- the counters ------------------------------------------------------------------------------------


def test_interruptions_add_up_over_lives() -> None:
    ledger = opened("i-a", 0, interruptions=2)
    ledger.end_life(LifeOutcome.PREEMPTED, at(60))
    assert ledger.interruptions == 3


def test_the_first_crash_of_a_multinode_generation_counts_once_and_its_other_nodes_add_nothing() -> None:
    ledger = JobLedger()
    ids = []
    for index, instance_id in enumerate(("i-a", "i-b")):
        ledger = JobLedger(ledger.data)
        ids.append(ledger.begin_life(node(instance_id), 1.0, at(index), stale_after_seconds=60))
        ledger.set_generation(4)
    first = JobLedger(ledger.data, ids[0])
    first.end_life(LifeOutcome.FAILED, at(30))
    assert first.consecutive_failures == 1, "the generation's first crash is a failure"
    second = JobLedger(first.data, ids[1])
    second.end_life(LifeOutcome.STALLED, at(31))
    assert second.consecutive_failures == 1, "the same crash seen by the other node"


def test_spot_interruptions_count_spot_lives_that_ended_interrupted_over_their_hours() -> None:
    """The observed interruption rate: spot lives only, a running life to its last heartbeat."""
    ledger = JobLedger()
    ends = [
        ("i-1", "spot", LifeOutcome.PREEMPTED),
        ("i-2", "spot", LifeOutcome.INTERRUPTED),
        ("i-3", "spot", LifeOutcome.COMPLETED),
        ("i-4", "on-demand", LifeOutcome.PREEMPTED),
        ("i-6", "spot", LifeOutcome.FAILED),
    ]
    for index, (instance_id, lifecycle, outcome) in enumerate(ends):
        ledger = JobLedger(ledger.data)
        ledger.begin_life(node(instance_id, lifecycle), 1.0, at(index * 7200))
        ledger.end_life(outcome, at(index * 7200 + 3600))
    ledger = JobLedger(ledger.data)
    ledger.begin_life(node("i-5"), 1.0, at(40000))
    ledger.update_cost(at(40000 + 1800))
    assert ledger.spot_interruptions() == (2, pytest.approx(4.5))
    assert JobLedger().spot_interruptions() == (0, 0.0)


@pytest.mark.parametrize("status", [JobStatus.COST_CAP, "completed"])
def test_a_status_is_stored_as_its_value(status: JobStatus | str) -> None:
    ledger = JobLedger()
    ledger.set_status(status)  # type: ignore[arg-type]
    assert ledger.data["status"] == JobStatus(status).value and json.loads(json.dumps(ledger.data))
    with pytest.raises(ValueError):
        ledger.set_status("finished")  # type: ignore[arg-type]


# -- S3's answers --------------------------------------------------------------------------------------


def s3_error(operation: str, code: str | None, status: int | None) -> ClientError:
    response: dict[str, Any] = {}
    if code is not None:
        response["Error"] = {"Code": code, "Message": f"injected {code}"}
    if status is not None:
        response["ResponseMetadata"] = {"HTTPStatusCode": status}
    return ClientError(response, operation)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "code, status, conflict",
    [
        ("PreconditionFailed", 412, True),
        ("ConditionalRequestConflict", 409, True),
        ("PreconditionFailed", None, True),
        ("ConditionalRequestConflict", None, True),
        (None, 412, True),
        (None, 409, True),
        ("SomethingElse", 409, True),
        ("NoSuchKey", 404, False),
        ("InternalError", 500, False),
        ("SlowDown", 503, False),
        (None, None, False),
        (None, 500, False),
    ],
)
def test_a_conflict_is_s3s_every_answer_to_a_lost_conditional_write(
    code: str | None, status: int | None, conflict: bool
) -> None:
    assert is_conflict(s3_error("PutObject", code, status)) is conflict


class Interleaved:
    """The moto client with another writer: after this client's read number `after_read`, `write` runs
    (another life's change lands between the read and the conditional write); `fail` injects answers."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.reads = 0
        self.puts = 0
        self.between: dict[int, Any] = {}
        self.fail_get: ClientError | None = None
        self.fail_put: ClientError | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def get_object(self, **kwargs: Any) -> Any:
        if self.fail_get is not None:
            raise self.fail_get
        response = self._client.get_object(**kwargs)
        self.reads += 1
        if self.reads in self.between:
            self.between[self.reads]()
        return response

    def put_object(self, **kwargs: Any) -> Any:
        self.puts += 1
        if self.fail_put is not None:
            raise self.fail_put
        return self._client.put_object(**kwargs)


@pytest.fixture()
def s3(aws: MotoServer) -> Any:
    client = boto3.client("s3", region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    return client


def stored(s3: Any) -> dict[str, Any]:
    return dict(json.loads(s3.get_object(Bucket=BUCKET, Key=KEY)["Body"].read()))


def count(field: str) -> Any:
    def change(ledger: JobLedger) -> None:
        ledger.data[field] = ledger.data.get(field, 0) + 1

    return change


def test_two_writers_never_lose_each_others_change(s3: Any) -> None:
    """The other writer (this life's poller, or an old life draining) lands between this writer's read and
    its write: the conditional write is refused, the change is applied again on the newest copy."""
    LedgerStore(s3, BUCKET, KEY).update(count("interruptions"))
    racing = Interleaved(s3)
    racing.between[1] = lambda: LedgerStore(s3, BUCKET, KEY).update(count("handovers"))
    LedgerStore(racing, BUCKET, KEY).update(count("interruptions"))
    assert (stored(s3)["interruptions"], stored(s3)["handovers"]) == (2, 1)
    assert racing.puts == 2, "the first write was refused and retried"


def test_two_writers_creating_the_ledger_at_once_both_land(s3: Any) -> None:
    racing = Interleaved(s3)
    first = LedgerStore(racing, BUCKET, KEY)
    # The ledger does not exist for this writer's first read; another life creates it before the write.
    original = racing.get_object

    def absent_then_created(**kwargs: Any) -> Any:
        if racing.reads == 0:
            racing.reads = 1
            LedgerStore(s3, BUCKET, KEY).update(count("handovers"))
            raise s3.exceptions.NoSuchKey({"Error": {"Code": "NoSuchKey"}}, "GetObject")
        return original(**kwargs)

    racing.get_object = absent_then_created  # type: ignore[method-assign]
    first.update(count("interruptions"))
    assert (stored(s3)["interruptions"], stored(s3)["handovers"]) == (1, 1)


def test_a_write_s3_keeps_refusing_gives_up_naming_the_ledger(s3: Any) -> None:
    racing = Interleaved(s3)
    racing.fail_put = s3_error("PutObject", "PreconditionFailed", 412)
    with pytest.raises(RuntimeError) as gave_up:
        LedgerStore(racing, BUCKET, KEY, attempts=3).update(count("interruptions"))
    assert str(gave_up.value) == f"{URI}: 3 concurrent writers in a row; will retry"
    assert racing.puts == 3


@pytest.mark.parametrize("code", ["NoSuchKey", "404"])
def test_a_ledger_not_found_is_a_new_job(s3: Any, code: str) -> None:
    racing = Interleaved(s3)
    racing.fail_get = s3_error("GetObject", code, 404)
    assert LedgerStore(racing, BUCKET, KEY).read() == (None, None)


@pytest.mark.parametrize("code", [None, "AccessDenied", "InternalError"])
def test_a_ledger_that_cannot_be_read_is_raised_never_taken_for_a_new_job(s3: Any, code: str | None) -> None:
    """Starting over from an empty ledger would reset the crash counter and forget what the job cost."""
    racing = Interleaved(s3)
    racing.fail_get = s3_error("GetObject", code, 403 if code == "AccessDenied" else 500)
    with pytest.raises(ClientError):
        LedgerStore(racing, BUCKET, KEY).update(count("interruptions"))
    assert racing.puts == 0


@pytest.mark.parametrize("body", [b'"text"', b"[1, 2]", b"7"])
def test_a_ledger_that_is_not_an_object_is_replaced_by_a_fresh_one(s3: Any, body: bytes) -> None:
    s3.put_object(Bucket=BUCKET, Key=KEY, Body=body)
    store = LedgerStore(s3, BUCKET, KEY)
    assert store.load().lives == []
    store.update(count("interruptions"))
    assert stored(s3)["interruptions"] == 1


def test_the_ledger_is_stored_as_json_and_says_what_it_cannot_encode_as_text(s3: Any) -> None:
    store = LedgerStore(s3, BUCKET, KEY)
    store.begin_life(node(), 1.0, T0)
    store.update(lambda ledger: ledger.end_life(LifeOutcome.FAILED, at(60), log=Path("/var/log/job.log")))
    assert s3.head_object(Bucket=BUCKET, Key=KEY)["ContentType"] == "application/json"
    assert stored(s3)["lives"][0]["log"] == "/var/log/job.log"


def test_a_life_reloaded_from_the_store_is_still_this_life(s3: Any) -> None:
    store = LedgerStore(s3, BUCKET, KEY)
    store.begin_life(node("i-a"), 1.0, T0)
    life_id = store.life_id
    LedgerStore(s3, BUCKET, KEY).begin_life(node("i-b"), 1.0, at(1), stale_after_seconds=60)
    current = store.load().current_life()
    assert current is not None and current["life_id"] == life_id and current["instance_id"] == "i-a"


# -- what the ledger's writers set, and how it is stored --------------------------------------------------


def test_a_status_keeps_its_reason_and_a_status_without_one_keeps_the_last_reason() -> None:
    ledger = JobLedger()
    ledger.set_status(JobStatus.FAILED, "its code cannot run: code/x is missing")
    assert (ledger.data["status"], ledger.data["reason"]) == (
        "failed",
        "its code cannot run: code/x is missing",
    )
    ledger.set_status(JobStatus.COMPLETED)
    assert ledger.data["reason"] == "its code cannot run: code/x is missing"
    fresh = JobLedger()
    fresh.set_status(JobStatus.STOPPED)
    assert "reason" not in fresh.data


def test_the_dataset_a_job_trains_on_is_set_and_read_back() -> None:
    ledger = JobLedger()
    entry = {"name": "imagenet-small", "version": "0123456789ab", "files": 3}
    ledger.set_dataset(entry)
    assert ledger.data["dataset"] == entry
    assert ledger.dataset is not None and ledger.dataset["version"] == "0123456789ab"


def test_a_job_that_ended_before_a_bound_life_began_is_named_or_shown_unknown() -> None:
    from bootstrap.ledger import JobEndedError

    for data, name in (({"job_id": "demo-1a2b3c4d"}, "demo-1a2b3c4d"), ({}, "?")):
        ledger = JobLedger({**data, "status": "completed", "lives": []} if data else None)
        ledger.set_status(JobStatus.COMPLETED)
        with pytest.raises(JobEndedError) as ended:
            ledger.begin_life(node(), 1.0, at(10), restart=False)
        assert str(ended.value) == f"job {name} ended (completed) before this life began"


def test_the_stored_ledger_is_indented_json_for_people_to_read(aws: MotoServer) -> None:
    s3 = boto3.client("s3", region_name="us-east-1")
    s3.create_bucket(Bucket=BUCKET)
    store = LedgerStore(s3, BUCKET, KEY)
    store.update(lambda ledger: ledger.set_status(JobStatus.COMPLETED, "done"))
    body = s3.get_object(Bucket=BUCKET, Key=KEY)["Body"].read().decode()
    assert body == json.dumps(json.loads(body), indent=2)
    assert json.loads(body)["reason"] == "done"


# -- throughput: what each life measured, merged into the stack's table at its end --------------------


def report(step: int, samples_per_s: float, precision: str = "bf16", model: str = "resnet50") -> Progress:
    return Progress(step=step, samples_per_s=samples_per_s, precision=precision, model=model)


def test_a_life_keeps_the_mean_of_its_reports_counting_each_step_once() -> None:
    ledger = opened("i-a", 0)
    assert ledger.record_throughput(report(10, 100.0))
    assert not ledger.record_throughput(report(10, 100.0)), "the same report at the next heartbeat"
    assert not ledger.record_throughput(report(5, 900.0)), "an older report (a restarted trainer's first)"
    assert not ledger.record_throughput(Progress(step=30)), "a report without a speed"
    assert ledger.record_throughput(report(20, 200.0))
    life = life_of(ledger, "i-a")
    assert (life["samples_per_second"], life["throughput_reports"], life["throughput_step"]) == (150.0, 2, 20)
    assert (life["precision"], life["model_family"]) == ("bf16", "resnet50")


def test_an_ended_life_measures_no_more() -> None:
    ledger = opened("i-a", 0)
    ledger.record_throughput(report(10, 100.0))
    ledger.end_life(LifeOutcome.PREEMPTED, at(3600))
    assert not ledger.record_throughput(report(20, 900.0))
    assert life_of(ledger, "i-a")["samples_per_second"] == 100.0


def test_a_life_that_ends_merges_the_jobs_lives_into_the_stacks_table_once(s3: Any) -> None:
    table = ThroughputStore(s3, BUCKET, "state/throughput.json")
    store = LedgerStore(s3, BUCKET, KEY)
    progress: list[Progress | None] = [None]
    store.measure_throughput(lambda: progress[0], table, "demo-1a2b3c4d")
    store.begin_life(node("i-a"), 1.0, at(0))
    progress[0] = report(50, 120.0)
    store.update(lambda ledger: ledger.update_cost(at(600)))
    assert table.load() == ThroughputTable(), "nothing merged while the life runs"
    store.update(lambda ledger: ledger.end_life(LifeOutcome.PREEMPTED, at(3600)))
    merged = table.load()
    measured = merged.jobs["demo-1a2b3c4d"]["g5.xlarge"]
    assert (measured.samples_per_second, measured.lives, measured.hours) == (120.0, 1, 1.0)
    assert merged.families["resnet50"]["g5.xlarge"].precisions == ["bf16"]
    # A later update of the same (ended) life, and the next life's own end, count this life once.
    store.update(lambda ledger: ledger.update_cost(at(3700)))
    assert table.load() == merged
    assert store.throughput_error is None


def test_a_table_that_cannot_be_written_never_fails_the_ledgers_write(s3: Any) -> None:
    racing = Interleaved(s3)
    store = LedgerStore(s3, BUCKET, KEY)
    store.measure_throughput(lambda: report(5, 10.0), ThroughputStore(racing, BUCKET, "state/t.json", 2), "j")
    racing.fail_put = s3_error("PutObject", "PreconditionFailed", 412)
    store.begin_life(node("i-a"), 1.0, at(0))
    store.update(lambda ledger: ledger.end_life(LifeOutcome.COMPLETED, at(60)))
    assert stored(s3)["lives"][0]["outcome"] == "completed"
    assert store.throughput_error == "s3://trainstack-ledger/state/t.json: RuntimeError: " + (
        "s3://trainstack-ledger/state/t.json: 2 concurrent writers in a row; the next life end merges"
    )


def test_a_write_s3_keeps_refusing_is_tried_ten_times_by_default_backing_off_a_little_more_each_time(
    s3: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ten conflicts in a row by default, each retry waiting longer than the last (the other writer gets
    through), all ten within a few seconds (a heartbeat is not held up)."""
    slept: list[float] = []
    monkeypatch.setattr("bootstrap.ledger.time.sleep", slept.append)
    racing = Interleaved(s3)
    racing.fail_put = s3_error("PutObject", "PreconditionFailed", 412)
    with pytest.raises(RuntimeError, match="10 concurrent writers in a row"):
        LedgerStore(racing, BUCKET, KEY).update(count("interruptions"))
    assert racing.puts == 10
    assert slept == sorted(slept) and len(set(slept)) == len(slept), f"no growing back-off: {slept}"
    assert slept[0] < 0.1 and sum(slept) < 5.0, f"back-off too long for a heartbeat: {slept}"


def test_a_fresh_store_has_no_throughput_error_to_report(s3: Any) -> None:
    assert LedgerStore(s3, BUCKET, KEY).throughput_error is None


def test_a_report_of_no_speed_is_not_counted_and_a_slow_one_is() -> None:
    ledger = opened("i-a", 0)
    assert not ledger.record_throughput(report(10, 0.0)), "a stalled report (0 samples/s) is no measurement"
    assert ledger.record_throughput(report(20, 0.5)), "a slow trainer's 0.5 samples/s is one"
    assert life_of(ledger, "i-a")["samples_per_second"] == 0.5


def test_the_mean_is_kept_to_three_decimals() -> None:
    ledger = opened("i-a", 0)
    ledger.record_throughput(report(10, 123.4567))
    assert life_of(ledger, "i-a")["samples_per_second"] == 123.457
    ledger.record_throughput(report(20, 100.0001))
    assert life_of(ledger, "i-a")["samples_per_second"] == 111.729


def test_a_life_with_reports_but_no_mean_on_record_starts_its_mean_from_zero() -> None:
    """A hand-edited or truncated life (reports counted, mean missing) is not given a speed it never had."""
    ledger = opened("i-a", 0)
    life = life_of(ledger, "i-a")
    life["throughput_reports"], life["samples_per_second"] = 1, None
    ledger.record_throughput(report(10, 100.0))
    assert life_of(ledger, "i-a")["samples_per_second"] == 50.0


def test_an_update_of_a_life_that_had_already_ended_merges_nothing_again(s3: Any) -> None:
    merges: list[str] = []
    store = LedgerStore(s3, BUCKET, KEY)
    store.measure_throughput(lambda: report(5, 10.0), ThroughputStore(s3, BUCKET, "state/t.json"), "j")
    store.begin_life(node("i-a"), 1.0, at(0))
    store.update(lambda ledger: ledger.end_life(LifeOutcome.COMPLETED, at(60)))
    store._merge_throughput = lambda ledger: merges.append("merged")  # type: ignore[method-assign]
    store.update(lambda ledger: ledger.update_cost(at(120)))
    assert merges == [], "only the update that ends the life merges"


# -- time to first step and data wait: what each life's data cost it (issue 35) -----------------------


def waited(step: int, fraction: float | None, samples_per_s: float | None = None) -> Progress:
    return Progress(step=step, samples_per_s=samples_per_s, data_wait_fraction=fraction)


def first_step(step: int, seconds: float) -> Progress:
    """A report of a trainer whose first step of this process finished `seconds` after T0."""
    return Progress(step=step, first_step_at=iso_at(seconds))


def test_a_lifes_time_to_first_step_is_kept_once_from_its_start() -> None:
    ledger = opened("i-a", 100)  # the life starts at T0 + 100 s
    assert ledger.record_throughput(first_step(10, 142.125))
    assert life_of(ledger, "i-a")["first_step_seconds"] == 42.125
    # A trainer restarted within the life (a multi-node regroup) reports its own, later first step: the
    # life's first step came first.
    assert not ledger.record_throughput(first_step(20, 300.0))
    assert life_of(ledger, "i-a")["first_step_seconds"] == 42.125


def test_a_first_step_at_the_lifes_start_is_0_and_one_before_it_is_left_unknown() -> None:
    ledger = opened("i-a", 100)
    # Before the life began: a progress file an earlier trainer left, or a clock stepped back. Never a
    # negative number, never a made-up 0: unknown, and the life's own trainer can still give it.
    assert not ledger.record_throughput(first_step(10, 99.999))
    assert "first_step_seconds" not in life_of(ledger, "i-a")
    assert ledger.record_throughput(first_step(10, 100.0))
    assert life_of(ledger, "i-a")["first_step_seconds"] == 0.0


def test_a_first_step_that_is_no_time_is_not_measured() -> None:
    ledger = opened("i-a", 0)
    for said in ("soon", "2030-01-01T00:00:10", ""):  # not a time; no time zone; empty
        assert not ledger.record_throughput(Progress(step=10, first_step_at=said)), said
    assert "first_step_seconds" not in life_of(ledger, "i-a")
    assert not ledger.record_throughput(Progress(step=10)), "a user's job that does not say has none"
    assert "first_step_seconds" not in life_of(ledger, "i-a")


def test_each_life_has_its_own_first_step() -> None:
    ledger = opened("i-a", 0)
    ledger.record_throughput(first_step(10, 30.0))
    ledger.end_life(LifeOutcome.PREEMPTED, at(600))
    assert not ledger.record_throughput(first_step(20, 700.0)), "an ended life measures no more"
    ledger.begin_life(node("i-b"), 1.0, at(900))
    assert ledger.record_throughput(first_step(400, 912.5))
    assert life_of(ledger, "i-a")["first_step_seconds"] == 30.0
    assert life_of(ledger, "i-b")["first_step_seconds"] == 12.5


def test_a_life_keeps_the_mean_data_wait_of_its_reports_counting_each_step_once() -> None:
    ledger = opened("i-a", 0)
    assert ledger.record_throughput(waited(10, 0.1, samples_per_s=100.0))
    assert not ledger.record_throughput(waited(10, 0.1, samples_per_s=100.0)), "the same report again"
    assert not ledger.record_throughput(waited(5, 0.9)), "an older report (a restarted trainer's first)"
    assert not ledger.record_throughput(waited(30, None)), "a report without a data wait"
    # A stall (0 samples/s) is no speed but still a wait: counted here, not in the throughput mean.
    assert ledger.record_throughput(waited(20, 0.4, samples_per_s=0.0))
    life = life_of(ledger, "i-a")
    assert (life["data_wait_fraction"], life["data_wait_reports"], life["data_wait_step"]) == (0.25, 2, 20)
    assert (life["samples_per_second"], life["throughput_reports"], life["throughput_step"]) == (100.0, 1, 10)


def test_a_data_wait_outside_0_to_1_is_no_measurement_and_its_ends_are() -> None:
    ledger = opened("i-a", 0)
    assert not ledger.record_throughput(waited(10, 1.5)), "a percentage is not a share"
    assert not ledger.record_throughput(waited(20, -0.1))
    assert "data_wait_fraction" not in life_of(ledger, "i-a")
    assert ledger.record_throughput(waited(30, 1.0))
    assert ledger.record_throughput(waited(40, 0.0))
    life = life_of(ledger, "i-a")
    assert (life["data_wait_fraction"], life["data_wait_reports"], life["data_wait_step"]) == (0.5, 2, 40)


def test_the_data_wait_mean_is_kept_to_three_decimals_and_starts_from_zero_without_one() -> None:
    ledger = opened("i-a", 0)
    ledger.record_throughput(waited(10, 0.1234))
    assert life_of(ledger, "i-a")["data_wait_fraction"] == 0.123
    ledger.record_throughput(waited(20, 0.2))
    assert life_of(ledger, "i-a")["data_wait_fraction"] == 0.162
    # A hand-edited life: one report counted but its mean lost is not given a wait it never had; a count
    # that is no count starts over.
    life = life_of(ledger, "i-a")
    life["data_wait_reports"], life["data_wait_fraction"] = 1, None
    ledger.record_throughput(waited(30, 0.5))
    assert (life_of(ledger, "i-a")["data_wait_fraction"], life_of(ledger, "i-a")["data_wait_reports"]) == (
        0.25,
        2,
    )
    life["data_wait_reports"], life["data_wait_fraction"] = -3, 0.9
    ledger.record_throughput(waited(40, 0.1))
    assert (life_of(ledger, "i-a")["data_wait_fraction"], life_of(ledger, "i-a")["data_wait_reports"]) == (
        0.1,
        1,
    )


def test_the_ledgers_updates_store_the_first_step_once_and_each_reports_wait_once(s3: Any) -> None:
    store = LedgerStore(s3, BUCKET, KEY)
    progress: list[Progress | None] = [None]
    store.measure_throughput(lambda: progress[0], ThroughputStore(s3, BUCKET, "state/t.json"), "j")
    store.begin_life(node("i-a"), 1.0, at(0))
    progress[0] = Progress(step=10, data_wait_fraction=0.2, first_step_at=iso_at(8.5))
    store.update(lambda ledger: ledger.update_cost(at(30)))
    store.update(lambda ledger: ledger.update_cost(at(60)))  # the same report at the next heartbeat
    progress[0] = Progress(step=20, data_wait_fraction=0.6, first_step_at=iso_at(8.5))
    store.update(lambda ledger: ledger.update_cost(at(90)))
    [life] = stored(s3)["lives"]
    assert life["first_step_seconds"] == 8.5
    assert (life["data_wait_fraction"], life["data_wait_reports"], life["data_wait_step"]) == (0.4, 2, 20)
    assert "samples_per_second" not in life, "no speed reported, none measured"


def test_a_standbys_time_to_first_step_counts_from_its_hand_over() -> None:
    ledger = opened("i-a", 100)
    ledger.mark_standby(at(110))
    ledger.end_standby(at(710))  # waited warm for 600 s, then took the job
    assert ledger.record_throughput(first_step(10, 714.5))
    assert life_of(ledger, "i-a")["first_step_seconds"] == 4.5


def test_a_standby_still_waiting_counts_from_its_start_until_its_wait_is_settled() -> None:
    """A report while the wait is open (a wait never settled: the hand-over's record lost) has no hand-over
    to count from: the life's start is all there is."""
    ledger = opened("i-a", 100)
    ledger.mark_standby(at(110))
    assert ledger.record_throughput(first_step(10, 150.0))
    assert life_of(ledger, "i-a")["first_step_seconds"] == 50.0


def test_a_first_step_said_to_the_microsecond_is_kept_to_the_millisecond() -> None:
    ledger = opened("i-a", 100)
    assert ledger.record_throughput(Progress(step=10, first_step_at=at(142.123457).isoformat()))
    assert life_of(ledger, "i-a")["first_step_seconds"] == 42.123
