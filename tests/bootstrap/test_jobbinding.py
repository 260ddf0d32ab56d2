"""Which job a life serves: the stack's pointer, a second definition after the first ended, a running job
kept on its own code, the legacy layout, and two lives racing to define the stack's job."""

from __future__ import annotations

import hashlib
import io
import json
import sys
import tarfile
import threading
import time
from collections import Counter
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError

from bootstrap.agent_config import AgentConfig, Prefixes
from bootstrap.eventlog import EventLog, iso
from bootstrap.jobbinding import (
    MAX_OBJECT_BYTES,
    JobBinding,
    JobBindingError,
    JobDirectory,
    Staffing,
    bind_job,
    claim_scratch,
    record_fields,
    same_code,
    work_in_lanes,
)
from bootstrap.pinned import PinnedCodeError, pinned_config, reexec_argv, unpack_bundle
from demo.stack import LocalStack
from tests.waiting import join_all
from trainstack_job.jobs import JobPrefixes
from trainstack_job.queue import SOURCE_RUN, job_record, list_entries, queue_entry, queue_key
from trainstack_job.text import clip

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)


@pytest.fixture()
def stack(aws: Any) -> LocalStack:
    """The stack's names with its bucket alone: job binding touches nothing else, and a whole stack (key,
    topic, queue, VPC, group) made every test a second slower, its mutants (bench/mutate.py) with it."""
    region, name = "us-east-1", "trainstack-binding"
    boto3.client("s3", region_name=region).create_bucket(Bucket=f"{name}-data")
    arn = f"arn:aws:sns:{region}:123456789012:{name}-alerts"
    return LocalStack(name, region, f"{name}-data", "", arn, f"{name}-gpu", f"/trainstack/{name}", "")


def _config(stack: LocalStack, job_id: str, **more: Any) -> AgentConfig:
    """An agent config defining `job_id`, rendered with that job's own code bundle."""
    return stack.agent_config(
        job_id=job_id,
        job_name=job_id.rsplit("-", 1)[0],
        bundle_key=f"code/{job_id}/bundle.tar.gz",
        bundle_sha256=hashlib.sha256(job_id.encode()).hexdigest(),
        job={"train": {"epochs": 1}, "model": job_id},
        **more,
    )


def _bind(s3: Any, config: AgentConfig) -> JobBinding:
    """The binding of a life whose config defines a job (so there always is one)."""
    binding = bind_job(s3, config, NOW)
    assert binding is not None
    return binding


def _put(stack: LocalStack, key: str, value: dict[str, Any]) -> None:
    stack.client("s3").put_object(Bucket=stack.bucket, Key=key, Body=json.dumps(value).encode())


def _get(stack: LocalStack, key: str) -> dict[str, Any]:
    body = stack.client("s3").get_object(Bucket=stack.bucket, Key=key)["Body"].read()
    value: dict[str, Any] = json.loads(body)
    return value


def test_first_job_becomes_current_and_records_its_definition(stack: LocalStack) -> None:
    s3 = stack.client("s3")
    binding = _bind(s3, _config(stack, "resnet-11111111"))
    assert (binding.job_id, binding.pinned) == ("resnet-11111111", None)
    assert binding.prefixes.checkpoints == "jobs/resnet-11111111/checkpoints/"
    assert _get(stack, "state/current-job.json")["job_id"] == "resnet-11111111"
    record = _get(stack, "jobs/resnet-11111111/job.json")
    assert record["bundle_key"] == "code/resnet-11111111/bundle.tar.gz"
    assert record["agent"]["job"]["model"] == "resnet-11111111"
    # The same definition again (a replacement, a resume): the same job.
    assert _bind(s3, _config(stack, "resnet-11111111")).job_id == "resnet-11111111"


def test_a_new_definition_waits_for_the_running_job_and_takes_over_once_it_ended(stack: LocalStack) -> None:
    s3 = stack.client("s3")
    _bind(s3, _config(stack, "resnet-11111111"))
    _put(stack, "jobs/resnet-11111111/state/ledger.json", {"status": "running", "lives": []})
    # A replacement launched after a `pulumi up` that defined another job: the running job goes on, with
    # the code and definition it started with.
    binding = _bind(s3, _config(stack, "vit-22222222"))
    assert binding.job_id == "resnet-11111111"
    assert binding.pinned is not None and binding.pinned["bundle_key"] == "code/resnet-11111111/bundle.tar.gz"
    merged = pinned_config(_config(stack, "vit-22222222"), binding.pinned)
    assert (merged["job_id"], merged["job"]["model"]) == ("resnet-11111111", "resnet-11111111")
    assert merged["bucket"] == stack.bucket
    # The job's code may predate keys this agent knows: those at their defaults are left out, so an older
    # agent's config loader (which refuses unknown keys) reads what it wrote, and the defaults stay its own.
    assert "dataset_version" not in merged and "allow_data_change" not in merged
    assert AgentConfig.from_mapping(merged).job_id == "resnet-11111111"
    assert _get(stack, "state/current-job.json")["job_id"] == "resnet-11111111"
    # Once it completed, the next definition is the stack's job: under its own prefix, from step 0.
    _put(stack, "jobs/resnet-11111111/state/ledger.json", {"status": "completed", "lives": []})
    binding = _bind(s3, _config(stack, "vit-22222222"))
    assert (binding.job_id, binding.pinned, binding.switched_from) == (
        "vit-22222222",
        None,
        "resnet-11111111",
    )
    assert binding.prefixes.results == "jobs/vit-22222222/results/"
    assert _get(stack, "state/current-job.json") | {"since": None} == {
        "job_id": "vit-22222222",
        "since": None,
        "previous": "resnet-11111111",
    }


def test_a_stopped_job_is_resumed_by_a_new_boot_once_its_stop_request_is_withdrawn(stack: LocalStack) -> None:
    """`trainstack stop` then `trainstack run`: the next queued job runs; `trainstack resume` (the stop
    request deleted): the stopped job goes on. A life that just ended it on this instance moves on."""
    s3 = stack.client("s3")
    _bind(s3, _config(stack, "resnet-11111111"))
    _put(stack, "jobs/resnet-11111111/state/ledger.json", {"status": "stopped", "lives": []})
    _put(stack, "jobs/resnet-11111111/state/control.json", {"action": "stop"})
    defines_none = stack.agent_config(job_id="")
    assert bind_job(s3, defines_none, NOW) is None, "a stopped job, nothing else queued: no job"
    s3.delete_object(Bucket=stack.bucket, Key="jobs/resnet-11111111/state/control.json")
    resumed = bind_job(s3, defines_none, NOW)
    assert resumed is not None and (resumed.job_id, resumed.switched_from) == ("resnet-11111111", None)
    assert resumed.config is not None and resumed.config.job["model"] == "resnet-11111111"
    assert bind_job(s3, defines_none, NOW, after="resnet-11111111") is None


def test_a_running_stack_from_before_jobs_keeps_its_objects_as_the_legacy_job(stack: LocalStack) -> None:
    s3 = stack.client("s3")
    _put(stack, "state/ledger.json", {"status": "running", "lives": []})
    binding = _bind(s3, _config(stack, "resnet-11111111"))
    assert binding.job_id == "legacy"
    assert (binding.prefixes.checkpoints, binding.prefixes.results, binding.prefixes.state) == (
        "checkpoints/",
        "results/",
        "state/",
    )
    # Once the legacy job ended, the defined job takes the stack.
    _put(stack, "state/ledger.json", {"status": "completed", "lives": []})
    assert _bind(s3, _config(stack, "resnet-11111111")).job_id == "resnet-11111111"


def test_two_definitions_booting_at_once_agree_on_one_job(stack: LocalStack) -> None:
    results: dict[str, str] = {}
    barrier = threading.Barrier(2, timeout=30)  # a boot that dies first breaks it: the other raises

    def boot(job_id: str) -> None:
        s3 = stack.client("s3")
        barrier.wait()
        results[job_id] = _bind(s3, _config(stack, job_id)).job_id

    threads = [threading.Thread(target=boot, args=(j,)) for j in ("resnet-11111111", "vit-22222222")]
    for thread in threads:
        thread.start()
    join_all(threads, 60, "the two boots")
    winner = _get(stack, "state/current-job.json")["job_id"]
    assert set(results.values()) == {winner}


def test_two_nodes_of_a_config_from_before_jobs_booting_together_both_serve_it(stack: LocalStack) -> None:
    """The first node points the stack at the legacy job; the second binds before the first has begun its
    life (no ledger yet) and must serve the same job, never read it as "no job" and scale the group to 0."""
    s3 = stack.client("s3")
    legacy = stack.agent_config(instance_count=2)
    assert legacy.job_id == "legacy"
    first = bind_job(s3, legacy, NOW)
    assert first is not None and first.job_id == "legacy"
    second = bind_job(s3, legacy, NOW)
    assert second is not None and second.job_id == "legacy"
    # A config that defines a job of its own does not continue a legacy pointer with nothing behind it.
    mine = bind_job(s3, _config(stack, "resnet-11111111"), NOW)
    assert mine is not None and mine.job_id == "resnet-11111111"


