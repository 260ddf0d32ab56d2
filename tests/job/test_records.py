"""trainstack_job/records.py: each shared record reads whatever JSON its object holds without raising, writes
back what it read (fields it does not know included), and is defined nowhere else."""

from __future__ import annotations

import ast
import json
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError
from moto import mock_aws

from trainstack_job.contract import JobStatus, LifeOutcome
from trainstack_job.records import (
    ENDED_STATUSES,
    IDLE_STATUSES,
    JobPointer,
    LeaseState,
    Ledger,
    Life,
    Progress,
    RunSlot,
    S3Record,
    StandbyState,
    error_code,
    is_conflict,
    is_missing,
    write_condition,
)

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("bootstrap", "trainstack", "trainstack_job", "training", "infra", "demo", "bench")
HOME = ROOT / "trainstack_job" / "records.py"
ENDED_VALUES = {status.value for status in ENDED_STATUSES}


def client_error(code: str, status: int) -> ClientError:
    response: Any = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return ClientError(response, "PutObject")


LIFE = {
    "life_id": "i-1@2026-12-06T10:00:00Z",
    "instance_id": "i-1",
    "instance_type": "g6.xlarge",
    "az": "us-east-1a",
    "lifecycle": "spot",
    "started_at": "2026-12-06T10:00:00Z",
    "heartbeat_at": "2026-12-06T10:30:00Z",
    "ended_at": None,
    "purchase_option": "spot",
    "price_source": "spot-price-history",
    "price_usd_per_hour": 0.3,
    "storage_usd_per_hour": 0.01,
    "instance_cost_usd": 0.15,
    "storage_cost_usd": 0.005,
    "cost_usd": 0.155,
    "priced_at": "2026-12-06T10:30:00Z",
    "outcome": "running",
    "generation": 3,
    "standby_seconds": 12.5,
    "standby_cost_usd": 0.001,
}


# -- statuses ---------------------------------------------------------------------------------------


def test_ended_statuses_are_the_ones_that_train_no_more_and_idle_adds_a_yielded_job() -> None:
    assert {s.value for s in ENDED_STATUSES} == {
        "completed",
        "failed",
        "stopped",
        "cost_cap",
        "no_data",
        "cancelled",
    }
    # Everything but the billing statuses: waiting for data and running still bill.
    billing = {JobStatus.WAITING_FOR_DATA.value, JobStatus.RUNNING.value}
    assert {s.value for s in IDLE_STATUSES} == {s.value for s in JobStatus} - billing
    assert Ledger(status="queued").idle and not Ledger(status="queued").ended
    assert Ledger(status="cost_cap").ended and Ledger(status="cost_cap").idle
    assert not Ledger(status="runing").idle  # a status no reader knows still bills


# -- conditional writes -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "status", "conflict"),
    [
        ("PreconditionFailed", 412, True),
        ("ConditionalRequestConflict", 409, True),
        ("Whatever", 412, True),
        ("Whatever", 409, True),
        ("AccessDenied", 403, False),
        ("NoSuchKey", 404, False),
    ],
)
def test_a_lost_conditional_write_is_a_conflict_and_nothing_else_is(
    code: str, status: int, conflict: bool
) -> None:
    assert is_conflict(client_error(code, status)) is conflict


def test_missing_codes_and_errors_without_a_response() -> None:
    for code in ("NoSuchKey", "404", "NotFound"):
        assert is_missing(client_error(code, 404))
    assert not is_missing(client_error("AccessDenied", 403))
    plain = RuntimeError("boom")
    assert (error_code(plain), is_conflict(plain), is_missing(plain)) == ("", False, False)
    assert error_code(client_error("SlowDown", 503)) == "SlowDown"
    codeless: Any = {"Error": {"Message": "no code"}, "ResponseMetadata": {"HTTPStatusCode": 500}}
    assert error_code(ClientError(codeless, "GetObject")) == ""


