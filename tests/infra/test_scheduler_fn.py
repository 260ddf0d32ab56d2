"""The scheduler function against moto: it raises a pool's desired capacity to what its waiting jobs need
(a pool at zero with a job waiting; a pool of several lanes by its free lanes), never lowers one, leaves out
cancelled jobs and other pools' jobs, and concurrent invocations agree."""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import boto3
import pytest

from demo.stack import LocalStack, create_stack
from lambdas.scheduler.handler import PoolSettings, handler, run
from tests.iam.plugin import record_as
from tests.iam.principals import SCHEDULER
from tests.waiting import join_all
from trainstack_job.queue import SOURCE_RUN, cancel_key, job_record, queue_entry, queue_key
from trainstack_job.throughput import capacity_units


@pytest.fixture()
def stack(aws: Any) -> LocalStack:
    created = create_stack(name="trainstack-sched", desired=0)
    created.client("autoscaling").update_auto_scaling_group(
        AutoScalingGroupName=created.group_name, MaxSize=4
    )
    return created


def _put(stack: LocalStack, key: str, value: dict[str, Any]) -> None:
    stack.client("s3").put_object(Bucket=stack.bucket, Key=key, Body=json.dumps(value).encode())


def _queue(stack: LocalStack, job_id: str, at: str, pool: str = "", instances: int | None = None) -> None:
    agent: dict[str, Any] = {"job_id": job_id, "job_name": "j", "job": {}, "user_job": None}
    if instances is not None:
        agent["instance_count"] = instances
    _put(
        stack,
        f"jobs/{job_id}/job.json",
        job_record(job_id=job_id, name="j", agent=agent, submitted_at=at, source=SOURCE_RUN),
    )
    _put(stack, queue_key(job_id), queue_entry(job_id, at, pool=pool))


def _running(stack: LocalStack, pointer: str, job_id: str) -> None:
    _put(stack, f"state/{pointer}", {"job_id": job_id})
    _put(stack, f"jobs/{job_id}/state/ledger.json", {"job_id": job_id, "status": "running", "lives": []})


def _desired(stack: LocalStack) -> int:
    return int(stack.group()["DesiredCapacity"])


def _pass(stack: LocalStack, settings: PoolSettings) -> list[Any]:
    # Its calls are judged against the function's own role (tests/iam), as AWS would judge them.
    autoscaling, s3 = (
        record_as(boto3.client(n, region_name="us-east-1"), SCHEDULER) for n in ("autoscaling", "s3")
    )
    return run(autoscaling, s3, stack.bucket, "state/", [settings])


def test_a_pool_at_zero_with_a_job_waiting_gets_that_jobs_instances(stack: LocalStack) -> None:
    one_lane = PoolSettings("", stack.group_name, lanes=1, max_instances=3)
    (decision,) = _pass(stack, one_lane)
    assert (decision.waiting, decision.action, _desired(stack)) == (0, "none", 0), (
        "nothing waits: nothing starts"
    )
    _queue(stack, "alpha-aaaaaaaa", "2026-12-06T12:00:00.000Z", instances=2)
    (decision,) = _pass(stack, one_lane)
    assert (decision.waiting, decision.wanted, decision.action) == (1, 2, "raised") and _desired(stack) == 2


def test_a_pool_of_lanes_gets_one_instance_per_busy_lane_and_per_job_its_free_lanes_start(
    stack: LocalStack,
) -> None:
    lanes = PoolSettings("", stack.group_name, lanes=3, max_instances=1)
    _running(stack, "current-job.json", "first-aaaaaaaa")
    for index in range(3):
        _queue(stack, f"wait{index}-bbbbbbbb", f"2026-12-06T12:00:0{index}.000Z")
    _queue(stack, "other-cccccccc", "2026-12-06T12:00:05.000Z", pool="big")  # another pool's
    _queue(stack, "gone-dddddddd", "2026-12-06T12:00:06.000Z")
    _put(stack, cancel_key("gone-dddddddd"), {"requested_at": "2026-12-06T12:00:07Z", "by": "test"})
    (decision,) = _pass(stack, lanes)
    assert (decision.busy, decision.waiting, decision.wanted) == (1, 3, 3), decision
    assert _desired(stack) == 3
    (again,) = _pass(stack, lanes)
    assert again.action == "none" and _desired(stack) == 3, "the same state: the same capacity, no call"


def test_it_never_lowers_a_pool(stack: LocalStack) -> None:
    stack.client("autoscaling").set_desired_capacity(AutoScalingGroupName=stack.group_name, DesiredCapacity=3)
    (decision,) = _pass(stack, PoolSettings("", stack.group_name, lanes=3, max_instances=1))
    assert (decision.wanted, decision.action) == (0, "none") and _desired(stack) == 3


