"""Jobs in the CLI: the current job, `--job`, each job's own prefixes and log streams, `trainstack jobs`."""

from __future__ import annotations

import json
import re
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import ANY, Stubber

from trainstack.aws import Clients
from trainstack.stack import StackOutputs
from trainstack.state import current_job_id

from .conftest import BUCKET, LOG_GROUP, REGION, Deployed

OLD = "resnet-11111111"
NEW = "vit-22222222"
DEFINED = "vit-33333333"


def _put(deployed: Deployed, key: str, document: dict[str, Any]) -> None:
    deployed.s3().put_object(Bucket=BUCKET, Key=key, Body=json.dumps(document).encode())


def _define(deployed: Deployed, job_id: str | None) -> None:
    """The outputs of a `pulumi up` that defined `job_id` (None: a stack deployed before jobs)."""
    outputs = dict(deployed.outputs, jobs_prefix="jobs/")
    if job_id is not None:
        outputs["job_id"] = job_id
    deployed.outputs_file.write_text(json.dumps(outputs), encoding="utf-8")


def _job(deployed: Deployed, job_id: str, *, status: str, step: int, cost: float, age_h: float) -> None:
    created = (datetime.now(timezone.utc) - timedelta(hours=age_h)).isoformat()
    root = f"jobs/{job_id}/"
    _put(
        deployed,
        root + "job.json",
        {"job_id": job_id, "name": job_id.rsplit("-", 1)[0], "created_at": created},
    )
    _put(deployed, root + "state/ledger.json", {"status": status, "lives": [], "total_cost_usd": cost})
    _put(deployed, root + "state/progress.json", {"step": step, "total_steps": 1000})
    _put(deployed, root + "checkpoints/latest.json", {"step": step, "epoch": 1, "dir": f"step-{step}"})


def _current(deployed: Deployed, job_id: str) -> None:
    _put(deployed, "state/current-job.json", {"job_id": job_id, "since": "2026-01-01T00:00:00+00:00"})


def _resolve(deployed: Deployed) -> str:
    outputs = StackOutputs(json.loads(deployed.outputs_file.read_text()), "test")
    return current_job_id(Clients(REGION), outputs)


def test_the_current_job_is_the_pointer_else_the_legacy_ledger_else_the_defined_job(deployed: Deployed):
    _define(deployed, None)
    assert _resolve(deployed) == "legacy", "a stack deployed before jobs"
    _define(deployed, DEFINED)
    assert _resolve(deployed) == DEFINED, "nothing started yet: the job `pulumi up` defined"
    deployed.put_state("ledger.json", {"status": "running", "lives": []})
    assert _resolve(deployed) == "legacy", "a ledger at state/ and no pointer: the job from before jobs"
    _current(deployed, NEW)
    assert _resolve(deployed) == NEW


def test_a_pointer_naming_no_job_id_is_one_line_with_the_fix(deployed: Deployed):
    _current(deployed, "../../etc")
    result = deployed.run("status")
    assert result.code == 1 and result.err.count("\n") == 1
    assert "s3://trainstack-test-data/state/current-job.json names '../../etc', not a job id" in result.err
    assert "`trainstack jobs` lists them" in result.err


def test_status_reads_the_current_jobs_prefixes_and_names_it(deployed: Deployed):
    _define(deployed, NEW)
    _job(deployed, OLD, status="completed", step=1000, cost=4.0, age_h=30)
    _job(deployed, NEW, status="running", step=120, cost=0.5, age_h=1)
    _current(deployed, NEW)

    report = deployed.run("status", "--json").json()
    assert (report["job"], report["status"], report["progress"]["step"], report["checkpoint"]["step"]) == (
        NEW,
        "running",
        120,
        120,
    )
    human = deployed.run("status")
    assert f"job {NEW}: training running" in human.out

    older = deployed.run("status", "--json", "--job", OLD).json()
    assert (older["job"], older["status"], older["checkpoint"]["step"]) == (OLD, "completed", 1000)