@pytest.mark.parametrize(
    "body",
    [
        b"[]",
        b"{}",
        b'{"job_id": 7}',
        b'{"job_id": "../x"}',
        b"\xff\xfe",
        b"[" * 200_000,
        b" " * (1024 * 1024 + 1),
    ],
    ids=["list", "empty", "number", "bad-id", "not-utf8", "nested", "huge"],
)
def test_a_damaged_pointer_is_named_once_and_replaced_by_the_queues_head(
    stack: LocalStack, body: bytes
) -> None:
    """One damaged object must not stop the stack: the pointer is replaced (conditionally, against the
    damaged object's ETag) by the oldest queued job, and the damage is one line for the whole life."""
    s3 = stack.client("s3")
    s3.put_object(Bucket=stack.bucket, Key="state/current-job.json", Body=body)
    events = io.StringIO()
    log = EventLog(stream=events)
    reported: set[str] = set()
    config = _config(stack, "resnet-11111111")
    for _ in range(3):
        binding = bind_job(s3, config, NOW, log=log, reported=reported)
        assert binding is not None and binding.job_id == "resnet-11111111"
    assert _get(stack, "state/current-job.json")["job_id"] == "resnet-11111111"
    lines = [json.loads(line) for line in events.getvalue().splitlines()]
    damaged = [
        line
        for line in lines
        if "is not a job pointer" in line["message"] or "bytes: not read" in line["message"]
    ]
    assert len(damaged) == 1 and len(damaged[0]["message"]) < 300, damaged
    assert "current-job.json" in damaged[0]["message"]


def _bundle(files: dict[str, str]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_pinned_code_is_checked_before_it_is_unpacked(stack: LocalStack, tmp_path: Path) -> None:
    s3 = stack.client("s3")
    data = _bundle({"bootstrap/agent.py": "print('old code')\n"})
    sha = hashlib.sha256(data).hexdigest()
    s3.put_object(Bucket=stack.bucket, Key="code/x/bundle.tar.gz", Body=data)
    record = {"job_id": "resnet-11111111", "bundle_key": "code/x/bundle.tar.gz", "bundle_sha256": sha}
    code = unpack_bundle(s3, stack.bucket, record, tmp_path / "code")
    assert (code / "bootstrap" / "agent.py").read_text() == "print('old code')\n"
    assert code == tmp_path / "code" / sha
    # The object replaced after the job started: refused, naming the object.
    with pytest.raises(PinnedCodeError, match=r"code/x/bundle.tar.gz: sha256 .* is not job resnet-11111111"):
        unpack_bundle(s3, stack.bucket, record | {"bundle_sha256": "f" * 64}, tmp_path / "other")
    # Missing, not a gzipped tar, without the agent, a sha256 that is not one: each refused in one line.
    record = {"job_id": "resnet-11111111", "bundle_key": "code/gone/bundle.tar.gz", "bundle_sha256": "e" * 64}
    with pytest.raises(
        PinnedCodeError,
        match=r"code/gone/bundle.tar.gz: job resnet-11111111's code bundle is missing; submit",
    ):
        unpack_bundle(s3, stack.bucket, record, tmp_path / "gone")
    for name, body, why in [
        ("corrupt", b"not a tar at all", "cannot be unpacked"),
        ("empty", _bundle({"README": "hi"}), "holds no bootstrap/agent.py"),
    ]:
        s3.put_object(Bucket=stack.bucket, Key=f"code/{name}/bundle.tar.gz", Body=body)
        bad = {
            **record,
            "bundle_key": f"code/{name}/bundle.tar.gz",
            "bundle_sha256": hashlib.sha256(body).hexdigest(),
        }
        with pytest.raises(PinnedCodeError, match=why):
            unpack_bundle(s3, stack.bucket, bad, tmp_path / name)
        assert not list((tmp_path / name).glob("*")), "nothing half-unpacked is left"
    with pytest.raises(PinnedCodeError, match="bundle_sha256 is not a sha256"):
        unpack_bundle(s3, stack.bucket, {**record, "bundle_sha256": "../../etc"}, tmp_path / "x")
    argv = reexec_argv(["-m", "bootstrap.agent", "--config", "/etc/trainstack/agent.yaml"], code / "a.yaml")
    assert argv == [sys.executable, "-m", "bootstrap.agent", "--config", str(code / "a.yaml")]


def test_the_queue_is_fifo_by_s3s_clock_not_the_submitters(stack: LocalStack) -> None:
    """A laptop whose clock runs an hour ahead submits first: its job still runs first. Entries S3 stored in
    the same second keep the order of their `submitted_at` (a sweep writes its grid in order)."""
    ahead = "2026-12-01T13:00:00+00:00"  # the skewed submitter: an hour ahead of the one after it
    _put(stack, "queue/early-skewed-a1.json", {"job_id": "early-skewed-a1", "submitted_at": ahead})
    time.sleep(1.1)  # the next entry lands in a later second of S3's clock (LastModified: 1 s resolution)
    _put(stack, "queue/later-b2.json", {"job_id": "later-b2", "submitted_at": "2026-12-01T12:00:00+00:00"})
    # The sweep's two entries in one second of S3's clock (moto's runs on this machine): written at the
    # start of a fresh second, whatever the write order, submitted_at decides.
    s3 = stack.client("s3")
    for _ in range(5):
        time.sleep(1.05 - time.time() % 1)
        for point in ("c4", "c3"):
            at = "2026-12-01T12:00:0" + point[-1] + "+00:00"
            _put(stack, f"queue/sweep-{point}.json", {"job_id": f"sweep-{point}", "submitted_at": at})
        keys = ("queue/sweep-c4.json", "queue/sweep-c3.json")
        stored = {s3.head_object(Bucket=stack.bucket, Key=key)["LastModified"] for key in keys}
        # Two puts can straddle a second on a loaded machine: then they are written again, in a fresh one.
        if len(stored) == 1:
            break
    else:
        raise AssertionError("five tries could not write the sweep's two entries in one second of S3's clock")

    agent_order = [e.job_id for e in JobDirectory(s3, _config(stack, "unused-x1")).entries()]
    cli_order = [e.job_id for e in list_entries(s3, stack.bucket)]

    assert agent_order == cli_order == ["early-skewed-a1", "later-b2", "sweep-c3", "sweep-c4"]


# -- the binding's promises, one at a time, against a bare bucket in moto (no stack: each test ~0.1 s) ----

FAST_BUCKET = "trainstack-binding-fast"
AT = "2026-12-01T11:00:00.000Z"


class Bucket:
    """A bare bucket in the moto server: the only AWS resource job binding touches."""

    def __init__(self) -> None:
        self.s3 = boto3.client("s3", region_name="us-east-1")
        self.s3.create_bucket(Bucket=FAST_BUCKET)
        self.name = FAST_BUCKET
        self.stream = io.StringIO()
        self.log = EventLog(stream=self.stream)

    def config(self, **more: Any) -> AgentConfig:
        values: dict[str, Any] = {
            "region": "us-east-1",
            "bucket": FAST_BUCKET,
            "group_name": "g",
            "topic_arn": "arn:aws:sns:us-east-1:123456789012:t",
            "log_group": "/trainstack/t",
            "stack": "t",
            "prefixes": Prefixes(),
            "gpu_required": False,
            "job_id": "",
            **more,
        }
        return AgentConfig(**values)

    def directory(self, *, lane: int = 0, group_max: int | None = None, **more: Any) -> JobDirectory:
        return JobDirectory(self.s3, self.config(**more), self.log, group_max=group_max, lane=lane)

    def put(self, key: str, value: dict[str, Any] | bytes) -> None:
        body = value if isinstance(value, bytes) else json.dumps(value).encode()
        self.s3.put_object(Bucket=FAST_BUCKET, Key=key, Body=body)

    def get(self, key: str) -> Any:
        try:
            body = self.s3.get_object(Bucket=FAST_BUCKET, Key=key)["Body"].read()
        except ClientError:
            return None
        return json.loads(body)

    def content_type(self, key: str) -> str:
        return str(self.s3.head_object(Bucket=FAST_BUCKET, Key=key)["ContentType"])

    def submit(
        self,
        job_id: str,
        at: str = AT,
        *,
        pool: str = "",
        now: bool = False,
        priority: int = 0,
        sweep: dict[str, Any] | None = None,
        bundle_key: str = "",
        bundle_sha256: str = "",
        **agent: Any,
    ) -> None:
        """A `trainstack run`: the job's record, then its queue entry."""
        name = job_id.rsplit("-", 1)[0]
        fields: dict[str, Any] = {
            "job_id": job_id,
            "job_name": name,
            "job": {"fake": {}},
            "user_job": None,
        }
        fields |= {"bundle_key": bundle_key, "bundle_sha256": bundle_sha256, **agent}
        record = job_record(
            job_id=job_id,
            name=name,
            agent=fields,
            submitted_at=at,
            source=SOURCE_RUN,
            sweep=sweep,
        )
        self.put(f"jobs/{job_id}/job.json", record)
        self.put(queue_key(job_id), queue_entry(job_id, at, pool=pool, now=now, priority=priority))

    def ledger(self, job_id: str, status: str) -> None:
        self.put(
            f"{JobPrefixes.of(job_id).state}ledger.json", {"job_id": job_id, "status": status, "lives": []}
        )

    def status(self, job_id: str) -> Any:
        ledger = self.get(f"{JobPrefixes.of(job_id).state}ledger.json")
        return None if ledger is None else (ledger.get("status"), ledger.get("reason"))

    def pointer(self, name: str = "current-job.json") -> Any:
        return self.get(f"state/{name}")

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.stream.getvalue().splitlines()]

    def said(self, text: str) -> list[dict[str, Any]]:
        return [event for event in self.events() if text in event["message"]]


@pytest.fixture()
def bucket(aws: Any) -> Bucket:
    return Bucket()


class Racing:
    """The moto client, with every write to `keys` lost to another instance's conditional write."""

    def __init__(self, s3: Any, *keys: str) -> None:
        self._s3 = s3
        self.keys = set(keys)
        self.lost = 0

    def put_object(self, **call: Any) -> Any:
        if call["Key"] in self.keys:
            self.lost += 1
            raise ClientError({"Error": {"Code": "PreconditionFailed", "Message": "moved"}}, "PutObject")
        return self._s3.put_object(**call)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._s3, name)