def test_write_condition_matches_the_etag_read_or_requires_absence() -> None:
    assert write_condition('"abc"') == {"IfMatch": '"abc"'}
    assert write_condition(None) == {"IfNoneMatch": "*"}
    assert write_condition("") == {"IfNoneMatch": "*"}


@mock_aws
def test_an_s3_record_is_created_once_replaced_against_its_etag_and_deleted_against_it() -> None:
    s3 = boto3.client("s3", region_name="us-east-1")
    s3.create_bucket(Bucket="records-test")
    record = S3Record(s3, "records-test", "state/x.json")
    assert record.uri == "s3://records-test/state/x.json"
    assert record.get() == (None, None)
    assert record.put({"n": 1}, None)
    assert not record.put({"n": 2}, None)  # it exists now: a second creator loses
    value, etag = record.get()
    assert value == {"n": 1} and etag
    assert record.put({"n": 3}, etag)
    assert not record.put({"n": 4}, etag)  # the ETag moved
    assert record.get()[0] == {"n": 3}
    assert not record.delete(etag)  # stale ETag: not deleted
    assert record.get()[0] == {"n": 3}
    assert record.delete(record.get()[1] or "")
    assert record.get() == (None, None)
    # Written for people to read (indented), and what JSON cannot say (a time) as its text.
    assert record.put({"at": datetime(2026, 12, 6, tzinfo=timezone.utc)}, record.get()[1])
    stored = s3.get_object(Bucket="records-test", Key="state/x.json")["Body"].read().decode()
    assert stored == json.dumps({"at": "2026-12-06 00:00:00+00:00"}, indent=2)
    s3.put_object(Bucket="records-test", Key="state/x.json", Body=b"\xff not json")
    value, etag = record.get()
    assert value is None and etag  # unreadable counts as absent, replaced against its ETag
    assert record.put({"n": 5}, etag)


def test_an_s3_record_raises_what_is_not_a_race() -> None:
    class Denied:
        def get_object(self, **_: Any) -> Any:
            raise client_error("AccessDenied", 403)

        def put_object(self, **_: Any) -> Any:
            raise client_error("AccessDenied", 403)

        def delete_object(self, **_: Any) -> Any:
            raise client_error("AccessDenied", 403)

    record = S3Record(Denied(), "b", "k")
    for call in (record.get, lambda: record.put({}, None), lambda: record.delete("e")):
        with pytest.raises(ClientError):
            call()


# -- the ledger -------------------------------------------------------------------------------------


def test_a_life_reads_every_field_and_writes_back_what_it_read() -> None:
    life = Life.from_json(LIFE)
    assert life is not None
    assert (life.instance_id, life.price_usd_per_hour, life.cost_usd, life.priced_at) == (
        "i-1",
        0.3,
        0.155,
        "2026-12-06T10:30:00Z",
    )
    assert life.running and life.generation == 3
    assert (life.standby_seconds, life.standby_cost_usd) == (12.5, 0.001)
    assert life.to_json() == LIFE


def test_a_life_with_throughput_round_trips_and_an_old_life_reads_without_it() -> None:
    measured = {
        **LIFE,
        "samples_per_second": 812.5,
        "throughput_reports": 4,
        "throughput_step": 400,
        "precision": "bf16",
        "model_family": "resnet50",
    }
    life = Life.from_json(json.loads(json.dumps(measured)))
    assert life is not None
    assert (life.samples_per_second, life.throughput_reports, life.throughput_step) == (812.5, 4, 400)
    assert (life.precision, life.model_family) == ("bf16", "resnet50")
    assert life.to_json() == measured and not life.extra.keys() & measured.keys() - LIFE.keys()
    old = Life.from_json(LIFE)
    assert old is not None and old.samples_per_second is None and old.precision is None
    assert "samples_per_second" not in old.to_json(), "absent until measured, as an older agent wrote it"
    odd = Life.from_json({**LIFE, "samples_per_second": "fast", "precision": 16, "throughput_reports": True})
    assert odd is not None and (odd.samples_per_second, odd.precision, odd.throughput_reports) == (None,) * 3


