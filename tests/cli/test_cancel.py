"""`trainstack cancel ID` against the moto stack: the cancel request written for a queued or running job only,
encrypted with the stack's key and saying who asked and when; a queued one never runs, a running one
checkpoints first; a pool woken for nothing but cancelled jobs goes back to zero at once, and only then."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from trainstack_job.queue import SOURCE_RUN, job_record, queue_entry, queue_key

from .conftest import BUCKET, GROUP, Deployed, create_group

BIG = f"{GROUP}-big"
AT = "2026-12-06T12:00:00.000000Z"


def _job(deployed: Deployed, job_id: str, *, pool: str = "", queued: bool = True) -> str:
    """A job as `trainstack run` leaves it: its record, and its queue entry unless `queued` is off."""
    record = job_record(
        job_id=job_id, name=job_id[:-9], agent={}, submitted_at=AT, source=SOURCE_RUN, pool=pool
    )
    s3 = deployed.s3()
    s3.put_object(Bucket=BUCKET, Key=f"jobs/{job_id}/job.json", Body=json.dumps(record).encode())
    if queued:
        entry = queue_entry(job_id, AT, pool=pool)
        s3.put_object(Bucket=BUCKET, Key=queue_key(job_id), Body=json.dumps(entry).encode())
    return job_id


def _ledger(deployed: Deployed, job_id: str, status: str) -> None:
    ledger = {"job_id": job_id, "status": status, "lives": []}
    deployed.s3().put_object(
        Bucket=BUCKET, Key=f"jobs/{job_id}/state/ledger.json", Body=json.dumps(ledger).encode()
    )


def _desired(deployed: Deployed, group: str = GROUP) -> int:
    found = deployed.autoscaling().describe_auto_scaling_groups(AutoScalingGroupNames=[group])
    return int(found["AutoScalingGroups"][0]["DesiredCapacity"])


def _wake(deployed: Deployed, desired: int, group: str = GROUP) -> None:
    deployed.autoscaling().update_auto_scaling_group(AutoScalingGroupName=group, DesiredCapacity=desired)


def _cancel(deployed: Deployed, job_id: str) -> dict[str, Any]:
    result = deployed.run("cancel", job_id, "--json")
    assert result.code == 0, result.err
    return dict(result.json())


def _requests(deployed: Deployed) -> list[str]:
    listed = deployed.s3().list_objects_v2(Bucket=BUCKET, Prefix="jobs/").get("Contents", [])
    return [item["Key"] for item in listed if item["Key"].endswith("/cancel.json")]


def test_a_queued_jobs_cancel_request_is_encrypted_and_says_who_asked_and_when(deployed: Deployed) -> None:
    """A queued job's request is written under its state, with the stack's key; the job is cancelled."""
    job_id = _job(deployed, "tiny-1a2b3c4d")
    before = datetime.now(timezone.utc).replace(microsecond=0)
    result = _cancel(deployed, job_id)
    key = f"jobs/{job_id}/state/cancel.json"
    assert result == {
        "job": job_id,
        "was": "queued",
        "status": "cancelled",
        "request": f"s3://{BUCKET}/{key}",
        "stops_after_checkpoint": False,
        "scaled_to_zero_now": False,
    }
    stored = deployed.s3().get_object(Bucket=BUCKET, Key=key)
    assert stored["ContentType"] == "application/json"
    assert (stored["ServerSideEncryption"], stored["SSEKMSKeyId"]) == ("aws:kms", deployed.kms_key_arn)
    request = json.loads(stored["Body"].read())
    assert request["by"] == "trainstack cancel"
    asked = datetime.fromisoformat(request["requested_at"])
    assert asked.utcoffset() == timedelta(0) and before <= asked <= datetime.now(timezone.utc)
    assert request["requested_at"] == asked.isoformat(timespec="seconds")
    rows = {row["job_id"]: row for row in deployed.run("jobs", "--json").json()["jobs"]}
    assert rows[job_id]["status"] == "cancelled"


def test_a_queued_jobs_cancel_says_it_leaves_the_queue(deployed: Deployed) -> None:
    """The human line: a queued job leaves the queue and never runs; a group already asleep stays so."""
    job_id = _job(deployed, "tiny-1a2b3c4d")
    result = deployed.run("cancel", job_id)
    assert result.code == 0 and result.err == ""
    assert result.out.strip() == f"cancelled job {job_id}: it leaves the queue and will never run"
    assert _desired(deployed) == 0


def test_a_job_whose_entry_was_never_written_is_cancelled_too(deployed: Deployed) -> None:
    """A record without its entry (a submission cut short) is a job not started: it is withdrawn for good."""
    job_id = _job(deployed, "tiny-1a2b3c4d", queued=False)
    result = _cancel(deployed, job_id)
    assert (result["was"], result["status"], result["stops_after_checkpoint"]) == (
        "not started",
        "cancelled",
        False,
    )
    assert _requests(deployed) == [f"jobs/{job_id}/state/cancel.json"]


@pytest.mark.parametrize("status", ["running", "waiting_for_data"])
def test_a_running_jobs_cancel_asks_its_agent_to_checkpoint_and_keeps_its_group(
    deployed: Deployed, status: str
) -> None:
    """A job an instance took stops after its checkpoint: its status stays until its agent ends it."""
    job_id = _job(deployed, "tiny-1a2b3c4d")
    _ledger(deployed, job_id, status)
    _wake(deployed, 1)
    result = _cancel(deployed, job_id)
    assert (result["was"], result["status"]) == (status, status)
    assert result["stops_after_checkpoint"] is True and result["scaled_to_zero_now"] is False
    assert _requests(deployed) == [f"jobs/{job_id}/state/cancel.json"] and _desired(deployed) == 1
    line = deployed.run("cancel", job_id).out.strip()
    assert line == (
        f"cancel requested for job {job_id} ({status}): its agent checkpoints, then stops it (status "
        f"cancelled); `trainstack status --job {job_id}` shows when"
    )


@pytest.mark.parametrize(
    ("job_id", "said"),
    [
        ("legacy", "cancel legacy: the job from before jobs has no queue; `trainstack stop` checkpoints it"),
        ("Tiny_1", "cancel Tiny_1: "),
        (
            "nope-12345678",
            f"cancel nope-12345678: no such job in s3://{BUCKET}; `trainstack jobs` lists them",
        ),
    ],
)
def test_a_job_that_cannot_be_cancelled_is_one_line_and_nothing_is_written(
    deployed: Deployed, job_id: str, said: str
) -> None:
    """The legacy job, a malformed id and an unknown job are refused in one line, with no request left."""
    result = deployed.run("cancel", job_id)
    assert result.code == 1 and result.err.count("\n") == 1 and said in result.err, result.err
    assert "Traceback" not in result.err and _keys(deployed) == []


@pytest.mark.parametrize("status", ["completed", "failed", "cancelled", "stopped"])
def test_an_ended_job_is_not_cancelled_again(deployed: Deployed, status: str) -> None:
    """A job that is over has nothing to cancel: one line saying how it ended, no request written."""
    job_id = _job(deployed, "tiny-1a2b3c4d")
    _ledger(deployed, job_id, status)
    result = deployed.run("cancel", job_id)
    assert result.code == 1
    assert f"cancel {job_id}: the job is already {status}; nothing to cancel" in result.err
    assert _requests(deployed) == []


def _keys(deployed: Deployed) -> list[str]:
    listed = deployed.s3().list_objects_v2(Bucket=BUCKET).get("Contents", [])
    return [item["Key"] for item in listed]


# -- a pool woken for nothing but cancelled jobs goes back to zero ---------------------------------------


@pytest.mark.parametrize("desired", [1, 2])
def test_cancelling_the_only_waiting_job_puts_its_group_back_to_zero(
    deployed: Deployed, desired: int
) -> None:
    """Nothing else waits or trains: the group that woke for the job is at zero now, and the line says so."""
    job_id = _job(deployed, "tiny-1a2b3c4d")
    _wake(deployed, desired)
    result = deployed.run("cancel", job_id)
    assert result.code == 0, result.err
    assert result.out.strip() == (
        f"cancelled job {job_id}: it leaves the queue and will never run; nothing else is queued, so the "
        "group is back at zero"
    )
    assert _desired(deployed) == 0


def test_another_waiting_job_keeps_the_group_up_and_a_cancelled_or_damaged_one_does_not(
    deployed: Deployed,
) -> None:
    """Another job still waiting keeps the group; one cancelled before, or a damaged entry, does not."""
    first, second = _job(deployed, "first-1a2b3c4d"), _job(deployed, "second-1a2b3c4d")
    _wake(deployed, 2)
    assert _cancel(deployed, first)["scaled_to_zero_now"] is False and _desired(deployed) == 2
    deployed.s3().put_object(Bucket=BUCKET, Key="queue/x-12345678.json", Body=b"{not json")
    assert _cancel(deployed, second)["scaled_to_zero_now"] is True and _desired(deployed) == 0


def test_a_job_another_instance_took_keeps_the_group_up_only_while_it_trains(deployed: Deployed) -> None:
    """The pool's current job training or waiting for its data keeps the group; once it ended, it does not."""
    deployed.put_state("current-job.json", {"job_id": "other-1a2b3c4d"})
    for status, kept in (("running", True), ("waiting_for_data", True), ("completed", False)):
        job_id = _job(deployed, f"tiny-{status[:4]}5678")
        _ledger(deployed, "other-1a2b3c4d", status)
        _wake(deployed, 1)
        assert _cancel(deployed, job_id)["scaled_to_zero_now"] is not kept, status
        assert _desired(deployed) == (1 if kept else 0), status


