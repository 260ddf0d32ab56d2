"""The queue's reading of its own objects (trainstack_job/queue.py): a queue object that is not an entry is
one bounded line naming its key and the fix, and never stops the reading of the others."""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import boto3
import pytest

from trainstack_job.jobs import JobIdError, check_job_id
from trainstack_job.queue import (
    MAX_ENTRY_BYTES,
    SOURCE_PULUMI,
    SOURCE_RUN,
    QueueEntry,
    QueueError,
    QueueScan,
    cancel_key,
    job_record,
    list_entries,
    parse_entry,
    queue_entry,
    queue_key,
    scan_queue,
    stored_at,
)
from trainstack_job.text import clip

KEY = "queue/a-12345678.json"
BUCKET = "trainstack-queue-test"
# A message that echoes user data stays readable: the key, the reason, a clipped value and the fix.
BOUNDED = 400
MEGABYTE_ID = "a" * 1_000_000


def _entry(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def _refusal(key: str, body: bytes) -> str:
    """parse_entry's refusal, checked for what every refusal holds: one line, the key first, the fix."""
    with pytest.raises(QueueError) as caught:
        parse_entry(key, body)
    message = str(caught.value)
    assert "\n" not in message, message
    assert message.startswith(f"{key} is not a queue entry"), message
    assert "delete it" in message and "`trainstack run`" in message, message
    return message


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"{}", "no 'job_id'"),
        (b"[]", "a list, not an object"),
        (b'[{"job_id": "a-12345678", "submitted_at": "t"}]', "a list, not an object"),
        (b'"a-12345678"', "a string ('a-12345678'), not an object"),
        (b"42", "a number (42), not an object"),
        (b"null", "null, not an object"),
        (_entry(submitted_at="t"), "no 'job_id'"),
        (_entry(job_id="a-12345678"), "no 'submitted_at'"),
        (_entry(job_id=12345678, submitted_at="t"), "'job_id' is a number (12345678), not a string"),
        (_entry(job_id=None, submitted_at="t"), "'job_id' is null, not a string"),
        (_entry(job_id=["a-12345678"], submitted_at="t"), "'job_id' is a list, not a string"),
        (_entry(job_id="a-12345678", submitted_at=1.5), "'submitted_at' is a number (1.5), not a string"),
        (
            _entry(job_id="a-12345678", submitted_at="t", now="yes"),
            "'now' is a string ('yes'), not a boolean",
        ),
        (_entry(job_id="a-12345678", submitted_at="t", now=1), "'now' is a number (1), not a boolean"),
        (_entry(job_id="A B", submitted_at="t"), "'job_id' is 'A B', not a job id"),
        (_entry(job_id="b-12345678", submitted_at="t"), "it names job b-12345678, whose entry's key is"),
        (b"{not json", "not JSON (Expecting property name"),
        (b'{"job_id": "a-12345678", "submitted_at": "t\xff"}', "not UTF-8 (byte 43: invalid start byte)"),
        # json.loads(bytes) reads UTF-16 too; no submitter writes it, and the agent must not guess.
        (_entry(job_id="a-12345678", submitted_at="t").decode().encode("utf-16"), "not UTF-8 (byte 0"),
        (b"[" * 5000, "JSON nested too deep to read"),
        (b"[" * 200_000, f"more than the {MAX_ENTRY_BYTES} bytes a queue entry may hold"),
        # Valid JSON, but no entry is this big: the bound holds whatever the body says.
        (b" " * MAX_ENTRY_BYTES + _entry(job_id="a-12345678", submitted_at="t"), "more than the 65536 bytes"),
    ],
)
def test_a_body_that_is_not_an_entry_is_a_queue_error_naming_the_key_why_and_the_fix(
    body: bytes, why: str
) -> None:
    message = _refusal(KEY, body)
    assert f": {why}" in message, message
    assert len(message) < BOUNDED, message