def test_a_life_that_ended_reads_its_end() -> None:
    ended = {**LIFE, "outcome": "preempted", "ended_at": "2026-12-06T11:00:00Z", "closed_by": "i-9"}
    life = Life.from_json(ended)
    assert life is not None and not life.running
    assert (life.outcome, life.ended_at, life.extra["closed_by"]) == (
        "preempted",
        "2026-12-06T11:00:00Z",
        "i-9",
    )
    assert life.to_json() == ended
    bare = Life.from_json({"started_at": "s"})
    assert bare is not None
    assert (bare.storage_usd_per_hour, bare.instance_cost_usd, bare.storage_cost_usd, bare.cost_usd) == (
        0.0,
    ) * 4
    assert (bare.outcome, bare.generation, bare.standby_seconds, bare.standby_cost_usd) == (
        "running",
        None,
        0.0,
        0.0,
    )


def test_a_life_of_wrong_types_reads_them_as_absent_and_without_a_start_is_no_life() -> None:
    damaged = {**LIFE, "price_usd_per_hour": "0.3", "cost_usd": True, "instance_id": 7, "generation": "3"}
    life = Life.from_json(damaged)
    assert life is not None
    assert (life.price_usd_per_hour, life.cost_usd, life.instance_id, life.generation) == (
        None,
        0.0,
        "",
        None,
    )
    assert Life.from_json({**LIFE, "started_at": None}) is None
    assert Life.from_json(["not", "a", "life"]) is None
    assert Life.from_json({"started_at": "2026-12-06T10:00:00Z"}) == Life("", "", "2026-12-06T10:00:00Z")


def test_an_opened_life_is_named_by_its_instance_and_start_and_costs_nothing_yet() -> None:
    life = Life.opened(
        instance_id="i-2",
        instance_type="g6.xlarge",
        az="us-east-1b",
        lifecycle="on-demand",
        started_at="2026-12-06T11:00:00Z",
        price_usd_per_hour=0.8,
    )
    assert life.life_id == "i-2@2026-12-06T11:00:00Z"
    assert (life.heartbeat_at, life.priced_at, life.ended_at) == ("2026-12-06T11:00:00Z",) * 2 + (None,)
    assert (life.purchase_option, life.outcome, life.cost_usd) == (
        "on-demand",
        LifeOutcome.RUNNING.value,
        0.0,
    )
    spot = Life.opened(
        instance_id="i-3",
        instance_type="t",
        az="a",
        lifecycle="spot",
        started_at="s",
        price_usd_per_hour=None,
    )
    assert spot.purchase_option == "spot" and spot.price_usd_per_hour is None


def test_a_ledger_reads_its_sums_and_lives_and_skips_what_is_not_a_life() -> None:
    raw = {
        "status": "running",
        "lives": [LIFE, "garbage", {"no": "start"}],
        "interruptions": 2,
        "consecutive_failures": 1,
        "total_cost_usd": 1.5,
        "standby_cost_usd": 0.25,
        "handovers": 1,
        "updated_at": "2026-12-06T10:30:00Z",
        "dataset": {"name": "default", "version": "v1"},
        "job_id": "resnet-1a2b3c4d",
    }
    ledger = Ledger.from_json(raw)
    assert [life.life_id for life in ledger.lives] == [LIFE["life_id"]]
    assert (ledger.interruptions, ledger.consecutive_failures, ledger.handovers) == (2, 1, 1)
    assert (ledger.total_cost_usd, ledger.standby_cost_usd) == (1.5, 0.25)
    assert ledger.dataset == {"name": "default", "version": "v1"}
    assert ledger.extra == {"job_id": "resnet-1a2b3c4d"}
    written = ledger.to_json()
    assert written["job_id"] == "resnet-1a2b3c4d" and written["lives"] == [LIFE]
    assert Ledger.from_json(written) == ledger