def test_a_stack_from_before_jobs_keeps_its_group_while_its_legacy_job_trains(deployed: Deployed) -> None:
    """Without a current-job pointer the stack's own job is the one training: while it runs, no zero."""
    deployed.put_state("ledger.json", {"status": "running", "lives": []})
    _wake(deployed, 1)
    assert _cancel(deployed, _job(deployed, "tiny-1a2b3c4d"))["scaled_to_zero_now"] is False
    assert _desired(deployed) == 1
    deployed.put_state("ledger.json", {"status": "completed", "lives": []})
    assert _cancel(deployed, _job(deployed, "tiny-2a2b3c4d"))["scaled_to_zero_now"] is True
    assert _desired(deployed) == 0


@pytest.fixture()
def pooled(deployed: Deployed) -> Deployed:
    """The stack with a second pool, `big`, listed before the default `small` one; both groups awake."""
    create_group(BIG, instance_type="p4d.24xlarge", max_size=3)
    small = {"group_name": GROUP, "instance_types": ["g6.xlarge"], "max_instances": 2, "default": True}
    big = {"group_name": BIG, "instance_types": ["p4d.24xlarge"], "max_instances": 2, "default": False}
    deployed.outputs["pools"] = {"big": big, "small": small}
    deployed.outputs_file.write_text(json.dumps(deployed.outputs), encoding="utf-8")
    _wake(deployed, 1)
    _wake(deployed, 1, BIG)
    return deployed