def test_status_of_the_legacy_job_reads_the_old_prefixes(deployed: Deployed):
    _define(deployed, DEFINED)
    deployed.put_state("ledger.json", {"status": "stopped", "lives": []})
    deployed.s3().put_object(Bucket=BUCKET, Key="checkpoints/latest.json", Body=json.dumps({"step": 7}))
    report = deployed.run("status", "--json").json()
    assert (report["job"], report["status"], report["checkpoint"]["step"]) == ("legacy", "stopped", 7)
    assert deployed.run("status", "--json", "--job", "legacy").json()["job"] == "legacy"


@pytest.mark.parametrize(
    ("job", "expected"),
    [
        (
            "foo-12345678",
            "--job foo-12345678: no such job in s3://trainstack-test-data/jobs/; `trainstack jobs`",
        ),
        ("Foo Bar", "--job Foo Bar: 'Foo Bar' is not a job id"),
        ("legacy", "--job legacy: s3://trainstack-test-data holds no job from before jobs"),
    ],
)
def test_an_unknown_job_is_one_line_naming_it_and_the_fix(deployed: Deployed, job: str, expected: str):
    _define(deployed, DEFINED)
    for argv in (("status",), ("logs",), ("results", "pull")):
        result = deployed.run(*argv, "--job", job)
        assert result.code == 1, argv
        assert result.err.count("\n") == 1, argv
        assert expected in result.err, (argv, result.err)


def test_the_defined_job_is_known_before_an_instance_writes_anything(deployed: Deployed):
    _define(deployed, DEFINED)
    report = deployed.run("status", "--json", "--job", DEFINED).json()
    assert (report["job"], report["status"], report["checkpoint"]) == (DEFINED, "not started", None)


def test_results_pull_takes_the_jobs_own_results(deployed: Deployed, tmp_path: Path):
    _define(deployed, NEW)
    _job(deployed, OLD, status="completed", step=1000, cost=4.0, age_h=30)
    _job(deployed, NEW, status="running", step=120, cost=0.5, age_h=1)
    _current(deployed, NEW)
    s3 = deployed.s3()
    s3.put_object(Bucket=BUCKET, Key=f"jobs/{OLD}/results/metrics.json", Body=b'{"acc": 0.9}')
    s3.put_object(Bucket=BUCKET, Key="results/metrics.json", Body=b'{"acc": 0.1}')

    current = deployed.run("results", "pull", str(tmp_path / "now"))
    assert current.code == 1 and current.err.count("\n") == 1
    assert (
        f"no results yet in s3://{BUCKET}/jobs/{NEW}/results/ (job {NEW}: training is running)" in current.err
    )

    pulled = deployed.run("results", "pull", str(tmp_path / "old"), "--job", OLD, "--json").json()
    assert (pulled["job"], pulled["source"]) == (OLD, f"s3://{BUCKET}/jobs/{OLD}/results/")
    assert json.loads((tmp_path / "old" / "metrics.json").read_text()) == {"acc": 0.9}


def _log(stream: str, message: str) -> None:
    logs = boto3.client("logs", region_name=REGION)
    logs.create_log_stream(logGroupName=LOG_GROUP, logStreamName=stream)
    logs.put_log_events(
        logGroupName=LOG_GROUP,
        logStreamName=stream,
        logEvents=[{"timestamp": int(time.time() * 1000) - 1000, "message": message}],
    )


def test_logs_show_the_jobs_own_streams(deployed: Deployed):
    _define(deployed, NEW)
    _job(deployed, OLD, status="completed", step=1000, cost=4.0, age_h=30)
    _current(deployed, NEW)
    _log("i-aaa/agent", "legacy agent")
    _log(f"{OLD}/i-bbb/agent", "old job")
    _log(f"{NEW}/i-ccc/trainer", "new job")

    def streams(*argv: str) -> list[str]:
        result = deployed.run("logs", "--json", *argv)
        assert result.code == 0, result.err
        return [json.loads(line)["stream"] for line in result.out.splitlines()]

    assert streams() == [f"{NEW}/i-ccc/trainer"]
    assert streams("--job", OLD) == [f"{OLD}/i-bbb/agent"]
    assert streams("--job", OLD, "--stream", "i-ccc") == []
    deployed.put_state("ledger.json", {"status": "completed", "lives": []})
    assert streams("--job", "legacy") == ["i-aaa/agent"]


