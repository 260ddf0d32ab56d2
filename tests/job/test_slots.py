"""trainstack_job/slots.py against the moto server: at most `maxConcurrentJobs` jobs hold a run slot, whatever
races; a job's end or a start that never came frees its slot; a job named twice holds one."""

from __future__ import annotations

import json
import threading
from datetime import datetime, timedelta, timezone
from typing import Any

import boto3
import pytest

from tests.waiting import join_all
from trainstack_job.slots import Slots, slot_key

NOW = datetime(2026, 12, 6, 12, 0, tzinfo=timezone.utc)
BUCKET = "slots-test"
A, B, C, D = "alpha-aaaaaaaa", "bravo-bbbbbbbb", "charlie-cccccccc", "delta-dddddddd"


class World:
    """A bucket and the jobs' ledger statuses (what the slots ask of each job)."""

    def __init__(self) -> None:
        self.s3 = boto3.client("s3", region_name="us-east-1")
        self.s3.create_bucket(Bucket=BUCKET)
        self.status: dict[str, str] = {}

    def slots(self, limit: int, stale: float = 60.0) -> Slots:
        return Slots(self.s3, BUCKET, "state/", limit, self.status.get, stale)

    def slot(self, index: int) -> Any:
        try:
            body = self.s3.get_object(Bucket=BUCKET, Key=slot_key("state/", index))["Body"].read()
        except self.s3.exceptions.NoSuchKey:
            return None
        return json.loads(body)

    def put(self, index: int, body: bytes) -> None:
        self.s3.put_object(Bucket=BUCKET, Key=slot_key("state/", index), Body=body)


@pytest.fixture()
def world(aws: Any) -> World:
    return World()


def test_the_limit_holds_until_a_job_ends_and_a_job_keeps_its_own_slot(world: World) -> None:
    slots = world.slots(2)
    assert slot_key("state/", 1) == "state/slots/slot-1.json"
    assert slots.take(A, NOW) == 0 and slots.take(B, NOW) == 1
    assert world.slot(0) == {"job_id": A, "since": "2026-12-06T12:00:00.000Z"}
    world.status.update({A: "running", B: "waiting_for_data"})
    assert slots.take(C, NOW) is None, "two run: the third waits"
    assert not slots.room_for(C, NOW) and slots.room_for(A, NOW)
    assert slots.take(A, NOW + timedelta(hours=5)) == 0, "a running job holds its slot for as long as it runs"
    assert slots.running(NOW) == [A, B]
    for ended in ("completed", "failed", "stopped", "cost_cap", "no_data", "cancelled"):
        world.status[A] = ended
        assert slots.room_for(C, NOW), ended
    assert slots.take(C, NOW) == 0, "A's end freed its slot"
    assert world.slot(0)["job_id"] == C
    world.status[C] = "running"
    assert slots.running(NOW) == [C, B]


def test_a_job_that_never_started_holds_its_slot_only_within_the_staleness_window(world: World) -> None:
    slots = world.slots(1, stale=60)
    assert slots.take(A, NOW) == 0
    assert slots.take(B, NOW + timedelta(seconds=59)) is None, "A's instance is on its way"
    # A's instance asks again (a second look): its window starts again from now.
    assert slots.take(A, NOW + timedelta(seconds=50)) == 0
    assert world.slot(0)["since"] == "2026-12-06T12:00:50.000Z"
    assert slots.take(B, NOW + timedelta(seconds=100)) is None
    # Its instance died before the job's first life: the slot is free after the window.
    assert slots.take(B, NOW + timedelta(seconds=111)) == 0
    # A job that yielded to a `--now` job waits queued: it too holds a slot only while it is about to start.
    world.status[B] = "queued"
    assert slots.running(NOW + timedelta(seconds=170)) == [B]
    assert slots.running(NOW + timedelta(seconds=172)) == []


@pytest.mark.parametrize(
    "body",
    [b"\xff not json", b"[]", b'{"job_id": ""}', b'{"job_id": 7}', b'{"since": "2026-12-06T12:00:00Z"}'],
)
def test_a_slot_that_is_not_a_slot_is_free_and_replaced_against_its_etag(world: World, body: bytes) -> None:
    world.put(0, body)
    slots = world.slots(1)
    assert slots.running(NOW) == [] and slots.room_for(A, NOW)
    assert slots.take(A, NOW) == 0 and world.slot(0)["job_id"] == A


def test_a_slot_without_a_readable_time_is_not_held_by_a_job_that_never_started(world: World) -> None:
    world.put(0, json.dumps({"job_id": A, "since": "yesterday"}).encode())
    world.put(1, json.dumps({"job_id": B, "since": "2026-12-06T12:00:00"}).encode())  # no zone
    slots = world.slots(2)
    assert slots.running(NOW) == []
    world.status[A] = "running"
    assert slots.running(NOW) == [A], "a job that runs holds it, whatever its time says"