def test_a_long_value_is_echoed_clipped_with_its_length() -> None:
    long_id = "a" * 60_000  # under the entry's bound: the id itself is refused, and clipped
    message = _refusal(KEY, _entry(job_id=long_id, submitted_at="t"))
    assert "'job_id' is 'aaaa" in message and "… (60000 characters), not a job id" in message, message
    assert len(message) < BOUNDED, len(message)

    message = _refusal(KEY, _entry(job_id="a-12345678", submitted_at="t", now="y" * 60_000))
    assert "'now' is a string ('yyy" in message and "(60000 characters)" in message, message
    assert len(message) < BOUNDED, len(message)


def test_a_megabyte_job_id_is_refused_in_a_bounded_message_naming_the_key() -> None:
    message = _refusal(KEY, _entry(job_id=MEGABYTE_ID, submitted_at="t"))
    assert len(message) < BOUNDED, len(message)

    with pytest.raises(JobIdError) as caught:
        check_job_id(MEGABYTE_ID)
    assert len(str(caught.value)) < BOUNDED and "(1000000 characters)" in str(caught.value)
    # Callers name where the id came from with the id itself (`--job VALUE`): that label is clipped too.
    with pytest.raises(JobIdError) as caught:
        check_job_id(MEGABYTE_ID, f"--job {MEGABYTE_ID}")
    assert len(str(caught.value)) < BOUNDED, len(str(caught.value))
    assert str(caught.value).startswith("'--job aaa")


def test_a_key_with_a_newline_stays_one_line() -> None:
    with pytest.raises(QueueError) as caught:
        parse_entry("queue/a\nb.json", b"{}")
    assert "\n" not in str(caught.value) and str(caught.value).startswith("'queue/a\\nb.json' is not")


def test_clip_keeps_a_short_repr_and_cuts_a_long_one_saying_how_long_it_was() -> None:
    assert clip("default-1a2b3c4d") == "'default-1a2b3c4d'"
    assert clip(42) == "42"
    assert clip("x" * 1_000_000) == "'" + "x" * 79 + "… (1000000 characters)"
    assert clip(b"\x00" * 100, limit=10) == "b'\\x00\\x00… (100 bytes)"
    assert clip(list(range(100)), limit=5) == "[0, 1… (390 characters as text)"
    assert len(clip("x" * 1_000_000, limit=8)) == len("'xxxxxxx… (1000000 characters)")


class CountingS3:
    """The moto client, remembering which objects were downloaded."""

    def __init__(self, s3: Any) -> None:
        self._s3 = s3
        self.downloaded: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._s3, name)

    def get_object(self, **request: Any) -> Any:
        self.downloaded.append(str(request["Key"]))
        return self._s3.get_object(**request)


def test_scan_queue_returns_the_entries_in_order_and_each_bad_object_with_its_error(aws: Any) -> None:
    s3 = boto3.client("s3", region_name="us-east-1")
    s3.create_bucket(Bucket=BUCKET)
    objects = {
        "queue/early-11111111.json": json.dumps(queue_entry("early-11111111", "2026-12-01T12:00:01+00:00")),
        "queue/urgent-22222222.json": json.dumps(
            queue_entry("urgent-22222222", "2026-12-01T12:00:02+00:00", now=True)
        ),
        "queue/garbage.json": "{not json",
        "queue/empty-33333333.json": "{}",
        "queue/huge-44444444.json": " " * (2 * MAX_ENTRY_BYTES),
        "queue/notes.txt": "not a .json object: never read",
    }
    for key, body in objects.items():
        s3.put_object(Bucket=BUCKET, Key=key, Body=body.encode())
    counting = CountingS3(s3)

    scan = scan_queue(counting, BUCKET)

    assert [(e.job_id, e.submitted_at, e.now) for e in scan.entries] == [
        ("urgent-22222222", "2026-12-01T12:00:02+00:00", True),
        ("early-11111111", "2026-12-01T12:00:01+00:00", False),
    ]
    assert all(isinstance(e, QueueEntry) and e.queued_at for e in scan.entries)
    assert [key for key, _ in scan.bad] == [
        "queue/empty-33333333.json",
        "queue/garbage.json",
        "queue/huge-44444444.json",
    ]
    for key, error in scan.bad:
        assert isinstance(error, QueueError) and str(error).startswith(f"{key} is not a queue entry")
    assert f"{2 * MAX_ENTRY_BYTES} bytes, more than the {MAX_ENTRY_BYTES} bytes" in str(scan.bad[2][1])
    # The listing's size refuses an oversized object before anyone downloads it.
    assert "queue/huge-44444444.json" not in counting.downloaded
    assert "queue/notes.txt" not in counting.downloaded

    # The old reader keeps its contract for its callers: the first bad object (by key) is its error.
    with pytest.raises(QueueError, match=r"^queue/empty-33333333\.json is not a queue entry"):
        list_entries(s3, BUCKET)
    for key in [key for key, _ in scan.bad]:
        s3.delete_object(Bucket=BUCKET, Key=key)
    assert [e.job_id for e in list_entries(s3, BUCKET)] == ["urgent-22222222", "early-11111111"]