@pytest.mark.parametrize(
    "raw",
    [
        None,
        [],
        "x",
        3,
        {"lives": "x", "interruptions": "2", "total_cost_usd": None},
        {"lives": 5, "status": 1, "handovers": True, "consecutive_failures": 1.5, "standby_cost_usd": "0.1"},
        {"dataset": "v1", "updated_at": 7, "reason": ["x"]},
    ],
)
def test_anything_else_reads_as_a_new_ledger(raw: Any) -> None:
    assert Ledger.from_json(raw) == Ledger()


def test_an_ended_ledger_reads_its_status_reason_and_time() -> None:
    raw = {
        "status": "failed",
        "reason": "job refused: no code",
        "updated_at": "2026-12-06T12:00:00Z",
        "extra": 1,
    }
    ledger = Ledger.from_json(raw)
    assert (ledger.status, ledger.reason, ledger.updated_at) == (
        "failed",
        "job refused: no code",
        raw["updated_at"],
    )
    assert ledger.ended and ledger.extra == {"extra": 1}
    assert {k: ledger.to_json()[k] for k in raw} == raw


def test_a_new_ledger_writes_only_the_fields_a_ledger_always_had() -> None:
    assert Ledger().to_json() == {
        "status": "running",
        "lives": [],
        "interruptions": 0,
        "consecutive_failures": 0,
        "total_cost_usd": 0.0,
        "standby_cost_usd": 0.0,
        "handovers": 0,
    }
    assert Ledger(reason="refused").to_json()["reason"] == "refused"


# -- progress ---------------------------------------------------------------------------------------


def test_progress_reads_the_trainers_file_and_keeps_its_gpu_samples() -> None:
    raw = {
        "epoch": 1,
        "epochs": 3,
        "step": 40,
        "total_steps": 120,
        "loss": 0.51,
        "samples_per_s": 812.5,
        "data_wait_fraction": 0.02,
        "eta_s": 30,
        "world_size": 2,
        "updated_at": "2026-12-06T10:30:00Z",
        "gpu_util_percent": 97.0,
    }
    progress = Progress.from_json(raw)
    assert progress is not None
    assert (progress.step, progress.samples_per_s, progress.world_size) == (40, 812.5, 2)
    assert progress.extra == {"gpu_util_percent": 97.0}
    assert progress.to_json() == raw


def test_progress_from_an_older_job_library_and_without_a_step() -> None:
    old = Progress.from_json({"step": 5, "written_at": "2026-01-01T00:00:00Z", "accuracy": 0.9})
    assert old is not None and old.updated_at == "2026-01-01T00:00:00Z" and old.extra == {"accuracy": 0.9}
    odd = Progress.from_json({"step": 5, "written_at": 17})
    assert odd is not None and odd.updated_at is None
    for raw in (None, {}, {"step": "5"}, {"step": True}, [5]):
        assert Progress.from_json(raw) is None
    # The precision and model a life's throughput is measured for; a file without them reads as unknown.
    said = Progress.from_json({"step": 5, "precision": "fp16", "model": "resnet50"})
    assert said is not None and (said.precision, said.model, said.extra) == ("fp16", "resnet50", {})
    assert said.to_json() == {"step": 5, "total_steps": None, "precision": "fp16", "model": "resnet50"}
    assert old.precision is None and old.model is None
    # A job that reports a step alone writes a step alone (and its total, null when unknown).
    assert Progress(step=3).to_json() == {"step": 3, "total_steps": None}


# -- the lease, the standby, the pointer ------------------------------------------------------------


def test_lease_and_standby_records_round_trip_and_refuse_incomplete_ones() -> None:
    lease = LeaseState("i-1", "i-1@t", 4, 100.0, 130.0, None, None, "job-1", 190.0)
    assert LeaseState.from_record(json.loads(json.dumps(lease.to_record()))) == lease
    assert LeaseState.from_record({**lease.to_record(), "token": True}) is None
    assert LeaseState.from_record({**lease.to_record(), "expires_at": "190"}) is None
    standby = StandbyState("i-2", "i-2@t", 10.0, None, 12.0)
    assert StandbyState.from_record(standby.to_record()) == standby
    assert StandbyState.from_record({**standby.to_record(), "since": None}) is None