def test_logs_ask_cloudwatch_for_the_jobs_stream_prefix(deployed: Deployed):
    # FAKE at the client boundary: moto ignores logStreamNamePrefix; the stub checks the request.
    _define(deployed, NEW)
    logs = boto3.client("logs", region_name=REGION)
    stub = Stubber(logs)
    stub.add_response(
        "filter_log_events",
        {"events": []},
        {"logGroupName": LOG_GROUP, "startTime": ANY, "logStreamNamePrefix": f"{NEW}/i-ccc"},
    )
    stub.activate()
    result = deployed.run("logs", "--stream", "i-ccc", clients=Clients(None, overrides={"logs": logs}))
    assert result.code == 0, result.err
    stub.assert_no_pending_responses()


def test_stop_and_resume_act_on_the_current_jobs_control(deployed: Deployed):
    _define(deployed, DEFINED)
    _job(deployed, NEW, status="running", step=120, cost=0.5, age_h=1)
    _current(deployed, NEW)

    stopped = deployed.run("stop", "--json").json()
    assert (stopped["job"], stopped["control"]) == (NEW, f"s3://{BUCKET}/jobs/{NEW}/state/control.json")
    body = deployed.s3().get_object(Bucket=BUCKET, Key=f"jobs/{NEW}/state/control.json")["Body"].read()
    assert json.loads(body)["action"] == "stop"
    assert "Contents" not in deployed.s3().list_objects_v2(Bucket=BUCKET, Prefix="state/control.json")
    assert deployed.run("status", "--json").json()["stop_requested"] is True

    resumed = deployed.run("resume", "--json").json()
    assert resumed["job"] == NEW
    assert "Contents" not in deployed.s3().list_objects_v2(
        Bucket=BUCKET, Prefix=f"jobs/{NEW}/state/control.json"
    )


def test_resume_after_the_current_job_ended_says_the_defined_job_starts(deployed: Deployed):
    _define(deployed, DEFINED)
    _job(deployed, NEW, status="completed", step=1000, cost=1.0, age_h=1)
    _current(deployed, NEW)
    result = deployed.run("resume")
    assert result.code == 0, result.err
    assert f"job {NEW} has ended (completed): the new instance starts the stack's job {DEFINED}" in result.out


def test_jobs_lists_every_job_with_status_step_cost_age_and_the_current_one(deployed: Deployed):
    _define(deployed, DEFINED)
    _job(deployed, OLD, status="completed", step=1000, cost=4.0, age_h=30)
    _job(deployed, NEW, status="running", step=120, cost=0.5, age_h=1)
    _current(deployed, NEW)
    deployed.put_state("ledger.json", {"status": "completed", "total_cost_usd": 9.0, "lives": [
        {"started_at": (datetime.now(timezone.utc) - timedelta(days=3)).isoformat()}
    ]})  # fmt: skip
    deployed.s3().put_object(Bucket=BUCKET, Key="jobs/not a job/x", Body=b"")

    report = deployed.run("jobs", "--json").json()
    rows = report["jobs"]
    assert [r["job_id"] for r in rows] == ["legacy", OLD, NEW, DEFINED]
    assert [r["current"] for r in rows] == [False, False, True, False]
    assert [r["status"] for r in rows] == ["completed", "completed", "running", "not started"]
    assert [r["step"] for r in rows] == [None, 1000, 120, None]
    assert [r["cost_usd"] for r in rows] == [9.0, 4.0, 0.5, None]
    assert rows[1]["age_s"] == pytest.approx(30 * 3600, abs=120)
    assert (report["current"], report["defined"]) == (NEW, DEFINED)

    table = deployed.run("jobs")
    assert table.code == 0, table.err
    line = next(line for line in table.out.splitlines() if NEW in line)
    assert "*" in line and "running" in line and "120/1000" in line and "$0.50" in line
    # An hour old when written; the minutes it took this machine to get here are not part of the promise.
    assert re.search(r"\b1h 0\dm\b", line), line
    assert f"the stack's default job is {DEFINED}" in table.out