def test_priority_orders_the_queue_within_now_and_a_boolean_one_is_refused() -> None:
    def entry(job_id: str, at: str, **fields: object) -> QueueEntry:
        body = json.dumps(queue_entry(job_id, at) | fields).encode()
        return parse_entry(queue_key(job_id), body, queued_at=at)

    entries = [
        entry("low-aaaaaaaa", "2026-12-06T11:00:00Z"),
        entry("high-bbbbbbbb", "2026-12-06T11:00:02Z", priority=3),
        entry("urgent-cccccccc", "2026-12-06T11:00:03Z", now=True),
        entry("high-dddddddd", "2026-12-06T11:00:01Z", priority=3),
    ]
    ordered = [e.job_id for e in sorted(entries, key=lambda e: e.order)]
    assert ordered == ["urgent-cccccccc", "high-dddddddd", "high-bbbbbbbb", "low-aaaaaaaa"]
    with pytest.raises(QueueError, match="'priority' is a boolean"):
        entry("odd-eeeeeeee", "2026-12-06T11:00:04Z", priority=True)


# -- every field of an entry and a record, as the agent and the CLI read them ---------------------------


def test_an_entry_reads_every_field_and_an_absent_optional_one_as_its_default() -> None:
    full = _entry(job_id="a-12345678", submitted_at="t1", now=True, pool="big", priority=3)
    assert parse_entry(KEY, full, "2026-12-06T10:00:00+00:00") == QueueEntry(
        "a-12345678", "t1", True, "2026-12-06T10:00:00+00:00", "big", 3
    )
    assert parse_entry(KEY, _entry(job_id="a-12345678", submitted_at="t1")) == QueueEntry(
        "a-12345678", "t1", False, "", "", 0
    )


def test_a_bad_optional_field_after_an_absent_one_is_still_refused() -> None:
    # `now` left out (allowed) must not stop the checks of the fields after it.
    why = _refusal(KEY, _entry(job_id="a-12345678", submitted_at="t", pool=5))
    assert "'pool' is a number (5), not a string" in why
    why = _refusal(KEY, _entry(job_id={"x": 1}, submitted_at="t"))
    assert "'job_id' is an object, not a string" in why
    assert why.endswith(
        "delete it (`trainstack cancel` never needs it) and submit the job again with `trainstack run`"
    )


def test_an_entry_of_exactly_the_limit_is_read_and_one_byte_more_is_refused() -> None:
    body = _entry(job_id="a-12345678", submitted_at="t")
    exact = body[:-1] + b" " * (MAX_ENTRY_BYTES - len(body)) + b"}"
    assert len(exact) == MAX_ENTRY_BYTES and parse_entry(KEY, exact).job_id == "a-12345678"
    assert "more than the" in _refusal(KEY, exact[:-1] + b" }")


def test_the_entry_and_the_cancel_request_are_where_the_agent_looks() -> None:
    assert queue_entry("a-12345678", "t") == {"job_id": "a-12345678", "submitted_at": "t", "now": False}
    assert queue_entry("a-12345678", "t", now=True, pool="big", priority=-2) == {
        "job_id": "a-12345678",
        "submitted_at": "t",
        "now": True,
        "pool": "big",
        "priority": -2,
    }
    assert cancel_key("a-12345678") == "jobs/a-12345678/state/cancel.json"
    assert cancel_key("legacy") == "state/cancel.json"
    with pytest.raises(JobIdError):
        queue_entry("Not_An_Id", "t")


