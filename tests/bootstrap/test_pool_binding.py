"""Pools on the agent's side: an instance takes only its own pool's queued jobs and keeps its pool's own
current-job pointer, so two pools run their jobs side by side; the default pool reads as before pools."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

import pytest

from bootstrap.agent_config import AgentConfig, AgentConfigError
from bootstrap.imds import InstanceIdentity
from bootstrap.jobbinding import bind_job
from bootstrap.ledger import JobEndedError, LedgerStore
from demo.stack import LocalStack
from trainstack_job.queue import SOURCE_RUN, job_record, queue_entry, queue_key

NOW = datetime(2026, 12, 6, 12, 0, tzinfo=timezone.utc)
SMALL_JOB, BIG_JOB, OTHER_BIG = "small-aaaaaaaa", "wide-bbbbbbbb", "wide-cccccccc"


def _submit(stack: LocalStack, job_id: str, at: str, pool: str = "") -> None:
    name = job_id.rsplit("-", 1)[0]
    agent: dict[str, Any] = {"job_id": job_id, "job_name": name, "job": {"fake": {}}, "user_job": None}
    record = job_record(job_id=job_id, name=name, agent=agent, submitted_at=at, source=SOURCE_RUN)
    s3 = stack.client("s3")
    s3.put_object(Bucket=stack.bucket, Key=f"jobs/{job_id}/job.json", Body=json.dumps(record).encode())
    body = json.dumps(queue_entry(job_id, at, pool=pool)).encode()
    s3.put_object(Bucket=stack.bucket, Key=queue_key(job_id), Body=body)


def _pointer(stack: LocalStack, name: str) -> Any:
    return stack.read_json(f"state/{name}")


def test_each_pool_takes_its_own_jobs_and_keeps_its_own_pointer(stack: LocalStack) -> None:
    _submit(stack, BIG_JOB, "2026-12-06T11:00:00.000Z", pool="big")  # oldest, but not the default pool's
    _submit(stack, SMALL_JOB, "2026-12-06T11:00:01.000Z")
    _submit(stack, OTHER_BIG, "2026-12-06T11:00:02.000Z", pool="big")
    s3 = stack.client("s3")
    small = bind_job(s3, stack.agent_config(job_id=""), NOW)
    big = bind_job(s3, stack.agent_config(job_id="", pool="big"), NOW)
    assert small is not None and small.job_id == SMALL_JOB
    assert big is not None and big.job_id == BIG_JOB, "both pools run at once, each from its own queue"
    assert _pointer(stack, "current-job.json")["job_id"] == SMALL_JOB
    assert _pointer(stack, "current-job-big.json")["job_id"] == BIG_JOB
    # A second instance of each pool serves the same job (its standby), never the other pool's.
    assert bind_job(s3, stack.agent_config(job_id=""), NOW).job_id == SMALL_JOB  # type: ignore[union-attr]
    again = bind_job(s3, stack.agent_config(job_id="", pool="big"), NOW)
    assert again is not None and again.job_id == BIG_JOB


def test_a_pool_with_nothing_queued_for_it_binds_nothing(stack: LocalStack) -> None:
    _submit(stack, SMALL_JOB, "2026-12-06T11:00:01.000Z")
    assert bind_job(stack.client("s3"), stack.agent_config(job_id="", pool="big"), NOW) is None


def test_the_default_pools_config_renders_as_before_pools_and_a_bad_pool_name_is_named(
    stack: LocalStack,
) -> None:
    assert "pool" not in stack.agent_config(job_id="").to_yaml()
    assert "pool: big" in stack.agent_config(job_id="", pool="big").to_yaml()
    raw: dict[str, Any] = {
        "region": "us-east-1",
        "bucket": "b-data",
        "group_name": "g",
        "topic_arn": "arn:aws:sns:us-east-1:1:t",
        "log_group": "/l",
        "pool": "Big Pool",
    }
    with pytest.raises(AgentConfigError, match="'pool' must be a pool name"):
        AgentConfig.from_mapping(raw)


def _record(
    stack: LocalStack, job_id: str, at: str, *, sweep: dict[str, Any] | None = None, priority: int = 0
) -> None:
    name = job_id.rsplit("-", 1)[0]
    agent: dict[str, Any] = {"job_id": job_id, "job_name": name, "job": {"fake": {}}, "user_job": None}
    record = job_record(
        job_id=job_id, name=name, agent=agent, submitted_at=at, source=SOURCE_RUN, sweep=sweep
    )
    s3 = stack.client("s3")
    s3.put_object(Bucket=stack.bucket, Key=f"jobs/{job_id}/job.json", Body=json.dumps(record).encode())
    body = json.dumps(queue_entry(job_id, at, priority=priority)).encode()
    s3.put_object(Bucket=stack.bucket, Key=queue_key(job_id), Body=body)


def _staffed(stack: LocalStack, job_id: str) -> None:
    """The job trains on another instance, with its standby: it needs nothing more."""
    now = NOW.timestamp()
    state = f"jobs/{job_id}/state/"
    lease = {"job_id": job_id, "holder": "i-other", "life_id": "l1", "token": 1, "acquired_at": now,
             "heartbeat_at": now, "expires_at": now + 600}  # fmt: skip
    standby = {"instance_id": "i-third", "life_id": "l2", "heartbeat_at": now, "ready": True}
    ledger = {"job_id": job_id, "status": "running", "lives": []}
    for name, value in (("lease.json", lease), ("standby.json", standby), ("ledger.json", ledger)):
        stack.client("s3").put_object(Bucket=stack.bucket, Key=state + name, Body=json.dumps(value).encode())


def test_a_sweep_runs_at_most_its_parallel_points_and_other_jobs_go_past_it(stack: LocalStack) -> None:
    sweep = {"name": "lrs", "point": {}, "parallel": 1}
    _record(stack, "lrs-a-aaaaaaaa", "2026-12-06T11:00:00.000Z", sweep=sweep)
    _record(stack, "lrs-b-bbbbbbbb", "2026-12-06T11:00:01.000Z", sweep=sweep)
    _record(stack, "other-cccccccc", "2026-12-06T11:00:02.000Z")
    config = stack.agent_config(job_id="", lanes=3)
    first = bind_job(stack.client("s3"), config, NOW)
    assert first is not None and first.job_id == "lrs-a-aaaaaaaa"
    _staffed(stack, "lrs-a-aaaaaaaa")
    second = bind_job(stack.client("s3"), config, NOW)
    assert second is not None and second.job_id == "other-cccccccc", "the sweep's second point waits"
    assert second.lane != first.lane


def test_a_higher_priority_runs_first_and_fifo_within_one(stack: LocalStack) -> None:
    _record(stack, "low-aaaaaaaa", "2026-12-06T11:00:00.000Z")
    _record(stack, "high-bbbbbbbb", "2026-12-06T11:00:01.000Z", priority=5)
    _record(stack, "high-cccccccc", "2026-12-06T11:00:02.000Z", priority=5)
    binding = bind_job(stack.client("s3"), stack.agent_config(job_id=""), NOW)
    assert binding is not None and binding.job_id == "high-bbbbbbbb"


def test_a_job_that_ended_while_an_instance_bound_it_never_runs_twice(stack: LocalStack) -> None:
    """Found by bench/scheduling/: an instance binds a running job (as its standby), the holder completes
    it and lets go, and the instance's life would reopen the completed ledger and take the free lease."""
    _submit(stack, SMALL_JOB, "2026-12-06T11:00:01.000Z")
    s3 = stack.client("s3")
    binding = bind_job(s3, stack.agent_config(job_id=""), NOW)
    assert binding is not None and binding.resuming is False, "a job that runs is bound, not resumed"
    key = f"jobs/{SMALL_JOB}/state/ledger.json"
    ledger = {"job_id": SMALL_JOB, "status": "completed", "lives": [], "consecutive_failures": 0}
    s3.put_object(Bucket=stack.bucket, Key=key, Body=json.dumps(ledger).encode())
    store = LedgerStore(s3, stack.bucket, key)
    identity = InstanceIdentity("i-late", "g6.xlarge", "us-east-1a", "us-east-1", "spot")
    with pytest.raises(JobEndedError, match=f"job {SMALL_JOB} ended \\(completed\\) before this life began"):
        store.begin_life(identity, None, NOW, restart=binding.resuming)
    assert stack.read_json(key)["status"] == "completed", "nothing was written"  # type: ignore[index]
    # On purpose (`trainstack resume` of a stopped job, the legacy job) a life may restart an ended ledger.
    store.begin_life(identity, None, NOW, restart=True)
    assert stack.read_json(key)["status"] == "running"  # type: ignore[index]