def test_a_job_named_by_two_slots_holds_the_first_only(world: World) -> None:
    for index in (0, 1):
        world.put(index, json.dumps({"job_id": A, "since": "2026-12-06T12:00:00.000Z"}).encode())
    world.status[A] = "running"
    slots = world.slots(2)
    assert slots.running(NOW) == [A]
    assert slots.take(A, NOW) == 0
    assert slots.take(B, NOW) == 1, "the second naming of A is free"
    world.status[B] = "running"
    assert slots.take(C, NOW) is None


def test_looking_writes_nothing(world: World) -> None:
    slots = world.slots(3)
    assert slots.room_for(A, NOW) and slots.running(NOW) == []
    assert world.s3.list_objects_v2(Bucket=BUCKET).get("KeyCount") == 0


def test_racing_instances_never_start_more_than_the_limit(world: World) -> None:
    jobs = [f"job{i}-{i:08d}" for i in range(8)]
    taken: dict[str, int | None] = {}
    start = threading.Barrier(len(jobs), timeout=30)  # an instance that dies first breaks it

    def take(job_id: str) -> None:
        client = boto3.client("s3", region_name="us-east-1")  # one client per instance
        start.wait()
        taken[job_id] = Slots(client, BUCKET, "state/", 3, world.status.get).take(job_id, NOW)

    threads = [threading.Thread(target=take, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    join_all(threads, 60, "the eight racing instances")
    winners = sorted(index for index in taken.values() if index is not None)
    assert len(taken) == 8
    assert winners == [0, 1, 2], taken
    held = {world.slot(index)["job_id"] for index in range(3)}
    assert held == {job for job, index in taken.items() if index is not None}


def test_a_slots_time_is_utc_whatever_the_machines_zone(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    monkeypatch.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    try:
        assert world.slots(1).take(A, NOW) == 0
    finally:
        monkeypatch.undo()
        time.tzset()
    assert world.slot(0)["since"] == "2026-12-06T12:00:00.000Z"


def test_the_staleness_window_ends_exactly_at_its_length(world: World) -> None:
    slots = world.slots(1, stale=60)
    assert slots.take(A, NOW) == 0
    assert not slots.room_for(B, NOW + timedelta(seconds=59.9))
    assert slots.room_for(B, NOW + timedelta(seconds=60)), "a start that never came frees the slot"
    assert slots.running(NOW + timedelta(seconds=60)) == []


def test_a_running_jobs_take_writes_nothing(world: World) -> None:
    slots = world.slots(1)
    assert slots.take(A, NOW) == 0
    world.status[A] = "running"
    etag = world.s3.head_object(Bucket=BUCKET, Key=slot_key("state/", 0))["ETag"]
    assert slots.take(A, NOW + timedelta(hours=3)) == 0
    assert world.s3.head_object(Bucket=BUCKET, Key=slot_key("state/", 0))["ETag"] == etag
    assert world.slot(0)["since"] == "2026-12-06T12:00:00.000Z"


class Overtaken:
    """The moto client, with another instance's slot written just before this one's first write to each
    key in `keys` (so moto answers that write 412), and its reads counted."""

    def __init__(self, client: Any, keys: dict[str, dict[str, Any]]) -> None:
        self._client = client
        self._keys = dict(keys)
        self.gets = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def get_object(self, **kwargs: Any) -> Any:
        self.gets += 1
        return self._client.get_object(**kwargs)

    def put_object(self, **kwargs: Any) -> Any:
        other = self._keys.pop(kwargs["Key"], None)
        if other is not None:
            self._client.put_object(
                Bucket=kwargs["Bucket"], Key=kwargs["Key"], Body=json.dumps(other).encode()
            )
        return self._client.put_object(**kwargs)


def test_a_slot_lost_to_a_job_that_ended_since_is_taken_on_the_next_look(world: World) -> None:
    racing = Overtaken(world.s3, {slot_key("state/", 0): {"job_id": C, "since": "2026-12-06T12:00:00.000Z"}})
    world.status[C] = "completed"  # it ended a moment after it took the slot
    assert Slots(racing, BUCKET, "state/", 1, world.status.get).take(A, NOW) == 0
    assert world.slot(0)["job_id"] == A


def test_a_renewal_lost_to_another_job_takes_another_free_slot(world: World) -> None:
    slots = world.slots(2, stale=60)
    assert slots.take(A, NOW) == 0
    # A never started; as its instance asks again, another instance takes its stale slot first.
    racing = Overtaken(world.s3, {slot_key("state/", 0): {"job_id": B, "since": "2026-12-06T12:02:00.000Z"}})
    later = NOW + timedelta(seconds=120)
    assert Slots(racing, BUCKET, "state/", 2, world.status.get, 60).take(A, later) == 1
    assert (world.slot(0)["job_id"], world.slot(1)["job_id"]) == (B, A)


def test_a_full_stack_is_one_read_of_each_slot(world: World) -> None:
    for index, job in enumerate((A, B, C)):
        world.put(index, json.dumps({"job_id": job, "since": "2026-12-06T12:00:00.000Z"}).encode())
        world.status[job] = "running"
    counted = Overtaken(world.s3, {})
    assert Slots(counted, BUCKET, "state/", 3, world.status.get).take(D, NOW) is None
    assert counted.gets == 3, "no slot free: the limit is reached, said after one look"