A, B, C = "alpha-aaaaaaaa", "bravo-bbbbbbbb", "charlie-cccccccc"
LATER, LAST = "2026-12-01T11:00:01.000Z", "2026-12-01T11:00:02.000Z"


def test_a_defined_job_is_queued_once_and_the_pointer_names_it_with_when(bucket: Bucket) -> None:
    config = bucket.config(job_id=A, job_name="alpha", job={"model": "a"}, bundle_key="code/a.tgz")
    binding = bind_job(bucket.s3, config, NOW, log=bucket.log)
    assert binding is not None and (binding.job_id, binding.pinned, binding.switched_from) == (A, None, None)
    assert (binding.lane, binding.resuming, binding.job_code) == (0, False, None)
    assert binding.config is not None and binding.config.job == {"model": "a"}
    assert bucket.pointer() == {"job_id": A, "since": "2026-12-01T12:00:00.000Z", "previous": None}
    record = bucket.get(f"jobs/{A}/job.json")
    assert (record["name"], record["source"], record["submitted_at"]) == ("alpha", "pulumi", iso(NOW))
    assert record["agent"]["bundle_key"] == "code/a.tgz" and record["agent"]["job"] == {"model": "a"}
    assert bucket.events() == [], "no pointer yet is no damaged pointer"
    assert bucket.get(queue_key(A)) == {"job_id": A, "submitted_at": iso(NOW), "now": False}
    for key in (f"jobs/{A}/job.json", queue_key(A), "state/current-job.json"):
        assert bucket.content_type(key) == "application/json", key
    body = bucket.s3.get_object(Bucket=FAST_BUCKET, Key=f"jobs/{A}/job.json")["Body"].read().decode()
    assert body == json.dumps(json.loads(body), indent=2), "the job's record is indented JSON, for people"
    jobs = bucket.directory()
    assert jobs.submit(config, NOW) is False, "written once: the entry is there"
    # Unnamed, a job is named by its id; a pool's entry says its pool.
    assert bucket.directory(pool="big").submit(bucket.config(job_id=B), NOW) is True
    assert bucket.get(f"jobs/{B}/job.json")["name"] == B
    assert bucket.get(queue_key(B))["pool"] == "big"


def test_a_started_job_whose_entry_was_taken_away_is_never_queued_again(bucket: Bucket) -> None:
    jobs = bucket.directory()
    config = bucket.config(job_id=A)
    assert jobs.submit(config, NOW) is True
    bucket.s3.delete_object(Bucket=bucket.name, Key=queue_key(A))
    assert jobs.submit(config, NOW) is True, "never started: queued again"
    bucket.s3.delete_object(Bucket=bucket.name, Key=queue_key(A))
    bucket.ledger(A, "stopped")
    assert jobs.submit(config, NOW) is False
    assert bucket.get(queue_key(A)) is None


def test_a_pointer_naming_the_legacy_job_or_a_job_is_read_and_a_damaged_one_is_named_once(
    bucket: Bucket,
) -> None:
    jobs = bucket.directory()
    assert jobs.current() == (None, None)
    bucket.put("state/current-job.json", {"job_id": "legacy"})
    assert jobs.current()[0] == "legacy"
    bucket.put("state/current-job.json", {"job_id": A})
    job_id, etag = jobs.current()
    assert job_id == A and etag is not None
    for damaged in ({"job_id": "Not An Id"}, {"job": A}):
        bucket.put("state/current-job.json", damaged)
        job_id, etag = jobs.current()
        assert job_id is None and etag is not None
    [line] = bucket.said("not a job pointer")
    assert line["message"] == (
        f's3://{FAST_BUCKET}/state/current-job.json is not a job pointer ({{"job_id": ...}}): '
        "pointing it at the oldest queued job"
    )
    assert (line["stage"], line["level"]) == ("queue", "error")


def test_the_pointer_moves_only_from_the_version_read(bucket: Bucket) -> None:
    jobs = bucket.directory()
    assert jobs.point_at(A, None, None, NOW) is True
    assert jobs.point_at(B, None, None, NOW) is False, "created by another life meanwhile"
    _, etag = jobs.current()
    assert jobs.point_at(B, etag, A, NOW) is True
    assert jobs.point_at(C, etag, A, NOW) is False, "moved since"
    assert bucket.pointer() == {"job_id": B, "since": iso(NOW), "previous": A}
    # A pool's lane keeps a pointer of its own.
    lane = bucket.directory(lane=2, pool="big")
    assert lane.point_at(C, None, None, NOW) is True
    assert bucket.pointer("current-job-big-lane2.json")["job_id"] == C
    assert bucket.pointer()["job_id"] == B


def test_a_missing_bucket_is_raised_not_taken_for_a_stack_without_jobs(bucket: Bucket) -> None:
    config = bucket.config(job_id=A, bucket="no-such-bucket-here")
    with pytest.raises(ClientError, match="NoSuchBucket"):
        bind_job(bucket.s3, config, NOW)
    with pytest.raises(ClientError, match="NoSuchBucket"):
        JobDirectory(bucket.s3, config).submit(config, NOW)


def test_an_object_over_a_mebibyte_is_not_read_and_named_once_and_one_of_exactly_that_is(
    bucket: Bucket,
) -> None:
    bucket.submit(A)
    record = bucket.get(f"jobs/{A}/job.json")
    exact = json.dumps(record).encode()
    bucket.put(f"jobs/{A}/job.json", exact + b" " * (MAX_OBJECT_BYTES - len(exact)))
    jobs = bucket.directory()
    found = jobs.binding(A)
    assert found is not None and found.job_id == A
    bucket.put(f"jobs/{A}/job.json", exact + b" " * (MAX_OBJECT_BYTES + 1 - len(exact)))
    assert jobs.binding(A) is None
    assert jobs.binding(A) is None
    [line] = bucket.said("bytes: not read")
    assert line["message"] == (
        f"s3://{FAST_BUCKET}/jobs/{A}/job.json is over {MAX_OBJECT_BYTES} bytes: not read; delete it"
    )
    assert (line["key"], line["level"], line["stage"]) == (f"jobs/{A}/job.json", "error", "queue")
    assert bucket.status(A) == ("failed", f"s3://{FAST_BUCKET}/jobs/{A}/job.json is missing or not a job "
                                "record: submit the job again with `trainstack run`")  # fmt: skip


def test_an_ended_status_is_kept_for_the_life_and_a_resumable_one_read_again(bucket: Bucket) -> None:
    jobs = bucket.directory()
    assert jobs.status(A) is None
    bucket.put(f"jobs/{A}/state/ledger.json", b"not json")
    assert jobs.status(A) is None
    bucket.ledger(A, "completed")
    assert jobs.status(A) == "completed"
    bucket.ledger(A, "running")
    assert jobs.status(A) == "completed", "a final end never changes"
    for status in ("stopped", "cost_cap", "no_data"):
        bucket.ledger(B, status)
        assert jobs.status(B) == status
    bucket.ledger(B, "running")
    assert jobs.status(B) == "running", "a resumable end may be resumed"
    assert jobs.status("legacy") is None
    bucket.ledger("legacy", "failed")
    assert jobs.status("legacy") == "failed"


def test_cancel_and_stop_requests_and_the_queue_entry_are_read_as_written(bucket: Bucket) -> None:
    jobs = bucket.directory()
    assert not jobs.cancel_requested(A) and not jobs.stop_requested(A) and not jobs.queued(A)
    bucket.put(f"jobs/{A}/state/cancel.json", b"whatever it holds")
    assert jobs.cancel_requested(A)
    bucket.put(f"jobs/{A}/state/control.json", {"action": "pause"})
    assert not jobs.stop_requested(A)
    bucket.put(f"jobs/{A}/state/control.json", {"action": "stop"})
    assert jobs.stop_requested(A)
    bucket.put(queue_key(A), b"not an entry")
    assert jobs.queued(A)
    assert jobs.record("legacy") is None and jobs.record(A) is None


def test_the_queue_is_this_pools_readable_entries_now_first_then_priority_then_fifo(bucket: Bucket) -> None:
    bucket.submit(A, AT)
    bucket.submit(B, LATER, priority=3)
    bucket.submit(C, LAST, now=True)
    bucket.submit("delta-dddddddd", LAST, pool="big")
    bucket.put("queue/notes.txt", b"not an entry, and not named one")
    jobs = bucket.directory()
    assert [entry.job_id for entry in jobs.entries()] == [C, B, A]
    assert all(entry.queued_at.startswith("20") for entry in jobs.entries()), "S3's clock orders the queue"
    assert [entry.job_id for entry in bucket.directory(pool="big").entries()] == ["delta-dddddddd"]
    assert bucket.events() == [], "an object not named *.json is no entry, nor reported"
    # An entry rewritten (its ETag moved) is read again.
    bucket.put(queue_key(C), queue_entry(C, LAST, pool="big"))
    assert [entry.job_id for entry in jobs.entries()] == [B, A]
    assert jobs.next_job() == B


def test_an_unreadable_entry_is_named_once_cut_short_and_the_queue_goes_on(bucket: Bucket) -> None:
    long_key = "queue/" + "x" * 250 + ".json"
    bucket.put(long_key, b"not json at all")
    bucket.submit(A)
    jobs = bucket.directory()
    for _ in range(2):
        assert [entry.job_id for entry in jobs.entries()] == [A]
    [line] = bucket.said("is not a queue entry")
    prefix = f"s3://{FAST_BUCKET}/"
    assert line["message"].startswith(prefix + long_key + " is not a queue entry")
    assert len(line["message"]) == len(prefix) + 300, "cut at 300 characters"
    assert (line["key"], line["level"], line["stage"]) == (long_key[:200], "error", "queue")