def test_concurrent_invocations_agree_on_one_capacity(stack: LocalStack) -> None:
    lanes = PoolSettings("", stack.group_name, lanes=4, max_instances=1)
    for index in range(6):
        _queue(stack, f"burst{index}-aaaaaaaa", f"2026-12-06T12:00:0{index}.000Z")
    decisions: list[Any] = []
    threads = [threading.Thread(target=lambda: decisions.extend(_pass(stack, lanes))) for _ in range(4)]
    for thread in threads:
        thread.start()
    join_all(threads, 60, "the four concurrent invocations")
    assert len(decisions) == 4 and {d.wanted for d in decisions} == {4}
    assert _desired(stack) == 4, "four lanes free, six jobs waiting: four instances, never more"


def test_the_lambda_entry_point_reads_its_pools_from_its_environment(
    stack: LocalStack, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """What infra/scheduler.py configures (BUCKET, POOLS as SchedulerArgs.pools_variable renders it) is what
    the handler acts on, pool by pool, and what it logs and returns is each pool's decision."""
    _running(stack, "current-job.json", "first-aaaaaaaa")
    # A run slot of a limit set once: without MAX_CONCURRENT_JOBS the function sets no limit, whatever it
    # finds.
    _put(stack, "state/slots/slot-0.json", {"job_id": "first-aaaaaaaa", "since": "2026-12-06T11:00:00.000Z"})
    _queue(stack, "alpha-aaaaaaaa", "2026-12-06T12:00:00.000Z")
    pools = [
        {"pool": "", "group": stack.group_name, "lanes": 2, "max_instances": 1},
        {"pool": "big", "group": "trainstack-sched-gpu-big", "lanes": 1, "max_instances": 2},  # not created
    ]
    monkeypatch.setenv("BUCKET", stack.bucket)
    monkeypatch.setenv("POOLS", json.dumps(pools))
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    assert PoolSettings.many_from_env({"POOLS": json.dumps(pools)}) == [
        PoolSettings("", stack.group_name, 2, 1),
        PoolSettings("big", "trainstack-sched-gpu-big", 1, 2),
    ]
    with caplog.at_level(logging.INFO, logger="trainstack.scheduler"):
        result = handler({"source": "aws.events"}, None)
    # The default pool: lane 0 busy and one job waiting for lane 1; the big pool's group is not there (yet).
    expected = {
        "decisions": [
            {
                "pool": "",
                "group": stack.group_name,
                "waiting": 1,
                "busy": 1,
                "desired": 0,
                "wanted": 2,
                "action": "raised",
            }
        ]
    }
    assert result == expected and _desired(stack) == 2
    assert [json.loads(r.getMessage()) for r in caplog.records] == [expected], "one log line, as returned"
    # MAX_CONCURRENT_JOBS (set by the program only when the stack sets a limit): the running job's slot is
    # the one slot, so the waiting job gets no instance.
    stack.client("autoscaling").set_desired_capacity(AutoScalingGroupName=stack.group_name, DesiredCapacity=0)
    monkeypatch.setenv("MAX_CONCURRENT_JOBS", "1")
    limited = handler({"source": "aws.events"}, None)["decisions"][0]
    assert (limited["busy"], limited["waiting"], limited["wanted"], limited["action"]) == (1, 1, 1, "raised")
    monkeypatch.setenv("MAX_CONCURRENT_JOBS", "2")
    assert handler({"source": "aws.events"}, None)["decisions"][0]["wanted"] == 2


def test_max_concurrent_jobs_caps_what_every_pool_starts_in_their_declared_order(stack: LocalStack) -> None:
    """With trainstack:maxConcurrentJobs, the pools start no more jobs than the free run slots: the running
    job's slot counts, the first pool takes what is left, the second pool gets no instance for a job that
    could not start (its instance would find no slot and leave, billed for nothing)."""
    big = f"{stack.name}-gpu-big"
    stack.client("autoscaling").create_auto_scaling_group(
        AutoScalingGroupName=big,
        LaunchTemplate={"LaunchTemplateName": f"{stack.name}-instance", "Version": "$Latest"},
        VPCZoneIdentifier=stack.group()["VPCZoneIdentifier"],
        MinSize=0,
        MaxSize=2,
        DesiredCapacity=0,
    )
    pools = [
        PoolSettings("", stack.group_name, lanes=3, max_instances=1),
        PoolSettings("big", big, lanes=1, max_instances=2),
    ]
    _running(stack, "current-job.json", "first-aaaaaaaa")
    _put(stack, "state/slots/slot-1.json", {"job_id": "first-aaaaaaaa", "since": "2026-12-06T11:00:00.000Z"})
    for index in range(3):
        _queue(stack, f"wait{index}-bbbbbbbb", f"2026-12-06T12:00:0{index}.000Z")
    _queue(stack, "large-cccccccc", "2026-12-06T12:00:05.000Z", pool="big")
    autoscaling, s3 = (
        record_as(boto3.client(n, region_name="us-east-1"), SCHEDULER) for n in ("autoscaling", "s3")
    )
    default, large = run(autoscaling, s3, stack.bucket, "state/", pools, max_concurrent_jobs=2)
    assert (default.busy, default.waiting, default.wanted) == (1, 3, 2), "one slot left: one more job starts"
    assert (large.waiting, large.wanted, large.action) == (1, 0, "none"), "no slot left for the big pool"
    groups = {g["AutoScalingGroupName"]: g["DesiredCapacity"] for g in stack.client("autoscaling")
              .describe_auto_scaling_groups()["AutoScalingGroups"]}  # fmt: skip
    assert groups == {stack.group_name: 2, big: 0}
    # The running job ends: its slot is free, and the two pools share the two slots in their order.
    _put(stack, "jobs/first-aaaaaaaa/state/ledger.json", {"status": "completed", "lives": []})
    default, large = run(autoscaling, s3, stack.bucket, "state/", pools, max_concurrent_jobs=2)
    assert (default.busy, default.wanted, large.wanted) == (0, 2, 0)
    default, large = run(autoscaling, s3, stack.bucket, "state/", pools, max_concurrent_jobs=4)
    assert (default.wanted, large.wanted) == (3, 2), "no limit reached: every pool by its lanes, as before"


def test_an_event_a_later_pass_already_covered_reads_nothing(
    stack: LocalStack, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A burst of submissions is one event each, invoked one after another: an event sent before the last
    pass began (its second's stamp plus a margin) returns at once, since that pass read every object the event
    announced; a later event, an event without a time and a cold container's first run a pass."""
    from datetime import datetime, timedelta, timezone

    from lambdas.scheduler import handler as module

    monkeypatch.setattr(module, "PASSES", module.Passes())
    monkeypatch.setenv("BUCKET", stack.bucket)
    monkeypatch.setenv(
        "POOLS", json.dumps([{"pool": "", "group": stack.group_name, "lanes": 1, "max_instances": 1}])
    )
    _queue(stack, "alpha-aaaaaaaa", "2026-12-06T12:00:00.000Z")
    sent = datetime.now(timezone.utc).replace(microsecond=0) - timedelta(seconds=2)
    event = {"source": "aws.s3", "time": sent.isoformat().replace("+00:00", "Z")}
    first = handler(event, None)
    assert first["decisions"][0]["action"] == "raised" and _desired(stack) == 1, (
        "a cold container runs a pass"
    )
    stack.client("autoscaling").set_desired_capacity(AutoScalingGroupName=stack.group_name, DesiredCapacity=0)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trainstack.scheduler"):
        again = handler(event, None)
    assert again == {"decisions": [], "skipped": "a pass that began after this event already read its state"}
    assert [json.loads(r.getMessage()) for r in caplog.records] == [again], "the skip said in one log line"
    assert _desired(stack) == 0, "covered: nothing read, nothing raised"
    later = {"source": "aws.s3", "time": datetime.now(timezone.utc).isoformat()}
    assert handler(later, None)["decisions"][0]["action"] == "raised", "sent within the margin: a pass"
    stack.client("autoscaling").set_desired_capacity(AutoScalingGroupName=stack.group_name, DesiredCapacity=0)
    for untimed in ({"source": "aws.events"}, {"time": "not a time"}, {"time": "2026-12-06T12:00:00"}):
        assert handler(untimed, None)["decisions"], untimed
    edge = module.Passes(datetime(2026, 12, 6, 12, 0, 2, tzinfo=timezone.utc))
    assert edge.covered(datetime(2026, 12, 6, 12, 0, 0, tzinfo=timezone.utc))
    assert not edge.covered(datetime(2026, 12, 6, 12, 0, 0, 1, tzinfo=timezone.utc))
    assert not edge.covered(None) and not module.Passes().covered(datetime(2026, 1, 1, tzinfo=timezone.utc))


def test_a_weighted_pool_is_asked_for_one_unit_per_instance_its_job_needs(stack: LocalStack) -> None:
    """A single-instance pool is weighted by throughput (infra/fleet.py pool_weights), so its sizes count
    units: its maximum is room for two of its heaviest type (2 x 6). Its slowest type weighs 1, so one unit is
    one instance of any type: a waiting job gets one unit, never the room the maximum leaves."""
    stack.client("autoscaling").update_auto_scaling_group(AutoScalingGroupName=stack.group_name, MaxSize=12)
    weighted = PoolSettings("", stack.group_name, lanes=1, max_instances=1)
    _queue(stack, "alpha-aaaaaaaa", "2026-12-06T12:00:00.000Z", instances=4)
    (decision,) = _pass(stack, weighted)
    assert (decision.wanted, decision.action, _desired(stack)) == (1, "raised", 1)
    assert capacity_units(1, {"g4dn.xlarge": 1, "g6e.xlarge": 6}) == 1
    with pytest.raises(ValueError, match="must give the slowest type 1"):
        capacity_units(1, {"g6.xlarge": 2, "g6e.xlarge": 6})