def test_a_pointer_names_a_job_or_is_not_a_pointer() -> None:
    pointer = JobPointer("resnet-1a2b3c4d", "2026-12-06T10:00:00Z", "old-12345678")
    assert JobPointer.from_json(pointer.to_json()) == pointer
    assert JobPointer.from_json({"job_id": "x"}) == JobPointer("x")
    for raw in (None, {}, {"job_id": 7}, ["job_id"]):
        assert JobPointer.from_json(raw) is None


def test_a_run_slot_names_a_job_or_is_free() -> None:
    slot = RunSlot("resnet-1a2b3c4d", "2026-12-06T10:00:00.000Z")
    assert slot.to_json() == {"job_id": "resnet-1a2b3c4d", "since": "2026-12-06T10:00:00.000Z"}
    assert RunSlot.from_json(slot.to_json()) == slot
    assert RunSlot.from_json({"job_id": "x", "since": 5}) == RunSlot("x", None)
    for raw in (None, {}, {"job_id": ""}, {"job_id": 7}, ["job_id"], "x"):
        assert RunSlot.from_json(raw) is None


# -- one definition ---------------------------------------------------------------------------------


def _sources() -> list[Path]:
    return [
        path
        for part in PARTS
        for path in sorted((ROOT / part).rglob("*.py"))
        if "__pycache__" not in path.parts and path != HOME
    ]


def _status_named(node: ast.expr) -> object:
    """The status value a `JobStatus.X` or a string constant names (None for anything else)."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "JobStatus":
        return node.attr.lower()
    return node.value if isinstance(node, ast.Constant) else None


def _second_definitions(path: Path) -> list[str]:
    """What only records.py may define: the conflict codes, the write condition, the ended statuses, the
    lease and standby records, the current-job pointer's body."""
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and node.value in (
            "PreconditionFailed",
            "ConditionalRequestConflict",
        ):
            found.append(f"{where}:{node.lineno}: S3's conflict codes (use records.is_conflict)")
        if isinstance(node, ast.Dict) and any(
            isinstance(key, ast.Constant) and key.value in ("IfMatch", "IfNoneMatch") for key in node.keys
        ):
            found.append(f"{where}:{node.lineno}: a write condition (use records.write_condition)")
        if isinstance(node, ast.ClassDef) and node.name in {
            "LeaseState",
            "StandbyState",
            "Ledger",
            "JobPointer",
            "RunSlot",
        }:
            found.append(f"{where}:{node.lineno}: class {node.name} (records.py defines it)")
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and "ENDED" in target.id and "STATUSES" in target.id:
                    found.append(f"{where}:{node.lineno}: {target.id} (records.ENDED_STATUSES is the one)")
        if isinstance(node, ast.Set | ast.Tuple | ast.List):
            # A set of ended statuses written out again (by member or by value). Four: AWS FIS's experiment
            # states share three of their names (trainstack/drill.py); no other set of job statuses has four.
            named = {_status_named(element) for element in node.elts}
            if len(named & ENDED_VALUES) >= 4:
                found.append(f"{where}:{node.lineno}: a set of ended statuses (use records.ENDED_STATUSES)")
        if isinstance(node, ast.FunctionDef) and node.name.lstrip("_") in {
            "is_conflict",
            "conflict",
            "missing",
        }:
            found.append(f"{where}:{node.lineno}: def {node.name} (records.py defines it)")
    return found


def test_no_second_definition_of_a_record_or_the_conditional_write() -> None:
    found = [line for path in _sources() for line in _second_definitions(path)]
    assert not found, "defined outside trainstack_job/records.py:\n" + "\n".join(found)