def test_a_cancelled_queued_job_is_skipped_once_and_marked_cancelled_with_why(bucket: Bucket) -> None:
    bucket.submit(A, AT)
    bucket.submit(B, LATER)
    bucket.put(f"jobs/{A}/state/cancel.json", {"by": "me"})
    jobs = bucket.directory()
    assert jobs.next_job() == B
    assert bucket.status(A) == ("cancelled", "cancelled while it waited in the queue")
    [line] = bucket.said("cancelled before it ran")
    assert (line["message"], line["job_id"], line["stage"]) == (
        f"job {A} was cancelled before it ran: skipped",
        A,
        "queue",
    )
    # Stopped while queued (yielded, then cancelled): cancelled too. A completed job is left as it ended.
    bucket.ledger(B, "stopped")
    bucket.put(f"jobs/{B}/state/cancel.json", {"by": "me"})
    bucket.submit(C, LAST)
    bucket.ledger(C, "completed")
    bucket.put(f"jobs/{C}/state/cancel.json", {"by": "me"})
    assert bucket.directory().next_job() is None
    assert bucket.status(B) == ("cancelled", "cancelled while it waited in the queue")
    assert bucket.status(C) == ("completed", None)


def test_a_stopped_job_in_the_queue_is_not_its_head_and_an_ended_one_never(bucket: Bucket) -> None:
    bucket.submit(A, AT)
    bucket.submit(B, LATER)
    bucket.submit(C, LAST)
    bucket.ledger(A, "stopped")
    bucket.ledger(B, "failed")
    assert bucket.directory().next_job() == C
    bucket.ledger(C, "running")
    assert bucket.directory().next_job() == C, "a running job is still the queue's"


def test_a_ledger_that_is_not_json_skips_its_job_saying_so(bucket: Bucket) -> None:
    bucket.submit(A, AT)
    bucket.submit(B, LATER)
    bucket.put(f"jobs/{A}/state/ledger.json", b"{not json")
    bucket.put(f"jobs/{A}/state/cancel.json", {"by": "me"})
    jobs = bucket.directory()
    assert jobs.next_job() == B
    [line] = bucket.said("is not JSON")
    assert line["message"].startswith(f"s3://{FAST_BUCKET}/jobs/{A}/state/ledger.json is not JSON (")
    assert line["message"].endswith(f"); job {A} skipped") and line["level"] == "error"
    assert line["stage"] == "queue"
    assert jobs.status(A) == "cancelled" and jobs.next_job() == B


def _refusal(bucket: Bucket, job_id: str) -> str:
    [line] = bucket.said(f"job {job_id} refused: ")
    assert (line["job_id"], line["level"], line["stage"]) == (job_id, "error", "queue")
    status, reason = bucket.status(job_id)
    assert status == "failed" and line["message"] == f"job {job_id} refused: {reason}"
    return str(reason)


def test_a_record_that_is_missing_or_not_one_fails_its_job_in_one_line(bucket: Bucket) -> None:
    jobs = bucket.directory()
    assert jobs.binding(A) is None
    assert jobs.binding(A) is None
    assert _refusal(bucket, A) == (
        f"s3://{FAST_BUCKET}/jobs/{A}/job.json is missing or not a job record: submit the job again with "
        "`trainstack run`"
    )
    bucket.put(f"jobs/{B}/job.json", {"job_id": B, "agent": "not a mapping"})
    assert jobs.binding(B) is None
    assert _refusal(bucket, B).startswith(f"s3://{FAST_BUCKET}/jobs/{B}/job.json is missing or not a job")


def test_a_record_with_a_bad_agent_field_or_another_jobs_id_is_refused_naming_it(bucket: Bucket) -> None:
    bucket.submit(A, instance_count=0)
    jobs = bucket.directory()
    assert jobs.binding(A) is None
    reason = _refusal(bucket, A)
    assert "instance_count" in reason and f"s3://{FAST_BUCKET}/jobs/{A}/job.json" in reason
    assert reason.endswith("; submit the job again with `trainstack run`")
    bucket.submit(B)
    record = bucket.get(f"jobs/{B}/job.json")
    bucket.put(f"jobs/{B}/job.json", record | {"agent": record["agent"] | {"job_id": C}})
    assert jobs.binding(B) is None
    assert _refusal(bucket, B) == f"s3://{FAST_BUCKET}/jobs/{B}/job.json names job {C}; submit the job again"


def test_a_job_asking_for_more_instances_than_the_group_holds_is_refused_and_the_group_max_is_enough(
    bucket: Bucket,
) -> None:
    bucket.submit(A, instance_count=3)
    bucket.submit(B, instance_count=4)
    jobs = bucket.directory(group_max=3)
    found = jobs.binding(A)
    assert found is not None and found.config is not None and found.config.instance_count == 3
    assert jobs.binding(B) is None
    assert _refusal(bucket, B) == (
        "it asks for 4 instances and the group allows at most 3: submit it with fewer, or raise "
        "trainstack:instanceCount and run pulumi up"
    )
    # Unknown, the group holds the stack's instance count.
    assert bucket.directory(instance_count=3).binding(A) is not None
    assert bucket.directory(instance_count=2).binding(A) is None


def test_only_the_environments_code_is_re_executed_and_other_code_fails_the_job(bucket: Bucket) -> None:
    mine: dict[str, Any] = {"bundle_key": "code/mine/bundle.tar.gz", "bundle_sha256": "a" * 64}
    bucket.submit(A, bundle_key="code/old/bundle.tar.gz", bundle_sha256="b" * 64)
    bucket.submit(B, bundle_key="job-code/" + "c" * 64 + "/bundle.tar.gz", bundle_sha256="c" * 64)
    bucket.submit(C, bundle_key="elsewhere/" + "x" * 200, bundle_sha256="d" * 64)
    bucket.submit("delta-dddddddd", **mine)
    bucket.submit("echo-eeeeeeee")
    jobs = bucket.directory(**mine)
    old = jobs.binding(A, switched_from=C)
    assert (
        old is not None
        and old.switched_from == C
        and old.pinned is not None
        and old.pinned["bundle_key"] == "code/old/bundle.tar.gz"
    )
    assert old.job_code is None and old.config is not None and old.config.job_id == A
    assert (old.job_id, old.prefixes) == (A, JobPrefixes.of(A))
    submitted = jobs.binding(B, switched_from=C)
    assert (
        submitted is not None
        and submitted.switched_from == C
        and submitted.pinned is None
        and submitted.job_code is not None
    )
    assert submitted.job_code["bundle_sha256"] == "c" * 64 and submitted.config is not None
    assert (submitted.job_id, submitted.prefixes, submitted.config.job_id) == (B, JobPrefixes.of(B), B)
    assert jobs.binding(C) is None
    assert _refusal(bucket, C) == (
        f"s3://{FAST_BUCKET}/jobs/{C}/job.json: its bundle_key {clip('elsewhere/' + 'x' * 200, 120)} is "
        "neither the environment's code (code/, written by `pulumi up` only) nor job code (job-code/); the "
        "agent runs only the environment's code as root: submit the job again with `trainstack run`"
    )
    for same in ("delta-dddddddd", "echo-eeeeeeee"):
        here = jobs.binding(same, switched_from=A)
        assert here is not None and (here.job_id, here.prefixes) == (same, JobPrefixes.of(same))
        assert here is not None and (here.pinned, here.job_code, here.switched_from) == (None, None, A)
    assert jobs.binding("legacy", switched_from=A) == JobBinding(
        "legacy", JobPrefixes.of("legacy"), switched_from=A
    )


def test_a_jobs_record_decides_its_fields_never_the_previous_jobs(bucket: Bucket) -> None:
    config = bucket.config(job_name="stack", dataset="old", allow_data_change=True, max_cost_usd=5.0)
    record = {"agent": {"job_id": A, "resume_from": "", "max_cost_usd": 9.5, "instance_count": None}}
    merged = record_fields(config, record)
    assert (merged["job_id"], merged["job_name"], merged["dataset"], merged["allow_data_change"]) == (
        A,
        "",
        "",
        False,
    )
    assert (merged["resume_from"], merged["max_cost_usd"], merged["instance_count"]) == (None, 9.5, 1)
    assert merged["job"] == {} and merged["user_job"] is None and merged["bundle_key"] == ""
    assert record_fields(bucket.config(job_id=C), {"agent": {}})["job_id"] == C, (
        "the only field with no default"
    )
    merged = record_fields(config, {"agent": {"resume_from": B, "instance_count": 2, "job_name": "n"}})
    assert (merged["resume_from"], merged["instance_count"], merged["job_name"]) == (B, 2, "n")
    assert merged["max_cost_usd"] == 5.0, "the stack's cap where the record sets none"
    assert record_fields(config, {"agent": "damaged"})["job_name"] == ""


def test_the_same_code_is_the_same_sha256_or_else_the_same_key_and_sha256() -> None:
    config = AgentConfig("us-east-1", "b", "g", "t", "l", bundle_key="code/k", bundle_sha256="1" * 64)
    assert same_code(config, {})
    assert same_code(config, {"bundle_key": "code/other", "bundle_sha256": "1" * 64})
    assert not same_code(config, {"bundle_key": "code/k", "bundle_sha256": "2" * 64})
    assert not same_code(config, {"bundle_key": "code/other"})
    assert same_code(config, {"bundle_key": "code/k", "bundle_sha256": None}) is False
    unknown = AgentConfig("us-east-1", "b", "g", "t", "l", bundle_key="code/k")
    assert same_code(unknown, {"bundle_key": "code/k"})
    assert not same_code(unknown, {"bundle_key": "code/k", "bundle_sha256": "1" * 64})
    assert not same_code(unknown, {"bundle_key": "code/j"})