def test_a_record_says_what_the_job_is_and_copies_what_it_was_given() -> None:
    agent = {
        "job_id": "a-12345678",
        "bundle_key": "job-code/ab/bundle.tar.gz",
        "bundle_sha256": "ab",
        "resume_from": "b-1",
    }
    sweep, dataset, resources = {"point": 1}, {"name": "d"}, {"gpus": "L4:1"}
    record = job_record(
        job_id="a-12345678",
        name="resnet",
        agent=agent,
        submitted_at="t",
        source=SOURCE_RUN,
        sweep=sweep,
        dataset=dataset,
        pool="big",
        resources=resources,
    )
    assert record == {
        "job_id": "a-12345678",
        "name": "resnet",
        "created_at": "t",
        "submitted_at": "t",
        "source": "run",
        "bundle_key": "job-code/ab/bundle.tar.gz",
        "bundle_sha256": "ab",
        "resume_from": "b-1",
        "sweep": {"point": 1},
        "dataset": {"name": "d"},
        "pool": "big",
        "resources": {"gpus": "L4:1"},
        "agent": agent,
    }
    # Copies: the caller's dicts changed afterwards do not change the record it wrote.
    sweep["point"], agent["bundle_key"] = 2, "other"
    assert record["sweep"] == {"point": 1} and record["agent"]["bundle_key"] == "job-code/ab/bundle.tar.gz"
    bare = job_record(job_id="a-12345678", name="x", agent={}, submitted_at="t", source=SOURCE_PULUMI)
    assert (bare["bundle_key"], bare["bundle_sha256"], bare["resume_from"]) == ("", "", None)
    assert (bare["sweep"], bare["dataset"], bare["pool"], bare["resources"]) == (None, None, "", None)
    with pytest.raises(JobIdError):
        job_record(job_id="../x", name="x", agent={}, submitted_at="t", source=SOURCE_RUN)


def test_when_s3_stored_an_entry_is_utc_text_whatever_the_listing_says() -> None:
    moment = datetime(2026, 12, 6, 10, 0, 5)
    assert stored_at({"LastModified": moment}) == "2026-12-06T10:00:05+00:00"
    east = timezone(timedelta(hours=2))
    assert stored_at({"LastModified": moment.replace(tzinfo=east)}) == "2026-12-06T08:00:05+00:00"
    assert stored_at({}) == "" and stored_at({"LastModified": "2026-12-06"}) == ""


def test_the_stored_time_does_not_depend_on_the_readers_time_zone(monkeypatch: pytest.MonkeyPatch) -> None:
    # A laptop in Tokyo lists the same queue order as the agent in UTC: a naive time is S3's UTC.
    monkeypatch.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    try:
        assert stored_at({"LastModified": datetime(2026, 12, 6, 10, 0, 5)}) == "2026-12-06T10:00:05+00:00"
        utc = datetime(2026, 12, 6, 10, 0, 5, tzinfo=timezone.utc)
        assert stored_at({"LastModified": utc}) == "2026-12-06T10:00:05+00:00"
    finally:
        monkeypatch.undo()
        time.tzset()


def test_scan_reads_only_the_queue_of_an_empty_or_busy_bucket(aws: Any) -> None:
    s3 = boto3.client("s3", region_name="us-east-1")
    s3.create_bucket(Bucket=BUCKET)
    assert scan_queue(s3, BUCKET) == QueueScan([], [])
    # Not queue objects: a job's record and a stray JSON file outside queue/.
    s3.put_object(Bucket=BUCKET, Key="jobs/a-12345678/job.json", Body=b"not an entry")
    s3.put_object(Bucket=BUCKET, Key="queue-old.json", Body=b"[]")
    body = _entry(job_id="a-12345678", submitted_at="t")
    exact = body[:-1] + b" " * (MAX_ENTRY_BYTES - len(body)) + b"}"
    s3.put_object(Bucket=BUCKET, Key=KEY, Body=exact)
    scan = scan_queue(s3, BUCKET)
    assert [entry.job_id for entry in scan.entries] == ["a-12345678"] and scan.bad == []