def test_the_guard_sees_a_second_definition(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text(
        "ENDED_JOB_STATUSES = ('completed',)\n"
        "def _conflict(e): return e in {'PreconditionFailed'}\n"
        "condition = {'IfMatch': 'x'}\n"
        "DONE = {JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.STOPPED, JobStatus.NO_DATA}\n"
        "over = ('completed', 'cost_cap', 'cancelled', 'failed')\n"
    )
    found = _second_definitions(planted)
    assert len(found) == 6, found


def test_records_load_only_the_standard_library() -> None:
    tree = ast.parse(HOME.read_text())
    imported = {
        (node.module or "").split(".")[0] if isinstance(node, ast.ImportFrom) else alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert imported - set(sys.stdlib_module_names) - {"__future__"} == {"trainstack_job"}


# -- time to first step and data wait (issue 35) ------------------------------------------------------


def test_a_life_with_its_first_step_and_data_wait_round_trips_and_an_old_life_reads_without_them() -> None:
    measured = {
        **LIFE,
        "first_step_seconds": 42.125,
        "data_wait_fraction": 0.125,
        "data_wait_reports": 3,
        "data_wait_step": 300,
    }
    life = Life.from_json(json.loads(json.dumps(measured)))
    assert life is not None
    assert (life.first_step_seconds, life.data_wait_fraction) == (42.125, 0.125)
    assert (life.data_wait_reports, life.data_wait_step) == (3, 300)
    assert life.to_json() == measured and not life.extra.keys() & measured.keys() - LIFE.keys()
    old = Life.from_json(LIFE)
    assert old is not None
    assert (old.first_step_seconds, old.data_wait_fraction, old.data_wait_reports, old.data_wait_step) == (
        None,
    ) * 4
    written = old.to_json()
    for unknown in ("first_step_seconds", "data_wait_fraction", "data_wait_reports", "data_wait_step"):
        assert unknown not in written, f"{unknown}: absent until measured, never 0 or null"


def test_a_first_step_or_data_wait_of_the_wrong_type_reads_as_unknown() -> None:
    odd = Life.from_json(
        {
            **LIFE,
            "first_step_seconds": "soon",
            "data_wait_fraction": True,
            "data_wait_reports": 2.5,
            "data_wait_step": "300",
        }
    )
    assert odd is not None
    assert (odd.first_step_seconds, odd.data_wait_fraction, odd.data_wait_reports, odd.data_wait_step) == (
        None,
    ) * 4
    zero = Life.from_json({**LIFE, "first_step_seconds": 0, "data_wait_fraction": 0})
    assert zero is not None and (zero.first_step_seconds, zero.data_wait_fraction) == (0.0, 0.0)
    assert zero.to_json()["first_step_seconds"] == 0.0, "a measured 0 is kept, unlike an unknown"


def test_progress_carries_the_first_step_of_its_process(monkeypatch: pytest.MonkeyPatch) -> None:
    # One spelling for every writer (the trainer, the helper): UTC, milliseconds, Z.
    from trainstack_job.records import first_step_stamp

    moment = datetime(2026, 12, 6, 11, 0, 42, 125_999, tzinfo=timezone(timedelta(hours=1)))
    assert first_step_stamp(moment) == "2026-12-06T10:00:42.125Z"
    # Whatever the machine's own zone (a workstation's is rarely UTC).
    import time

    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        assert first_step_stamp(moment) == "2026-12-06T10:00:42.125Z"
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
    raw = {"step": 10, "total_steps": 100, "first_step_at": "2026-12-06T10:00:42.125Z"}
    progress = Progress.from_json(raw)
    assert progress is not None and progress.first_step_at == "2026-12-06T10:00:42.125Z"
    assert progress.extra == {} and progress.to_json() == raw
    assert "first_step_at" not in Progress(step=10).to_json(), "a job that does not say writes nothing"
    odd = Progress.from_json({"step": 10, "first_step_at": 1765015242})
    assert odd is not None and odd.first_step_at is None