def test_a_current_job_goes_on_while_it_runs_and_after_a_resumable_end_only_on_a_fresh_boot(
    bucket: Bucket,
) -> None:
    bucket.submit(A)
    jobs = bucket.directory()
    running = jobs.serving(A, fresh=False)
    assert running is not None and (running.job_id, running.resuming) == (A, False)
    bucket.ledger(A, "running")
    assert jobs.serving(A, fresh=False) == running
    bucket.ledger(A, "stopped")
    assert jobs.serving(A, fresh=False) is None, "the life that just ended it moves on"
    resumed = jobs.serving(A, fresh=True)
    assert resumed is not None and resumed.resuming is True
    bucket.put(f"jobs/{A}/state/control.json", {"action": "stop"})
    assert jobs.serving(A, fresh=True) is None, "its stop request is in force"
    bucket.s3.delete_object(Bucket=bucket.name, Key=f"jobs/{A}/state/control.json")
    bucket.put(f"jobs/{A}/state/cancel.json", {"by": "me"})
    assert jobs.serving(A, fresh=True) is None, "cancelled"
    bucket.s3.delete_object(Bucket=bucket.name, Key=f"jobs/{A}/state/cancel.json")
    bucket.s3.delete_object(Bucket=bucket.name, Key=queue_key(A))
    assert jobs.serving(A, fresh=True) is None, "its entry was taken away (a replaced default job)"
    bucket.put(queue_key(A), queue_entry(A, AT))
    assert jobs.serving(A, fresh=True) is not None
    bucket.ledger(A, "completed")
    assert jobs.serving(A, fresh=True) is None
    bucket.submit(B)
    bucket.s3.delete_object(Bucket=bucket.name, Key=f"jobs/{B}/job.json")
    assert jobs.serving(B, fresh=True) is None, "a record deleted by hand: the queue moves on"
    assert bucket.events() == [], "and nothing is refused for it"


def test_the_legacy_job_goes_on_for_a_config_from_before_jobs_and_for_no_other(bucket: Bucket) -> None:
    old = bucket.directory(job_id="legacy")
    new = bucket.directory(job_id=A)
    fresh_legacy = old.serving("legacy", fresh=False)
    assert fresh_legacy is not None and (fresh_legacy.job_id, fresh_legacy.resuming) == ("legacy", False)
    assert new.serving("legacy", fresh=True) is None, "no ledger: nothing of its own to continue"
    bucket.ledger("legacy", "running")
    found = new.serving("legacy", fresh=False)
    assert found is not None and found.resuming is False
    bucket.ledger("legacy", "stopped")
    assert bucket.directory(job_id=A).serving("legacy", fresh=True) is None
    assert bucket.directory(job_id="legacy").serving("legacy", fresh=False) is None
    resumed = bucket.directory(job_id="legacy").serving("legacy", fresh=True)
    assert resumed is not None and resumed.resuming is True


def test_bind_job_points_a_stack_from_before_jobs_at_the_legacy_job_only_while_it_is_wanted(
    bucket: Bucket,
) -> None:
    old = bucket.config(job_id="legacy")
    bound = bind_job(bucket.s3, old, NOW)
    assert bound is not None and (bound.job_id, bound.resuming) == ("legacy", False)
    assert bucket.pointer()["job_id"] == "legacy"
    assert bucket.get("queue/legacy.json") is None, "a config from before jobs queues nothing"
    bucket.s3.delete_object(Bucket=bucket.name, Key="state/current-job.json")
    bucket.ledger("legacy", "stopped")
    resumed = bind_job(bucket.s3, old, NOW)
    assert resumed is not None and (resumed.job_id, resumed.resuming) == ("legacy", True)
    bucket.s3.delete_object(Bucket=bucket.name, Key="state/current-job.json")
    assert bind_job(bucket.s3, old, NOW, after="legacy") is None, "the life that ended it moves on"
    assert bind_job(bucket.s3, bucket.config(), NOW) is None, "nothing queued, no legacy job running"
    assert bucket.pointer() is None
    bucket.ledger("legacy", "running")
    running = bind_job(bucket.s3, bucket.config(), NOW)
    assert running is not None and (running.job_id, running.resuming) == ("legacy", False)


def test_bind_job_moves_on_from_the_job_just_ended_here_to_the_queues_head(bucket: Bucket) -> None:
    bucket.submit(A, AT)
    bucket.submit(B, LATER)
    config = bucket.config()
    first = bind_job(bucket.s3, config, NOW)
    assert first is not None and (first.job_id, first.switched_from) == (A, None)
    again = bind_job(bucket.s3, config, NOW)
    assert again is not None and (again.job_id, again.switched_from) == (A, None)
    # Its life yielded here (still running by its ledger): the next life goes on to the next job.
    bucket.s3.delete_object(Bucket=bucket.name, Key=queue_key(A))
    moved = bind_job(bucket.s3, config, NOW, after=A)
    assert moved is not None and (moved.job_id, moved.switched_from) == (B, A)
    assert bucket.pointer() == {"job_id": B, "since": iso(NOW), "previous": A}
    # The head is the current job itself (no pointer move).
    bucket.ledger(B, "running")
    same = bind_job(bucket.s3, config, NOW, after=B)
    assert same is not None and (same.job_id, same.switched_from) == (B, None)


def test_a_pointer_moved_by_others_every_time_gives_up_naming_it(bucket: Bucket) -> None:
    bucket.submit(A)
    racing = Racing(bucket.s3, "state/current-job.json")
    with pytest.raises(JobBindingError) as raised:
        bind_job(racing, bucket.config(), NOW)
    assert str(raised.value) == (
        f"s3://{FAST_BUCKET}/state/current-job.json: moved by another instance 10 times in a row; the next "
        "life tries again"
    )
    assert racing.lost == 10
    bucket.s3.delete_object(Bucket=bucket.name, Key=queue_key(A))
    legacy = Racing(bucket.s3, "state/current-job.json")
    with pytest.raises(JobBindingError):
        bind_job(legacy, bucket.config(job_id="legacy"), NOW)
    assert legacy.lost == 10


def test_a_now_job_waiting_behind_the_running_one_is_the_one_it_yields_to(bucket: Bucket) -> None:
    bucket.submit(A, AT)
    jobs = bucket.directory()
    assert jobs.yield_to(A) is None, "no --now entry"
    bucket.submit(B, AT, now=True)
    bucket.submit(C, LATER, now=True)
    bucket.ledger(B, "completed")
    assert bucket.directory().yield_to(A) == C
    bucket.put(f"jobs/{C}/job.json", b"gone bad")
    assert bucket.directory().yield_to(A) is None
    bucket.submit("delta-dddddddd", LAST, now=True)
    assert bucket.directory().yield_to("delta-dddddddd") is None, "never to itself"
    assert bucket.directory().yield_to(A) == "delta-dddddddd"


def test_a_new_job_clears_the_scratch_folder_of_the_previous_jobs_files_and_keeps_the_dataset(
    tmp_path: Path,
) -> None:
    stream = io.StringIO()
    log = EventLog(stream=stream)
    claim_scratch(tmp_path, A, log)
    assert (tmp_path / ".trainstack-job").read_text() == A + "\n"
    local = ("checkpoints", "output", "control", "home", "python", "job-credentials", "shard-cache")
    for name in local:
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_text("x")
    (tmp_path / "job.yaml").write_text("x")
    (tmp_path / "data").mkdir()
    claim_scratch(tmp_path, A, log)
    assert all((tmp_path / name).exists() for name in (*local, "job.yaml")), "its own job's files stay"
    assert stream.getvalue() == ""
    claim_scratch(tmp_path, B, log)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".trainstack-job", "data"]
    assert (tmp_path / ".trainstack-job").read_text() == B + "\n"
    [line] = [json.loads(text) for text in stream.getvalue().splitlines()]
    assert (line["stage"], line["previous"]) == ("job", A)
    assert (
        line["message"]
        == "scratch cleared of the previous job's local files, home and venvs; the dataset stays"
    )
    # A folder without an owner (an agent from before the queue) is kept.
    other = tmp_path / "old"
    other.mkdir()
    (other / "checkpoints").mkdir()
    claim_scratch(other, C, log)
    assert (other / "checkpoints").is_dir() and (other / ".trainstack-job").read_text() == C + "\n"


# -- a pool's lanes: several jobs at once --------------------------------------------------------------


def _lease(bucket: Bucket, job_id: str, *, heartbeat: float, expires: float, released: bool = False) -> None:
    lease = {
        "job_id": job_id,
        "holder": "i-other",
        "life_id": "l1",
        "token": 1,
        "acquired_at": heartbeat,
        "heartbeat_at": heartbeat,
        "expires_at": expires,
        "released_at": heartbeat if released else None,
    }
    bucket.put(f"jobs/{job_id}/state/lease.json", lease)


def _standby(bucket: Bucket, job_id: str, heartbeat: float) -> None:
    standby = {"instance_id": "i-third", "life_id": "l2", "since": heartbeat, "heartbeat_at": heartbeat}
    bucket.put(f"jobs/{job_id}/state/standby.json", standby)