def test_jobs_of_an_empty_stack_says_what_defines_one(deployed: Deployed):
    _define(deployed, None)
    result = deployed.run("jobs")
    assert result.code == 0, result.err
    assert f"no jobs yet in s3://{BUCKET}/jobs/" in result.out


QUEUED_ID = "bert-44444444"
GARBAGE = {
    "queue/garbage.json": b"{not json",
    "queue/empty-55555555.json": b"{}",
    "queue/deep-66666666.json": b"[" * 200_000,
    # Under the entry bound, so the id itself is refused: echoed clipped, not 60,000 characters of it.
    "queue/long-77777777.json": json.dumps({"job_id": "a" * 60_000, "submitted_at": "t"}).encode(),
}


def _queued(deployed: Deployed, job_id: str) -> None:
    """A job `trainstack run` submitted and no instance took yet: its record, then its entry."""
    created = datetime.now(timezone.utc).isoformat()
    _put(deployed, f"jobs/{job_id}/job.json", {"job_id": job_id, "name": "bert", "created_at": created})
    _put(deployed, f"queue/{job_id}.json", {"job_id": job_id, "submitted_at": created})


def _garbage(deployed: Deployed) -> None:
    for key, body in GARBAGE.items():
        deployed.s3().put_object(Bucket=BUCKET, Key=key, Body=body)


def test_jobs_lists_the_good_jobs_and_names_each_bad_queue_object_on_its_own_line(deployed: Deployed):
    _define(deployed, DEFINED)
    _job(deployed, OLD, status="completed", step=1000, cost=4.0, age_h=30)
    _queued(deployed, QUEUED_ID)
    _garbage(deployed)

    table = deployed.run("jobs")
    assert table.code == 0, table.err
    assert {OLD, QUEUED_ID, DEFINED} <= set(re.findall(r"[a-z]+-\d{8}", table.out)), table.out
    line = next(line for line in table.out.splitlines() if QUEUED_ID in line)
    assert "queued #1" in line, "bad objects take no place in the queue"
    assert not any(key in table.out for key in GARBAGE), "stdout stays the table"
    errors = table.err.splitlines()
    assert len(errors) == len(GARBAGE), table.err
    for key, line in zip(sorted(GARBAGE), errors, strict=True):
        assert line.startswith(f"trainstack: error: s3://{BUCKET}/{key} is not a queue entry"), line
        assert "delete it" in line and "`trainstack run`" in line, line
        assert len(line) < 500, len(line)
    assert "more than the 65536 bytes" in errors[0] and "(60000 characters), not a job id" in errors[3]

    report = deployed.run("jobs", "--json")
    assert report.code == 0 and report.err == table.err
    document = report.json()
    assert [row["job_id"] for row in document["jobs"]] == [OLD, QUEUED_ID, DEFINED]
    assert [bad["key"] for bad in document["bad_entries"]] == sorted(GARBAGE)
    assert [bad["error"] for bad in document["bad_entries"]] == [
        line.removeprefix("trainstack: error: ") for line in errors
    ]


def test_a_queued_jobs_place_reads_past_a_bad_queue_object(deployed: Deployed):
    _define(deployed, DEFINED)
    _queued(deployed, QUEUED_ID)
    _garbage(deployed)
    status = deployed.run("status", "--json", "--job", QUEUED_ID)
    assert status.code == 0, status.err
    report = status.json()
    assert report["status"] == "queued", report
    assert f"job {QUEUED_ID} is queued, position 1:" in report["next_step"], report


def test_jobs_with_nothing_but_bad_queue_objects_fails_naming_them(deployed: Deployed):
    _define(deployed, None)
    deployed.s3().put_object(Bucket=BUCKET, Key="queue/garbage.json", Body=b"[]")
    report = deployed.run("jobs", "--json")
    assert report.code == 1 and report.err.count("\n") == 1, report.err
    assert f"s3://{BUCKET}/queue/garbage.json is not a queue entry" in report.err
    assert report.json()["jobs"] == [] and [b["key"] for b in report.json()["bad_entries"]] == [
        "queue/garbage.json"
    ]
