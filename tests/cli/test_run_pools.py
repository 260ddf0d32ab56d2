"""`trainstack run` on a stack with pools: a job asks for a pool or for GPUs, is matched to the pool that
serves it (its record and queue entry say which, and only that pool's group wakes), and a request no pool
serves is refused at submit in one line that names every pool and what it offers."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError

from trainstack.jobs import WaitingReasons
from trainstack.state import read_drought

from .conftest import BUCKET, GROUP, REGION, REPO, Deployed, create_group

CONFIG = REPO / "training" / "configs" / "default.yaml"
BIG = f"{GROUP}-big"


@pytest.fixture()
def pooled(deployed: Deployed) -> Deployed:
    """The deployed stack with a second pool, `big` (8x A100 instances, at zero), in its `pools` output."""
    create_group(BIG, instance_type="p4d.24xlarge", max_size=3)
    small = {"group_name": GROUP, "instance_types": ["g6.xlarge", "g5.xlarge"], "max_instances": 2}
    big = {"group_name": BIG, "instance_types": ["p4d.24xlarge"], "max_instances": 2}
    pools = {"small": {**small, "default": True}, "big": {**big, "default": False}}
    deployed.outputs["pools"] = pools
    deployed.outputs_file.write_text(json.dumps(deployed.outputs), encoding="utf-8")
    return deployed


def _desired(name: str) -> int:
    group = boto3.client("autoscaling", region_name=REGION).describe_auto_scaling_groups(
        AutoScalingGroupNames=[name]
    )["AutoScalingGroups"][0]
    return int(group["DesiredCapacity"])


def _get(deployed: Deployed, key: str) -> dict[str, Any]:
    return dict(json.loads(deployed.s3().get_object(Bucket=BUCKET, Key=key)["Body"].read()))


def _queued(deployed: Deployed) -> list[str]:
    listed = deployed.s3().list_objects_v2(Bucket=BUCKET, Prefix="queue/")
    return [item["Key"] for item in listed.get("Contents", [])]


def test_a_job_asking_for_gpus_only_one_pool_has_goes_there_and_wakes_only_that_group(
    pooled: Deployed,
) -> None:
    result = pooled.run("run", "--config", str(CONFIG), "--gpus", "A100:8", "--instances", "2", "--json")
    assert result.code == 0, result.err
    submitted = result.json()
    assert submitted["pool"] == "big" and submitted["group"] == BIG
    job_id = submitted["jobs"][0]["job_id"]
    record = _get(pooled, f"jobs/{job_id}/job.json")
    assert record["pool"] == "big" and record["resources"] == {"gpus": "A100:8", "instances": 2}
    assert _get(pooled, f"queue/{job_id}.json")["pool"] == "big", "only big's instances take it"
    assert (_desired(BIG), _desired(GROUP)) == (2, 0)


def test_a_job_that_asks_for_nothing_goes_to_the_default_pool_as_before_pools(pooled: Deployed) -> None:
    submitted = pooled.run("run", "--config", str(CONFIG), "--json").json()
    job_id = submitted["jobs"][0]["job_id"]
    assert submitted["pool"] == "small" and submitted["group"] == GROUP
    assert "pool" not in _get(pooled, f"queue/{job_id}.json"), "an entry of the default pool is as it was"
    assert _get(pooled, f"jobs/{job_id}/job.json")["pool"] == ""


def test_a_request_no_pool_serves_is_refused_in_one_line_and_nothing_is_queued(pooled: Deployed) -> None:
    result = pooled.run("run", "--config", str(CONFIG), "--gpus", "H100:8", "--detach")
    assert result.code == 1
    (line,) = [line for line in result.err.splitlines() if line.strip()]
    assert "no pool serves 8x H100 per instance" in line
    assert "small offers 1x L4 24 GiB (g6.xlarge), 1x A10G 24 GiB (g5.xlarge), up to 2 instances" in line
    assert "big offers 8x A100" in line and "trainstack:pools" in line
    assert _queued(pooled) == [] and (_desired(BIG), _desired(GROUP)) == (0, 0)


def test_a_job_files_resources_choose_its_pool_and_a_bad_one_is_named(
    pooled: Deployed, tmp_path: Path
) -> None:
    folder = tmp_path / "big-job"
    folder.mkdir()
    (folder / "train.py").write_text("print('hi')\n", encoding="utf-8")
    job_file = folder / "job.yaml"
    job_file.write_text(
        "name: wide\ncommand: [python, train.py]\nresources: {gpus: 'A100:8', min_gpu_memory_gb: 40}\n",
        encoding="utf-8",
    )
    submitted = pooled.run("run", str(job_file), "--json").json()
    assert submitted["pool"] == "big"
    job_file.write_text(
        "name: wide\ncommand: [python, train.py]\nresources: {gpus: 'L4:x'}\n", encoding="utf-8"
    )
    result = pooled.run("run", str(job_file), "--detach")
    assert result.code == 1 and f"{job_file}: resources.gpus: 'L4:x' is not a GPU request" in result.err


def test_a_stack_from_before_pools_is_one_pool_described_by_its_outputs(deployed: Deployed) -> None:
    result = deployed.run("run", "--config", str(CONFIG), "--pool", "gpu-big", "--detach")
    assert result.code == 1 and "no pool named 'gpu-big' in this stack (default offers 1x L4" in result.err


def _lanes(pooled: Deployed, max_jobs: int) -> None:
    """The `small` pool runs `max_jobs` jobs at once (its group room for each and its standby)."""
    pooled.outputs["pools"]["small"] |= {"max_jobs": max_jobs, "max_instances": 1}
    pooled.outputs["instance_count"] = 1  # a pool of several lanes trains one-instance jobs
    pooled.outputs_file.write_text(json.dumps(pooled.outputs), encoding="utf-8")
    boto3.client("autoscaling", region_name=REGION).update_auto_scaling_group(
        AutoScalingGroupName=GROUP, MaxSize=2 * max_jobs, DesiredCapacity=1
    )


def _running(pooled: Deployed, pointer: str, job_id: str) -> None:
    s3 = pooled.s3()
    s3.put_object(Bucket=BUCKET, Key=f"state/{pointer}", Body=json.dumps({"job_id": job_id}).encode())
    ledger = {"job_id": job_id, "status": "running", "lives": []}
    s3.put_object(Bucket=BUCKET, Key=f"jobs/{job_id}/state/ledger.json", Body=json.dumps(ledger).encode())


def test_a_job_starts_beside_the_others_while_its_pool_has_a_free_lane(pooled: Deployed) -> None:
    _lanes(pooled, 2)
    _running(pooled, "current-job.json", "first-aaaaaaaa")
    submitted = pooled.run("run", "--config", str(CONFIG), "--json").json()
    assert submitted["scaled_up_to"] == 2 and _desired(GROUP) == 2, "lane 1 was free: one more instance"
    # Both lanes busy now: the next job waits in the queue, and no instance boots for nothing.
    _running(pooled, "current-job-lane1.json", "second-bbbbbbbb")
    submitted = pooled.run("run", "--config", str(CONFIG), "--json").json()
    assert submitted["scaled_up_to"] is None and _desired(GROUP) == 2


def test_a_sweep_starts_as_many_points_as_the_pool_has_free_lanes(pooled: Deployed) -> None:
    _lanes(pooled, 3)
    _running(pooled, "current-job.json", "first-aaaaaaaa")
    submitted = pooled.run(
        "run", "--config", str(CONFIG), "--sweep", "train.lr=0.1,0.03,0.01", "--json"
    ).json()
    assert len(submitted["jobs"]) == 3
    # Lanes 1 and 2 are free: two points start now beside the running job, the third waits for a lane.
    assert submitted["scaled_up_to"] == 3 and _desired(GROUP) == 3


def test_jobs_says_why_each_waiting_job_waits(pooled: Deployed) -> None:
    _lanes(pooled, 2)
    _running(pooled, "current-job.json", "first-aaaaaaaa")
    beside = pooled.run("run", "--config", str(CONFIG), "--json").json()["jobs"][0]["job_id"]
    _running(pooled, "current-job-lane1.json", "second-bbbbbbbb")
    behind = pooled.run("run", "--config", str(CONFIG), "--json").json()["jobs"][0]["job_id"]
    big = pooled.run("run", "--config", str(CONFIG), "--pool", "big", "--json").json()["jobs"][0]["job_id"]
    rows = {row["job_id"]: row for row in pooled.run("jobs", "--json").json()["jobs"]}
    # Each pool has its own queue: positions count within it.
    assert (rows[beside]["queue_position"], rows[behind]["queue_position"], rows[big]["queue_position"]) == (
        1,
        2,
        1,
    )
    assert rows[behind]["waiting"] == "pool small: 2 of 2 jobs at once running"
    # `big` was at zero and its job woke it: its instance is up (moto launches at once) and takes it next.
    assert rows[big]["pool"] == "big" and rows[big]["waiting"] == "pool big: the next free instance takes it"
    human = pooled.run("jobs").out
    assert "pool small: 2 of 2 jobs at once running" in human


def test_parallel_limits_how_many_sweep_points_start_and_needs_a_sweep(pooled: Deployed) -> None:
    _lanes(pooled, 3)
    alone = pooled.run("run", "--config", str(CONFIG), "--parallel", "2", "--detach")
    assert alone.code == 1 and "--parallel 2: how many points of a --sweep run at once" in alone.err
    submitted = pooled.run(
        "run", "--config", str(CONFIG), "--sweep", "train.lr=0.1,0.03,0.01", "--parallel", "1", "--json"
    ).json()
    # Three lanes free, but the sweep asked for one point at a time: one instance more, not three.
    assert submitted["scaled_up_to"] == 2 and _desired(GROUP) == 2
    record = _get(pooled, f"jobs/{submitted['jobs'][0]['job_id']}/job.json")
    assert record["sweep"]["parallel"] == 1
    prioritized = pooled.run("run", "--config", str(CONFIG), "--priority", "7", "--json").json()
    assert _get(pooled, f"queue/{prioritized['jobs'][0]['job_id']}.json")["priority"] == 7


def test_cancelling_the_last_waiting_job_keeps_a_pool_up_while_another_lane_trains(pooled: Deployed) -> None:
    _lanes(pooled, 2)
    _running(pooled, "current-job-lane1.json", "second-bbbbbbbb")
    job_id = pooled.run("run", "--config", str(CONFIG), "--json").json()["jobs"][0]["job_id"]
    cancelled = pooled.run("cancel", job_id, "--json").json()
    # Lane 1 trains: zeroing the group would take its standby and any idle instance only, but nothing is idle
    # for nothing here; the pool stays as it is.
    assert cancelled["scaled_to_zero_now"] is False and _desired(GROUP) == 2
    # Lane 1's job ends (no other job of the pool runs or waits).
    pooled.put_state("current-job-lane1.json", {"job_id": "third-cccccccc"})
    ledger = {"job_id": "third-cccccccc", "status": "completed", "lives": []}
    pooled.s3().put_object(
        Bucket=BUCKET, Key="jobs/third-cccccccc/state/ledger.json", Body=json.dumps(ledger).encode()
    )
    again = pooled.run("run", "--config", str(CONFIG), "--json").json()["jobs"][0]["job_id"]
    assert pooled.run("cancel", again, "--json").json()["scaled_to_zero_now"] is True, (
        "nothing trains: to zero"
    )
    assert _desired(GROUP) == 0


# -- why a job waits when its pool cannot launch ------------------------------------------------------

NO_SPOT = (
    "Could not launch Spot Instances. InsufficientInstanceCapacity - There is no Spot capacity available."
)
AT = datetime(2026, 12, 6, 18, 0, tzinfo=timezone.utc)


class _Activities:
    """An autoscaling client whose group keeps failing to launch (moto's groups always launch)."""

    def __init__(self, activities: list[dict[str, Any]] | None = None, error: str = "") -> None:
        self.activities = activities or []
        self.error = error
        self.asked: list[dict[str, Any]] = []

    def describe_scaling_activities(self, **request: Any) -> dict[str, Any]:
        self.asked.append(request)
        if self.error:
            raise ClientError({"Error": {"Code": self.error, "Message": "no"}}, "DescribeScalingActivities")
        return {"Activities": self.activities}


class _Clients:
    def __init__(self, autoscaling: _Activities) -> None:
        self._autoscaling = autoscaling

    def autoscaling(self) -> _Activities:
        return self._autoscaling


def _failed(minutes_ago: float) -> dict[str, Any]:
    return {
        "Description": "Launching a new EC2 instance.  Status Reason: no capacity",
        "StartTime": AT - timedelta(minutes=minutes_ago),
        "StatusCode": "Failed",
        "StatusMessage": NO_SPOT,
    }


def test_a_pool_whose_launches_keep_failing_says_so_with_aws_words_and_for_how_long() -> None:
    autoscaling = _Activities([_failed(2), _failed(7), _failed(12)])
    found = read_drought(_Clients(autoscaling), "trainstack-dev-big", AT)  # type: ignore[arg-type]
    assert autoscaling.asked == [{"AutoScalingGroupName": "trainstack-dev-big", "MaxRecords": 50}]
    reasons = WaitingReasons("big", lanes=1, busy=0, desired=1, in_service=0, drought=found, now=AT)
    assert reasons.why(1) == (
        "pool big: no instance for 12 min (3 launches failed: 'Could not launch Spot Instances. "
        "InsufficientInstanceCapacity - There is no Spot capacity available.')"
    )
    one = WaitingReasons("big", 1, 0, 1, 0, read_drought(_Clients(_Activities([_failed(1)])), "g", AT), AT)  # type: ignore[arg-type]
    assert one.why(1).startswith("pool big: no instance for 1 min (1 launch failed: ")
    # A job behind a busy lane waits for the lane first, whatever the launches do.
    assert WaitingReasons("big", 1, 1, 1, 0, found, AT).why(1) == "pool big: 1 of 1 job running"


def test_a_pool_still_launching_or_unreadable_says_an_instance_is_starting() -> None:
    succeeded = {**_failed(1), "StatusCode": "Successful"}
    for clients in (
        _Clients(_Activities([succeeded, _failed(5)])),
        _Clients(_Activities(error="AccessDenied")),
    ):
        found = read_drought(clients, "g", AT)  # type: ignore[arg-type]
        assert found is None
        assert (
            WaitingReasons("big", 1, 0, 2, 1, found, AT).why(1)
            == "pool big: an instance is starting (1 of 2 up)"
        )


def test_max_concurrent_jobs_reached_wakes_no_instance_and_says_why_the_job_waits(pooled: Deployed) -> None:
    """The stack runs its maxConcurrentJobs: a job submitted to a pool with a free lane waits, no instance
    boots for it (it would find no slot), and `trainstack jobs` names the limit."""
    _lanes(pooled, 2)
    pooled.outputs["max_concurrent_jobs"] = 1
    pooled.outputs_file.write_text(json.dumps(pooled.outputs), encoding="utf-8")
    _running(pooled, "current-job.json", "first-aaaaaaaa")
    slot = {"job_id": "first-aaaaaaaa", "since": "2026-12-06T11:00:00.000Z"}
    pooled.s3().put_object(Bucket=BUCKET, Key="state/slots/slot-0.json", Body=json.dumps(slot).encode())
    submitted = pooled.run("run", "--config", str(CONFIG), "--json").json()
    assert submitted["scaled_up_to"] is None and _desired(GROUP) == 1, "a free lane, but no free slot"
    waiting = submitted["jobs"][0]["job_id"]
    rows = {row["job_id"]: row for row in pooled.run("jobs", "--json").json()["jobs"]}
    assert rows[waiting]["waiting"] == "maxConcurrentJobs 1 reached: 1 job runs across the stack"
    # The running job ends: its slot is free, and the next submission wakes its instance again.
    ended = {"job_id": "first-aaaaaaaa", "status": "completed", "lives": []}
    pooled.s3().put_object(
        Bucket=BUCKET, Key="jobs/first-aaaaaaaa/state/ledger.json", Body=json.dumps(ended).encode()
    )
    rows = {row["job_id"]: row for row in pooled.run("jobs", "--json").json()["jobs"]}
    assert "maxConcurrentJobs" not in rows[waiting]["waiting"]
    again = pooled.run("run", "--config", str(CONFIG), "--json").json()
    assert again["scaled_up_to"] == 2 and _desired(GROUP) == 2


def test_a_pool_other_than_the_default_counts_its_own_free_lanes(pooled: Deployed) -> None:
    """A job for `big` starts beside big's running job while big has a lane free, whatever the default
    pool's lanes hold."""
    pooled.outputs["pools"]["small"] |= {"max_jobs": 2}
    pooled.outputs["pools"]["big"] |= {"max_jobs": 2}
    pooled.outputs_file.write_text(json.dumps(pooled.outputs), encoding="utf-8")
    _running(pooled, "current-job.json", "first-aaaaaaaa")
    _running(pooled, "current-job-lane1.json", "second-bbbbbbbb")
    _running(pooled, "current-job-big.json", "third-cccccccc")
    boto3.client("autoscaling", region_name=REGION).update_auto_scaling_group(
        AutoScalingGroupName=BIG, DesiredCapacity=1
    )
    submitted = pooled.run("run", "--config", str(CONFIG), "--pool", "big", "--instances", "1", "--json")
    assert submitted.code == 0, submitted.err
    assert submitted.json()["scaled_up_to"] == 2 and (_desired(BIG), _desired(GROUP)) == (2, 0)