def test_a_running_jobs_staffing_is_read_as_the_lease_will_judge_it(bucket: Bucket) -> None:
    now = NOW.timestamp()
    jobs = bucket.directory(lanes=2)
    assert jobs.staffing(A, now, 60) is Staffing.HOLDER, "no lease, no lane's claim"
    bucket.put(f"jobs/{A}/state/lane.json", {"pool": "", "lane": 1, "since": iso(NOW)})
    assert jobs.staffing(A, now + 59, 60) is Staffing.STANDBY, "claimed a moment ago: its holder is coming"
    assert jobs.staffing(A, now + 60, 60) is Staffing.HOLDER, "claimed a stale limit ago"
    bucket.put(f"jobs/{A}/state/lane.json", {"lane": 1, "since": "not a time"})
    assert jobs.staffing(A, now, 60) is Staffing.HOLDER
    _lease(bucket, A, heartbeat=now, expires=now + 30)
    assert jobs.staffing(A, now + 39, 60) is Staffing.STANDBY, "live up to its expiry plus the drift margin"
    assert jobs.staffing(A, now + 40, 60) is Staffing.HOLDER
    _lease(bucket, A, heartbeat=now, expires=now + 30, released=True)
    assert jobs.staffing(A, now, 60) is Staffing.HOLDER, "let go"
    _lease(bucket, A, heartbeat=now, expires=now + 600)
    _standby(bucket, A, now)
    assert jobs.staffing(A, now + 59, 60) is Staffing.FULL
    assert jobs.staffing(A, now + 60, 60) is Staffing.STANDBY, "a silent standby"


def test_a_job_is_claimed_once_for_one_lane_and_the_other_lanes_pass_it_by(bucket: Bucket) -> None:
    first, second = bucket.directory(lanes=2, pool="p"), bucket.directory(lanes=2, pool="p", lane=1)
    assert first.claim(A, NOW) is True
    assert bucket.get(f"jobs/{A}/state/lane.json") == {"pool": "p", "lane": 0, "since": iso(NOW)}
    assert bucket.content_type(f"jobs/{A}/state/lane.json") == "application/json"
    assert first.claim(A, NOW) is True, "its own claim"
    assert second.claim(A, NOW) is False
    assert second.claimed_elsewhere(A) and not first.claimed_elsewhere(A)
    assert not second.claimed_elsewhere(B), "nobody's"
    bucket.submit(A, AT, pool="p")
    bucket.submit(B, LATER, pool="p")
    assert second.next_job() == B and first.next_job() == A
    # One lane only: a claim is never looked at.
    assert bucket.directory(pool="p", lane=1).next_job() == A


def test_lanes_serve_a_holderless_job_first_then_a_free_lanes_next_job_then_a_standby(bucket: Bucket) -> None:
    now = NOW.timestamp()
    config = bucket.config(lanes=3)
    bucket.submit(A, AT)
    bucket.submit(B, LATER)
    bucket.submit(C, LAST)
    first = bind_job(bucket.s3, config, NOW, log=bucket.log)
    assert first is not None and (first.job_id, first.lane, first.switched_from) == (A, 0, None)
    assert bucket.pointer()["job_id"] == A
    assert bucket.get(f"jobs/{A}/state/lane.json")["lane"] == 0
    # A is claimed and on its way to its lease: the next instance takes the next free lane's job.
    second = bind_job(bucket.s3, config, NOW)
    assert second is not None and (second.job_id, second.lane) == (B, 1)
    assert bucket.pointer("current-job-lane1.json") == {"job_id": B, "since": iso(NOW), "previous": None}
    for job in (A, B):
        _lease(bucket, job, heartbeat=now, expires=now + 600)
        _standby(bucket, job, now)
    # Lane 0's holder died: that job needs a holder before any queued job starts.
    _lease(bucket, A, heartbeat=now - 700, expires=now - 100)
    third = bind_job(bucket.s3, config, NOW)
    assert third is not None and (third.job_id, third.lane) == (A, 0)
    _lease(bucket, A, heartbeat=now, expires=now + 600)
    fourth = bind_job(bucket.s3, config, NOW)
    assert fourth is not None and (fourth.job_id, fourth.lane) == (C, 2)
    _lease(bucket, C, heartbeat=now, expires=now + 600)
    # Every lane runs, one without a live standby: that is where the next instance goes.
    standby = bind_job(bucket.s3, config, NOW)
    assert standby is not None and (standby.job_id, standby.lane) == (C, 2)
    _standby(bucket, C, now)
    assert bind_job(bucket.s3, config, NOW) is None, "nothing here needs this instance"
    _lease(bucket, B, heartbeat=now - 700, expires=now - 100)
    holderless = bind_job(bucket.s3, config, NOW)
    assert holderless is not None and (holderless.job_id, holderless.lane) == (B, 1)


def test_a_lane_whose_job_ended_moves_to_the_next_and_a_look_for_work_writes_nothing(bucket: Bucket) -> None:
    config = bucket.config(lanes=2, job_id=A)
    assert work_in_lanes(bucket.s3, config, NOW, after=None) is None, "no job queued yet"
    first = bind_job(bucket.s3, config, NOW)
    assert first is not None and first.job_id == A, "the config's job, queued first"
    bucket.submit(B, "2026-12-01T13:00:00.000Z")
    bucket.ledger(A, "completed")
    assert work_in_lanes(bucket.s3, config, NOW, after=A) == B
    assert bucket.get(f"jobs/{B}/state/lane.json") is None and bucket.pointer()["job_id"] == A
    moved = bind_job(bucket.s3, config, NOW, after=A)
    assert moved is not None and (moved.job_id, moved.switched_from, moved.lane) == (B, A, 0)
    assert bucket.pointer() == {"job_id": B, "since": iso(NOW), "previous": A}


def test_a_look_for_work_submits_nothing_and_says_a_holderless_job(bucket: Bucket) -> None:
    config = bucket.config(lanes=2, job_id=A)
    assert work_in_lanes(bucket.s3, config, NOW, after=None) is None
    assert bucket.get(queue_key(A)) is None and bucket.get(f"jobs/{A}/job.json") is None
    bucket.submit(B)
    bucket.put("state/current-job-lane1.json", {"job_id": B})
    bucket.ledger(B, "running")
    assert work_in_lanes(bucket.s3, config, NOW, after=None) == B


def test_lanes_that_lose_every_claim_give_up_naming_the_pools_state(bucket: Bucket) -> None:
    bucket.submit(A)
    racing = Racing(bucket.s3, "state/current-job.json", "state/current-job-lane1.json")
    with pytest.raises(JobBindingError) as raised:
        bind_job(racing, bucket.config(lanes=2), NOW)
    assert str(raised.value) == (
        f"s3://{FAST_BUCKET}/state/: the pool's lanes moved 10 times in a row while this instance looked for "
        "work; the next life tries again"
    )
    assert racing.lost == 10, "lane 0 claims A and loses its pointer; lane 1 then finds A claimed by lane 0"


def test_a_sweep_runs_as_many_points_as_its_parallel_and_a_bad_parallel_limits_nothing(
    bucket: Bucket,
) -> None:
    now = NOW.timestamp()
    two = {"name": "lrs", "point": {}, "parallel": 2}
    bucket.submit(A, AT, sweep=two)
    bucket.submit(B, LATER, sweep=two)
    bucket.submit(C, LAST, sweep=two)
    bucket.submit("delta-dddddddd", "2026-12-01T11:00:03.000Z")
    config = bucket.config(lanes=4)
    bound = []
    for _ in range(3):
        found = bind_job(bucket.s3, config, NOW)
        assert found is not None
        bound.append(found.job_id)
        _lease(bucket, found.job_id, heartbeat=now, expires=now + 600)
        _standby(bucket, found.job_id, now)
    assert bound == [A, B, "delta-dddddddd"], "the third point waits while two run"
    config = bucket.config(lanes=5)
    assert work_in_lanes(bucket.s3, config, NOW, after=None) is None, "C waits while A and B run"
    three = {"name": "lrs", "parallel": 3}
    for sweep in (three, {"name": "x", "parallel": True}, {"name": 7, "parallel": 1}, {"parallel": 1}, "lrs"):
        for job in (A, B, C):
            record = bucket.get(f"jobs/{job}/job.json")
            bucket.put(f"jobs/{job}/job.json", record | {"sweep": sweep})
        assert work_in_lanes(bucket.s3, config, NOW, after=None) == C, sweep


def test_a_lane_whose_job_yielded_here_takes_it_again_when_it_is_still_the_queues_head(
    bucket: Bucket,
) -> None:
    bucket.submit(A)
    config = bucket.config(lanes=2)
    first = bind_job(bucket.s3, config, NOW)
    assert first is not None and first.job_id == A
    bucket.ledger(A, "running")
    pointer = bucket.pointer()
    again = bind_job(bucket.s3, config, NOW + timedelta(minutes=1), after=A)
    assert again is not None and (again.job_id, again.lane, again.switched_from) == (A, 0, None)
    assert bucket.pointer() == pointer, "the pointer already names it"


class Vanishing(Racing):
    """The moto client, with `key` deleted by another client just before this one reads it."""

    def get_object(self, **call: Any) -> Any:
        if call["Key"] in self.keys:
            self.keys.discard(call["Key"])
            self._s3.delete_object(Bucket=call["Bucket"], Key=call["Key"])
        return self._s3.get_object(**call)


def test_an_entry_deleted_while_the_queue_is_listed_is_left_out_and_read_when_written_again(
    bucket: Bucket,
) -> None:
    bucket.submit(A, AT)
    bucket.submit(B, LATER)
    entry = bucket.get(queue_key(A))
    vanishing = Vanishing(bucket.s3, queue_key(A))
    jobs = JobDirectory(vanishing, bucket.config(), bucket.log)
    assert [e.job_id for e in jobs.entries()] == [B]
    assert bucket.events() == [], "gone is not damaged"
    bucket.put(queue_key(A), entry)  # the same body: the same ETag
    assert sorted(e.job_id for e in jobs.entries()) == [A, B]


def test_a_lease_record_without_its_expiry_lasts_the_stale_limit_after_its_heartbeat(bucket: Bucket) -> None:
    now = NOW.timestamp()
    jobs = bucket.directory(lanes=2)
    lease = {"holder": "i-other", "life_id": "l1", "token": 1, "acquired_at": now, "heartbeat_at": now}
    bucket.put(f"jobs/{A}/state/lease.json", lease)
    assert jobs.staffing(A, now + 69, 60) is Staffing.STANDBY, "its heartbeat + the limit + the drift margin"
    assert jobs.staffing(A, now + 70, 60) is Staffing.HOLDER


