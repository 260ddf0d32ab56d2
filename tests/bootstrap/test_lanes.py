"""Several jobs at once in one pool (its lanes, `maxJobs`): two instances train two queued jobs side by side,
each job with one writer; a third job waits for a lane; an instance that trains is protected from scale-in,
so a lower desired capacity takes the idle one; and a job's end takes its own instance out of the group,
never the group to zero while another job trains. Real agents in-process, fake trainers, moto."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bootstrap.agent import Lives
from demo.stack import LocalStack
from tests.bootstrap import test_one_writer as one_writer
from tests.bootstrap.test_one_writer import Agent
from tests.bootstrap.test_queue_agent import submit

# The simulated instances of the one-writer stories (each its own IMDS, in-process agent and fake trainer).
agents = one_writer.agents

A, B, C = "alpha-aaaaaaaa", "bravo-bbbbbbbb", "charlie-cccccccc"
# Long enough that both instances train at once on a loaded machine; `hold_until` ends a job on cue.
HELD = {"steps": 40, "step_seconds": 0.05, "checkpoint_every": 10, "hold_at_step": 2}
SHORT = {"steps": 6, "step_seconds": 0.02, "checkpoint_every": 3}


def _ledger(stack: LocalStack, job_id: str) -> dict[str, Any]:
    value = stack.read_json(f"jobs/{job_id}/state/ledger.json")
    assert value is not None, f"{job_id} has no ledger"
    return value


def _protected(stack: LocalStack) -> dict[str, bool]:
    found = stack.client("autoscaling").describe_auto_scaling_instances()["AutoScalingInstances"]
    return {i["InstanceId"]: bool(i["ProtectedFromScaleIn"]) for i in found}


def _wait(condition: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _run_lives(agent: Agent) -> Lives:
    """Run the agent's lives one after another, as the agent's process does (a job's end, then the next)."""
    lives = Lives(agent.life)

    def run() -> None:
        agent.result = lives.run()

    agent.thread = threading.Thread(target=run, name=agent.name, daemon=True)
    agent.thread.start()
    return lives


@pytest.fixture()
def lanes_pool(stack: LocalStack) -> LocalStack:
    """The stack's group holding two instances, as `trainstack run` wakes a pool of two lanes for two jobs."""
    stack.client("autoscaling").update_auto_scaling_group(
        AutoScalingGroupName=stack.group_name, MaxSize=4, DesiredCapacity=2
    )
    return stack


def test_two_jobs_train_at_once_in_one_pool_and_a_third_waits_for_a_lane(
    lanes_pool: LocalStack, agents: Callable[..., Agent], tmp_path: Path
) -> None:
    stack = lanes_pool
    release = {job: tmp_path / f"release-{job}" for job in (A, B)}
    for index, job in enumerate((A, B)):
        fake = {**HELD, "hold_until": str(release[job])}
        submit(stack, job, fake, f"2026-12-06T12:00:0{index}.000Z")
    submit(stack, C, SHORT, "2026-12-06T12:00:05.000Z")
    first_id, second_id = stack.instance_ids()[:2]
    first = agents("first", first_id, job_id="", lanes=2)
    first_lives = _run_lives(first)
    first.wait_for("trainer starting")
    second = agents("second", second_id, job_id="", lanes=2)
    second_lives = _run_lives(second)
    second.wait_for("trainer starting")
    # Both train, each its own job, each the lease's holder; the third job waits (two lanes).
    assert {first_lives.current.config.job_id, second_lives.current.config.job_id} == {A, B}
    assert stack.read_json(f"jobs/{C}/state/ledger.json") is None, "the third job waits for a lane"
    pointers = [stack.read_json(f"state/{name}") for name in ("current-job.json", "current-job-lane1.json")]
    assert {pointer["job_id"] for pointer in pointers if pointer} == {A, B}
    for job in (A, B):
        claim = stack.read_json(f"jobs/{job}/state/lane.json")
        assert claim is not None and claim["lane"] in (0, 1)
    # Training instances are protected from scale-in: a lower desired capacity can take neither.
    _wait(lambda: all(_protected(stack).get(i) for i in (first_id, second_id)), "both holders protected")
    # The first job ends: its instance takes the waiting job in the freed lane, the other trains on.
    holder_a = first if first_lives.current.config.job_id == A else second
    release[A].touch()
    _wait(
        lambda: (stack.read_json(f"jobs/{C}/state/ledger.json") or {}).get("status") == "completed",
        "the third job to complete",
        timeout=90,
    )
    assert holder_a.said("next life on this instance"), "the freed instance took the waiting job, no reboot"
    assert _ledger(stack, B)["status"] == "running", "the other lane's job trained on throughout"
    release[B].touch()
    for agent in (first, second):
        agent.join(timeout=120)
    for job in (A, B, C):
        ledger = _ledger(stack, job)
        assert ledger["status"] == "completed", job
        trained = [life for life in ledger["lives"] if life["outcome"] == "completed"]
        assert len(trained) == 1, f"{job}: one writer, one completed life: {ledger['lives']}"
    # Each instance left with its last job: the group is at zero, nothing bills.
    _wait(lambda: stack.group()["DesiredCapacity"] == 0, "the pool back at zero")


def test_a_lower_desired_capacity_takes_the_idle_instance_never_the_training_one(
    lanes_pool: LocalStack, agents: Callable[..., Agent], tmp_path: Path
) -> None:
    stack = lanes_pool
    release = tmp_path / "release"
    submit(stack, A, {**HELD, "hold_until": str(release)}, "2026-12-06T12:00:00.000Z")
    first_id, second_id = stack.instance_ids()[:2]
    first = agents("first", first_id, job_id="", lanes=2)
    _run_lives(first)
    first.wait_for("trainer starting")
    _wait(lambda: _protected(stack).get(first_id) is True, "the holder protected")
    # Another scheduler (a cancel, the cost cap, a person) lowers the pool by one: AWS takes an unprotected
    # instance, the idle one, and never the one that trains.
    stack.client("autoscaling").set_desired_capacity(AutoScalingGroupName=stack.group_name, DesiredCapacity=1)
    assert stack.instance_ids() == [first_id], "the training instance stays; the idle one went"
    assert second_id not in _protected(stack)
    release.touch()
    assert first.join(timeout=120).outcome == "completed"
    assert json.dumps(_ledger(stack, A)["status"]) == '"completed"'


def test_an_instance_is_protected_before_it_claims_a_job_and_one_scaled_in_first_claims_none(
    lanes_pool: LocalStack, agents: Callable[..., Agent], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between its claim and its lease an instance prepares the job (code, ledger): a lower desired capacity
    then must not take it, or the claimed job waits minutes for the dead instance's claim to go stale (the
    scheduling bench's burst once lost a job so). And an instance that scale-in chose before it could
    protect itself claims nothing: the job stays queued for an instance that stays."""
    import bootstrap.lifecycle as lifecycle

    stack = lanes_pool
    release = tmp_path / "release"
    submit(stack, A, {**HELD, "hold_until": str(release)}, "2026-12-06T12:00:00.000Z")
    first_id, second_id = stack.instance_ids()[:2]
    at_claim: list[tuple[str, bool | None]] = []
    real_bind = lifecycle.bind_job

    def bind_and_look(*args: Any, **kwargs: Any) -> Any:
        binding = real_bind(*args, **kwargs)
        if binding is not None:
            at_claim.append((binding.job_id, _protected(stack).get(first_id)))
        return binding

    monkeypatch.setattr(lifecycle, "bind_job", bind_and_look)
    first = agents("first", first_id, job_id="", lanes=2)
    _run_lives(first)
    first.wait_for("trainer starting")
    assert at_claim == [(A, True)], "protected from scale-in before its claim"
    assert first.said("protected from scale-in while it looks for a job")
    # Scale-in picks the second instance before its agent runs; its agent then finds itself leaving.
    stack.client("autoscaling").set_desired_capacity(AutoScalingGroupName=stack.group_name, DesiredCapacity=1)
    assert stack.instance_ids() == [first_id]
    submit(stack, B, SHORT, "2026-12-06T12:00:01.000Z")
    second = agents("second", second_id, job_id="", lanes=2)
    _run_lives(second)
    assert second.join(timeout=60).outcome == "skipped"
    assert second.said("scaled in before it claimed a job: it takes none")
    assert stack.read_json(f"jobs/{B}/state/lane.json") is None, "the second job stays queued, unclaimed"
    assert stack.read_json(f"jobs/{B}/state/ledger.json") is None
    release.touch()
    # The holder's job ends and it takes the waiting job itself, in the lane the second never claimed.
    _wait(lambda: (stack.read_json(f"jobs/{B}/state/ledger.json") or {}).get("status") == "completed", "B")
    first.join(timeout=120)