def test_only_the_cancelled_jobs_own_pool_goes_to_zero(pooled: Deployed) -> None:
    """A job's pool is its record's: its group alone is zeroed, whatever waits in the other pool."""
    _job(pooled, "wide-1a2b3c4d", pool="big")
    small = _job(pooled, "tiny-1a2b3c4d")
    assert _cancel(pooled, small)["scaled_to_zero_now"] is True
    assert (_desired(pooled), _desired(pooled, BIG)) == (0, 1), "the default pool's group, not the first's"
    _wake(pooled, 1)
    _job(pooled, "tiny-2a2b3c4d")
    assert _cancel(pooled, "wide-1a2b3c4d")["scaled_to_zero_now"] is True
    assert (_desired(pooled), _desired(pooled, BIG)) == (1, 0)


def test_a_pool_running_several_jobs_goes_to_zero_only_with_every_lane_free(pooled: Deployed) -> None:
    """A pool of lanes stays up while any lane's job trains, and goes to zero once none does."""
    pooled.outputs["pools"]["small"]["max_jobs"] = 2
    pooled.outputs_file.write_text(json.dumps(pooled.outputs), encoding="utf-8")
    pooled.put_state("current-job-lane1.json", {"job_id": "other-1a2b3c4d"})
    _ledger(pooled, "other-1a2b3c4d", "running")
    assert _cancel(pooled, _job(pooled, "tiny-1a2b3c4d"))["scaled_to_zero_now"] is False
    assert _desired(pooled) == 1
    _ledger(pooled, "other-1a2b3c4d", "completed")
    assert _cancel(pooled, _job(pooled, "tiny-2a2b3c4d"))["scaled_to_zero_now"] is True
    assert (_desired(pooled), _desired(pooled, BIG)) == (0, 1)


def test_a_single_job_pool_is_kept_up_by_its_own_pointers_running_job_not_the_default_pools(
    pooled: Deployed,
) -> None:
    """`big` trains the job its own pointer names while the default pool's names none: cancelling another
    of big's jobs must leave big's group up (read through the default pool's pointer, it would stop a
    training instance)."""
    pooled.put_state("current-job-big.json", {"job_id": "wide-1a2b3c4d"})
    _ledger(pooled, "wide-1a2b3c4d", "running")
    assert _cancel(pooled, _job(pooled, "next-1a2b3c4d", pool="big"))["scaled_to_zero_now"] is False
    assert _desired(pooled, BIG) == 1
    _ledger(pooled, "wide-1a2b3c4d", "completed")
    assert _cancel(pooled, _job(pooled, "last-1a2b3c4d", pool="big"))["scaled_to_zero_now"] is True
    assert (_desired(pooled), _desired(pooled, BIG)) == (1, 0)