def test_a_look_for_work_judges_a_standby_silent_after_a_minute_by_default(bucket: Bucket) -> None:
    now = NOW.timestamp()
    bucket.submit(A)
    bucket.put("state/current-job.json", {"job_id": A})
    bucket.put(f"jobs/{A}/state/lane.json", {"lane": 0, "since": iso(NOW)})
    bucket.ledger(A, "running")
    _lease(bucket, A, heartbeat=now, expires=now + 600)
    config = bucket.config(lanes=2)
    _standby(bucket, A, now - 59.5)
    assert work_in_lanes(bucket.s3, config, NOW, after=None) is None
    assert bind_job(bucket.s3, config, NOW) is None
    _standby(bucket, A, now - 60.5)
    assert work_in_lanes(bucket.s3, config, NOW, after=None) == A
    found = bind_job(bucket.s3, config, NOW)
    assert found is not None and found.job_id == A


def test_a_look_for_work_after_a_stop_here_goes_on_to_the_next_job_and_a_fresh_one_resumes(
    bucket: Bucket,
) -> None:
    bucket.submit(A, AT)
    config = bucket.config(lanes=2)
    first = bind_job(bucket.s3, config, NOW)
    assert first is not None and first.job_id == A
    bucket.ledger(A, "stopped")
    bucket.submit(B, LATER)
    later = NOW + timedelta(minutes=2)  # its lane's claim is not one a holder is still on its way to
    assert work_in_lanes(bucket.s3, config, later, after=A) == B
    assert work_in_lanes(bucket.s3, config, later, after=None) == A, "a new boot resumes it"
    moved = bind_job(bucket.s3, config, later, after=A)
    assert moved is not None and (moved.job_id, moved.switched_from) == (B, A)


def test_a_look_for_work_uses_the_groups_size_and_names_damage_once_in_the_lifes_log(bucket: Bucket) -> None:
    bucket.submit(A, instance_count=2)
    bucket.put("state/current-job.json", b"damaged")
    config = bucket.config(lanes=2)
    reported: set[str] = set()
    for _ in range(2):
        found = work_in_lanes(
            bucket.s3, config, NOW, after=None, log=bucket.log, group_max=2, reported=reported
        )
        assert found == A
    assert len(bucket.said("is not a job pointer")) == 1
    assert work_in_lanes(bucket.s3, config, NOW, after=None, log=bucket.log, reported=reported) is None
    assert _refusal(bucket, A).startswith("it asks for 2 instances and the group allows at most 1")


def test_every_lanes_damaged_pointer_is_named_once_in_the_lifes_log(bucket: Bucket) -> None:
    bucket.put("state/current-job.json", b"damaged")
    bucket.put("state/current-job-lane1.json", {"job_id": "Not An Id"})
    config = bucket.config(lanes=2)
    reported: set[str] = set()
    for _ in range(2):
        assert bind_job(bucket.s3, config, NOW, log=bucket.log, reported=reported) is None
    lines = bucket.said("is not a job pointer")
    assert [line["message"].split(" ")[0] for line in lines] == [
        f"s3://{FAST_BUCKET}/state/current-job.json",
        f"s3://{FAST_BUCKET}/state/current-job-lane1.json",
    ]
    assert bind_job(bucket.s3, config, NOW, log=bucket.log) is None, "a life without its set: said again"
    assert len(bucket.said("is not a job pointer")) == 4


def test_each_lane_takes_a_job_as_big_as_the_group_allows(bucket: Bucket) -> None:
    now = NOW.timestamp()
    bucket.submit(A, AT, instance_count=2)
    bucket.submit(B, LATER, instance_count=2)
    config = bucket.config(lanes=2)
    first = bind_job(bucket.s3, config, NOW, group_max=2)
    assert first is not None and (first.job_id, first.lane) == (A, 0)
    _lease(bucket, A, heartbeat=now, expires=now + 600)
    _standby(bucket, A, now)
    second = bind_job(bucket.s3, config, NOW, group_max=2)
    assert second is not None and (second.job_id, second.lane) == (B, 1)


def test_a_cancelled_job_is_skipped_once_by_all_of_a_pools_lanes(bucket: Bucket) -> None:
    bucket.submit(A)
    bucket.put(f"jobs/{A}/state/ledger.json", b"{damaged")
    bucket.put(f"jobs/{A}/state/cancel.json", {"by": "me"})
    assert bind_job(bucket.s3, bucket.config(lanes=3), NOW, log=bucket.log) is None
    assert len(bucket.said("cancelled before it ran")) == 1, "the lanes share what one of them learnt"


class ClaimedMeanwhile(Racing):
    """The moto client, with another instance's lane `lane` claiming `job_id` (and pointing at it) just
    before this one's claim is written."""

    def __init__(self, s3: Any, job_id: str, lane: int) -> None:
        super().__init__(s3)
        self.job_id, self.lane = job_id, lane

    def put_object(self, **call: Any) -> Any:
        if call["Key"] == f"jobs/{self.job_id}/state/lane.json" and not self.lost:
            self.lost += 1
            claim = {"pool": "", "lane": self.lane, "since": iso(NOW)}
            self._s3.put_object(Bucket=FAST_BUCKET, Key=call["Key"], Body=json.dumps(claim).encode())
            pointer = {"job_id": self.job_id}
            key = f"state/current-job-lane{self.lane}.json"
            self._s3.put_object(Bucket=FAST_BUCKET, Key=key, Body=json.dumps(pointer).encode())
        return self._s3.put_object(**call)


def test_a_job_another_lane_claims_first_is_passed_by_for_the_next_free_lanes_next_job(
    bucket: Bucket,
) -> None:
    bucket.submit(A, AT)
    bucket.submit(B, LATER)
    racing = ClaimedMeanwhile(bucket.s3, A, 2)
    found = bind_job(racing, bucket.config(lanes=3), NOW)
    assert racing.lost == 1
    assert found is not None and (found.job_id, found.lane) == (B, 1), "the next free lane, in the same look"
    assert bucket.get(f"jobs/{A}/state/lane.json")["lane"] == 2 and bucket.pointer() is None


def test_a_job_another_instance_claims_while_this_one_looks_is_looked_at_again(bucket: Bucket) -> None:
    """Lane 1 is busy here; another instance claims the queued job for it (its job just ended there): this
    instance looks again and finds the job on its way to its holder, and waits beside it as its standby."""
    now = NOW.timestamp()
    bucket.submit(C, AT)
    bucket.put("state/current-job-lane1.json", {"job_id": C})
    bucket.put(f"jobs/{C}/state/lane.json", {"pool": "", "lane": 1, "since": iso(NOW)})
    _lease(bucket, C, heartbeat=now, expires=now + 600)
    _standby(bucket, C, now)
    bucket.submit(A, LATER)
    racing = ClaimedMeanwhile(bucket.s3, A, 1)
    found = bind_job(racing, bucket.config(lanes=2), NOW)
    assert found is not None and (found.job_id, found.lane) == (A, 1)


def test_a_job_claimed_for_a_lane_whose_pointer_never_moved_is_started_there(bucket: Bucket) -> None:
    bucket.submit(A)
    bucket.put(f"jobs/{A}/state/lane.json", {"pool": "", "lane": 1, "since": iso(NOW)})
    found = bind_job(bucket.s3, bucket.config(lanes=2), NOW)
    assert found is not None and (found.job_id, found.lane) == (A, 1)
    assert bucket.pointer("current-job-lane1.json")["job_id"] == A and bucket.pointer() is None


def test_one_lane_takes_a_job_as_big_as_the_group_allows_and_names_a_damaged_pointer_once(
    bucket: Bucket,
) -> None:
    bucket.put("state/current-job.json", b"damaged")
    reported: set[str] = set()
    for _ in range(2):
        assert bind_job(bucket.s3, bucket.config(), NOW, log=bucket.log, reported=reported) is None
    assert len(bucket.said("is not a job pointer")) == 1, "nothing queued: the pointer stays as it is"
    bucket.submit(A, instance_count=2)
    found = bind_job(bucket.s3, bucket.config(), NOW, log=bucket.log, group_max=2, reported=reported)
    assert found is not None and found.job_id == A


def test_a_current_job_whose_record_is_refused_is_not_served(bucket: Bucket) -> None:
    bucket.submit(A, instance_count=2)
    bucket.ledger(A, "running")
    assert bucket.directory().serving(A, fresh=False) is None
    assert _refusal(bucket, A).startswith("it asks for 2 instances")


class Counting(Racing):
    """The moto client, counting the reads of queue entries."""

    def __init__(self, s3: Any) -> None:
        super().__init__(s3)
        self.reads: Counter[str] = Counter()

    def get_object(self, **call: Any) -> Any:
        if call["Key"].startswith("queue/"):
            self.reads[call["Key"]] += 1
        return self._s3.get_object(**call)


def test_each_queue_entry_is_read_once_per_life_and_once_for_all_of_a_pools_lanes(bucket: Bucket) -> None:
    bucket.submit(A, AT)
    bucket.submit(B, LATER)
    counting = Counting(bucket.s3)
    jobs = JobDirectory(counting, bucket.config(), bucket.log)
    for _ in range(3):
        assert [entry.job_id for entry in jobs.entries()] == [A, B]
    assert counting.reads == {queue_key(A): 1, queue_key(B): 1}
    lanes = Counting(bucket.s3)
    # Both wait to resume in lane 2, which trains C with its standby: lanes 0 and 1 find nothing to do.
    for job in (A, B, C):
        bucket.put(f"jobs/{job}/state/lane.json", {"pool": "", "lane": 2, "since": iso(NOW)})
    bucket.put(f"jobs/{C}/job.json", bucket.get(f"jobs/{A}/job.json") | {"agent": {"job_id": C}})
    bucket.put("state/current-job-lane2.json", {"job_id": C})
    _lease(bucket, C, heartbeat=NOW.timestamp(), expires=NOW.timestamp() + 600)
    _standby(bucket, C, NOW.timestamp())
    assert bind_job(lanes, bucket.config(lanes=3), NOW) is None
    assert lanes.reads == {queue_key(A): 1, queue_key(B): 1}


def test_an_unreadable_entry_is_read_once_per_version_not_at_every_scan(bucket: Bucket) -> None:
    """A malformed entry stays in the queue until someone removes it: each agent's scan must not GET it
    again (every scan of every instance of the pool would pay for it), only once it is rewritten."""
    bucket.put(queue_key(A), b"not json")
    bucket.submit(B, LATER)
    counting = Counting(bucket.s3)
    jobs = JobDirectory(counting, bucket.config(), bucket.log)
    for _ in range(3):
        assert [entry.job_id for entry in jobs.entries()] == [B]
    assert counting.reads[queue_key(A)] == 1
    bucket.put(queue_key(A), b"still not json, but rewritten")
    jobs.entries()
    assert counting.reads[queue_key(A)] == 2


def test_every_unreadable_entry_is_named_once_and_other_objects_under_queue_are_not(bucket: Bucket) -> None:
    bucket.put("queue/0-notes.txt", b"not an entry, and not named one")
    bucket.put(queue_key(A), b"not json")
    bucket.put(queue_key(B), {"job_id": C, "submitted_at": AT})
    bucket.submit(C)
    jobs = bucket.directory()
    for _ in range(2):
        assert [entry.job_id for entry in jobs.entries()] == [C]
    lines = bucket.said("is not a queue entry")
    assert [line["key"] for line in lines] == [queue_key(A), queue_key(B)]


def test_objects_that_are_json_but_not_objects_read_as_absent(bucket: Bucket) -> None:
    bucket.submit(A)
    for name in ("job.json", "state/ledger.json", "state/control.json", "state/lane.json"):
        bucket.put(f"jobs/{A}/{name}", b'["a list"]')
    jobs = bucket.directory(lanes=2, lane=1)
    assert jobs.status(A) is None and not jobs.stop_requested(A) and not jobs.claimed_elsewhere(A)
    assert jobs.record(A) is None and jobs.binding(A) is None
    assert _refusal(bucket, A).endswith(
        "is missing or not a job record: submit the job again with `trainstack run`"
    )


def test_a_huge_claim_every_lane_reads_is_named_once_in_one_look(bucket: Bucket) -> None:
    now = NOW.timestamp()
    sweep = {"name": "lrs", "point": {}, "parallel": 1}
    bucket.submit(C, AT, sweep=sweep)
    bucket.put("state/current-job-lane2.json", {"job_id": C})
    bucket.put(f"jobs/{C}/state/lane.json", {"pool": "", "lane": 2, "since": iso(NOW)})
    bucket.ledger(C, "running")
    _lease(bucket, C, heartbeat=now, expires=now + 600)
    _standby(bucket, C, now)
    bucket.submit(A, LATER, sweep=sweep)
    bucket.put(f"jobs/{A}/state/lane.json", b" " * (MAX_OBJECT_BYTES + 1))
    assert bind_job(bucket.s3, bucket.config(lanes=3), NOW, log=bucket.log) is None, "A waits for its sweep"
    assert len(bucket.said("bytes: not read")) == 1, "lanes 0 and 1 both read it"


# -- the stack's maxConcurrentJobs (trainstack_job/slots.py) ----------------------------------------


def test_max_concurrent_jobs_holds_a_second_pools_job_until_the_first_ends(bucket: Bucket) -> None:
    """Two pools, one slot: the default pool's job starts; the other pool's free lanes start nothing, say
    why once, and the look a job's end makes finds nothing either; once the first ends, the second starts."""
    single = bucket.config(max_concurrent_jobs=1)
    lanes = bucket.config(max_concurrent_jobs=1, pool="p", lanes=2)
    bucket.submit(A, AT)
    bucket.submit(B, LATER, pool="p")
    first = bind_job(bucket.s3, single, NOW, log=bucket.log)
    assert first is not None and first.job_id == A
    assert bucket.get("state/slots/slot-0.json") == {"job_id": A, "since": iso(NOW)}
    bucket.put(f"jobs/{A}/state/ledger.json", {"status": "running", "lives": []})
    reported: set[str] = set()
    for _ in range(2):
        assert bind_job(bucket.s3, lanes, NOW, log=bucket.log, reported=reported) is None
    assert work_in_lanes(bucket.s3, lanes, NOW, after=None, log=bucket.log) is None
    said = [e for e in bucket.events() if "maxConcurrentJobs" in e["message"]]
    assert [e["message"] for e in said][:1] == [
        f"maxConcurrentJobs 1 reached: {B} waits until a running job ends"
    ]
    assert said[0]["job_id"] == B and said[0].get("level", "info") == "info" and said[0]["stage"] == "queue"
    assert len(said) == 2, "once per life (the look is another life's)"
    assert bucket.get(f"jobs/{B}/state/lane.json") is None, "no lane claimed"
    assert bucket.pointer("current-job-p.json") is None, "no pointer moved"
    bucket.put(f"jobs/{A}/state/ledger.json", {"status": "completed", "lives": []})
    assert work_in_lanes(bucket.s3, lanes, NOW, after=None) == B
    assert bucket.get("state/slots/slot-0.json")["job_id"] == A, "a look writes no slot"
    second = bind_job(bucket.s3, lanes, NOW, log=bucket.log)
    assert second is not None and second.job_id == B
    assert bucket.get("state/slots/slot-0.json")["job_id"] == B


def test_max_concurrent_jobs_holds_a_single_lane_pools_next_job(bucket: Bucket) -> None:
    config = bucket.config(max_concurrent_jobs=1)
    other = bucket.config(max_concurrent_jobs=1, pool="q")
    bucket.submit(A, AT, pool="q")
    bucket.submit(B, LATER)
    started = bind_job(bucket.s3, other, NOW)
    assert started is not None and started.job_id == A
    bucket.put(f"jobs/{A}/state/ledger.json", {"status": "running", "lives": []})
    assert bind_job(bucket.s3, config, NOW) is None, "the slot is A's: the default pool's job waits"
    assert bucket.pointer() is None
    # Without a limit (0), the same stack starts it at once.
    unlimited = bind_job(bucket.s3, bucket.config(), NOW)
    assert unlimited is not None and unlimited.job_id == B
    assert bucket.get("state/slots/slot-1.json") is None, "no slot taken without a limit"


def test_instances_of_two_pools_racing_start_no_more_jobs_than_max_concurrent_jobs(bucket: Bucket) -> None:
    """Eight instances of two pools of lanes look for work at once over eight queued jobs: exactly the
    limit's number of jobs start (a slot and a lane claimed each), whichever instances win the races."""
    jobs = [f"job{i}-{i:08x}" for i in range(8)]
    for index, job in enumerate(jobs):
        bucket.submit(job, f"2026-12-01T11:00:0{index}.000Z", pool="p" if index % 2 else "")
    configs = [bucket.config(max_concurrent_jobs=3, lanes=4, pool="p" if i % 2 else "") for i in range(8)]
    bound: list[str | None] = []
    start = threading.Barrier(len(configs), timeout=30)  # an instance that dies first breaks it

    def look(config: AgentConfig) -> None:
        s3 = boto3.client("s3", region_name="us-east-1")  # one client per instance
        start.wait()
        binding = bind_job(s3, config, NOW)
        bound.append(binding.job_id if binding is not None else None)

    threads = [threading.Thread(target=look, args=(config,)) for config in configs]
    for thread in threads:
        thread.start()
    join_all(threads, 60, "the eight instances' bindings")
    # The others come as standbys of those three (a running job without one), never as a fourth job.
    started = {job for job in bound if job is not None}
    assert len(bound) == 8 and len(started) == 3, bound
    slots = {bucket.get(f"state/slots/slot-{k}.json")["job_id"] for k in range(3)}
    claimed = {job for job in jobs if bucket.get(f"jobs/{job}/state/lane.json") is not None}
    assert slots == started == claimed


def test_a_look_counts_a_slot_its_job_was_given_and_the_lifes_own_stale_limit(bucket: Bucket) -> None:
    """The slot a job took a moment ago (its instance on the way) is its own to a look, another job's fresh
    slot is not free, and a slot whose job never started frees after the life's stale limit, not a fixed
    one."""
    lanes = bucket.config(max_concurrent_jobs=2, lanes=2)
    bucket.submit(B, LATER)
    fresh = {"job_id": B, "since": iso(NOW)}
    other = {"job_id": C, "since": iso(NOW)}  # C (then D) took a slot and has not started yet
    bucket.put("state/slots/slot-0.json", other)
    bucket.put("state/slots/slot-1.json", fresh)
    assert work_in_lanes(bucket.s3, lanes, NOW, after=None) == B, "B holds slot 1"
    bucket.put("state/slots/slot-1.json", {"job_id": "delta-dddddddd", "since": iso(NOW)})
    assert work_in_lanes(bucket.s3, lanes, NOW, after=None) is None, "C's and D's slots are not free"
    later = NOW + timedelta(seconds=20)
    assert work_in_lanes(bucket.s3, lanes, later, after=None, stale_seconds=30) is None
    assert work_in_lanes(bucket.s3, lanes, later, after=None, stale_seconds=10) == B, "C never started"
    taken = bind_job(bucket.s3, lanes, later, stale_seconds=10)
    assert taken is not None and taken.job_id == B
