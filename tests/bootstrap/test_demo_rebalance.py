"""`python -m demo --rebalance`: its checks, each shown to fail on a made-up timeline that breaks what it
guards, and one real run (real agents, real trainers) whose checks must all pass."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from demo.rebalance import (
    HANDOVER,
    HOLDER,
    LEASE_ACQUIRED,
    LEASE_RELEASED,
    LEASE_TAKEN_OVER,
    LEFT_GROUP,
    LIFE_END,
    REBALANCE_SEEN,
    STANDBY,
    STANDBY_READY,
    STANDBY_WAITING,
    TRAINER_STOPPED,
    AgentEvent,
    GroupSeen,
    LatestVersion,
    LeaseSeen,
    Life,
    ObjectVersion,
    RebalanceResult,
    StepSeen,
    TrainerLine,
)
from demo.report import Check
from demo.report_rebalance import checks, figures, holder_at, lease_changes
from tests.bootstrap.test_demo import run_demo
from tests.forkserver import ForkServer

T0 = 1_000_000.0
STOP = 8
TOTAL = 20
FIRST_ID, SECOND_ID = "i-0000000000000001", "i-0000000000000002"


def _event(
    at: float, instance: str, what: tuple[str, str], message: str = "", **fields: object
) -> AgentEvent:
    stage, part = what
    text = message or part
    return AgentEvent(T0 + at, instance, stage, text, {"stage": stage, "message": text, **fields})


def _line(at: float, instance: str, line: str) -> TrainerLine:
    return TrainerLine(T0 + at, instance, line)


def _steps(instance: str, first: int, last: int, start: float) -> list[StepSeen]:
    """One step every 0.5 s from `start`."""
    return [StepSeen(T0 + start + 0.5 * i, instance, step) for i, step in enumerate(range(first, last + 1))]


def _versions(keys: list[str], at: float) -> list[ObjectVersion]:
    return [ObjectVersion(key, f"v-{key}", T0 + at, etag=f'"{key}"') for key in keys]


def good_story() -> RebalanceResult:
    """What the story should look like: instance 1 trains steps 1-8, hands over; instance 2 trains 9-20."""
    result = RebalanceResult(started=T0, workdir=Path("/nonexistent"))
    result.user_data_bytes, result.user_data_valid = 9000, "parses"
    result.job_id = "tiny-0123abcd"
    result.lives = [
        Life(HOLDER, FIRST_ID, "g6.xlarge", "us-east-1a", booted_at=T0, exited_at=T0 + 12, exit_code=0),
        Life(STANDBY, SECOND_ID, "g5.xlarge", "us-east-1b", booted_at=T0 + 3, exited_at=T0 + 20, exit_code=0),
    ]
    result.total_steps = TOTAL
    result.steps = _steps(HOLDER, 1, STOP, start=1.0) + _steps(STANDBY, STOP + 1, TOTAL, start=10.0)
    result.rebalance_at, result.rebalance_step = T0 + 2.6, 4
    result.replacement_launched_at = T0 + 2.8
    result.events = sorted(
        [
            _event(0.5, HOLDER, LEASE_ACQUIRED, token=1),
            _event(3.0, HOLDER, REBALANCE_SEEN, "rebalance recommendation: early checkpoint requested"),
            _event(4.0, STANDBY, STANDBY_WAITING, "the job's lease is held; waiting warm", holder=FIRST_ID),
            _event(4.4, STANDBY, STANDBY_READY, warm_s=1.4),
            _event(4.5, HOLDER, HANDOVER, "a standby is ready: handing over", standby=SECOND_ID),
            _event(
                5.0,
                HOLDER,
                TRAINER_STOPPED,
                "trainer stopped; checkpoint confirmed in S3",
                reason="handover",
                checkpoint_confirmed=True,
                checkpoint_step=STOP,
                newest_local_step=STOP,
            ),
            _event(5.2, HOLDER, LEASE_RELEASED, stop_step=STOP),
            _event(5.6, STANDBY, LEASE_TAKEN_OVER, token=2, stop_step=STOP, **{"from": FIRST_ID}),
            _event(6.0, HOLDER, LEFT_GROUP, decrement=False),
            _event(6.1, HOLDER, LIFE_END, "handed over", outcome="handed_over"),
            _event(19.0, STANDBY, LIFE_END, "completed; scaled to zero", outcome="completed"),
        ],
        key=lambda e: e.time,
    )
    result.lines = [
        _line(
            4.3,
            STANDBY,
            "standby: warm (model built, first batch loaded) in 1.3s; waiting for the start gate /g",
        ),
        _line(
            4.9,
            HOLDER,
            f"stopped at step {STOP} on handover; checkpoint saved in /c for the agent to persist",
        ),
        _line(5.8, STANDBY, "standby: start gate opened after 1.5s; restoring"),
        _line(5.9, STANDBY, f"resuming at step {STOP} (epoch 2) from /c/step-{STOP}"),
        _line(17.0, STANDBY, f"training complete: {TOTAL} steps; results in /o"),
    ]
    result.leases = [
        LeaseSeen(T0 + 0.6, FIRST_ID, 1, False, None),
        LeaseSeen(T0 + 5.3, FIRST_ID, 1, True, STOP),
        LeaseSeen(T0 + 5.7, SECOND_ID, 2, False, None),
        LeaseSeen(T0 + 18.0, SECOND_ID, 2, True, TOTAL),
    ]
    result.group_with_both = GroupSeen(T0 + 2.8, 1, [FIRST_ID, SECOND_ID])
    result.group_after_holder = GroupSeen(T0 + 12, 1, [SECOND_ID])
    result.versions = (
        _versions([f"step-{STOP}/model.pt", f"step-{STOP}/manifest.json"], at=4.8)
        + _versions(["step-16/model.pt", "step-16/manifest.json"], at=14.0)
        + _versions([f"step-{TOTAL}/model.pt", f"step-{TOTAL}/manifest.json"], at=17.5)
        + [ObjectVersion("latest.json", f"l{i}", T0 + at) for i, at in enumerate((4.9, 14.1, 17.6))]
    )
    result.latest_history = [
        LatestVersion(T0 + 4.9, STOP, 1),
        LatestVersion(T0 + 14.1, 16, 2),
        LatestVersion(T0 + 17.6, TOTAL, 2),
    ]
    result.metrics = {"final": {"val_accuracy": 1.0}}
    result.artifacts = ["s3://b/jobs/x/results/model.pt", "s3://b/jobs/x/results/metrics.json"]
    result.desired_capacity, result.group_instances = 0, []
    result.ec2_states = {FIRST_ID: "terminated", SECOND_ID: "terminated"}
    result.alerts = [{"Subject": "trainstack [demo]: training completed", "Message": "done"}]
    result.ledger = {
        "status": "completed",
        "interruptions": 0,
        "consecutive_failures": 0,
        "handovers": 1,
        "total_cost_usd": 0.003,
        "lives": [
            {"instance_id": FIRST_ID, "outcome": "handed_over", "cost_usd": 0.001},
            {"instance_id": SECOND_ID, "outcome": "completed", "cost_usd": 0.002, "standby_seconds": 1.6},
        ],
    }
    return result


def failed(result: RebalanceResult) -> list[Check]:
    return [c for c in checks(result) if not c.passed]


def failed_names(result: RebalanceResult) -> set[str]:
    return {c.name for c in failed(result)}


def test_the_made_up_good_story_passes_every_check_and_has_its_figures() -> None:
    result = good_story()
    assert failed(result) == []
    numbers = figures(result)
    # Instance 1's last step (8, at 1 + 7 × 0.5 s) → instance 2's first (9, at 10 s).
    assert numbers.handover_gap_s == pytest.approx(5.5)
    assert numbers.rebalance_to_handover_s == pytest.approx(3.0)
    assert (numbers.stop_step, numbers.resumed_step, numbers.steps_lost) == (STOP, STOP, 0)
    changes = lease_changes(result)
    assert holder_at(changes, T0 + 3) == "instance-1 (token 1)"
    assert holder_at(changes, T0 + 5.4) == f"released (step {STOP})"
    assert holder_at(changes, T0 + 10) == "instance-2 (token 2)"


def test_two_trainers_at_once_fails_one_trainer_at_a_time() -> None:
    """Instance 2 starts training (steps 9-20) while instance 1 still trains its last steps."""
    result = good_story()
    result.steps = _steps(HOLDER, 1, STOP, start=1.0) + _steps(STANDBY, STOP + 1, TOTAL, start=3.0)
    assert "one trainer at a time" in failed_names(result)


def test_a_step_after_the_lease_was_released_fails_one_trainer_at_a_time() -> None:
    """Instance 1's last step line arrives after its agent released the lease (and before instance 2's)."""
    result = good_story()
    result.steps.append(StepSeen(T0 + 5.5, HOLDER, STOP))
    result.steps.sort(key=lambda s: s.time)
    detail = next(c.detail for c in failed(result) if c.name == "one trainer at a time")
    assert "after releasing the lease" in detail


def test_a_step_trained_by_both_fails() -> None:
    """Instance 2 restored an older step and trained step 8 again."""
    result = good_story()
    result.steps = _steps(HOLDER, 1, STOP, start=1.0) + _steps(STANDBY, STOP, TOTAL, start=10.0)
    names = failed_names(result)
    assert "no step trained twice" in names
    assert "one trainer at a time" not in names  # one after the other, but the same step twice


def test_a_lost_step_fails() -> None:
    """Instance 1 trained to 9, but released (and instance 2 restored) step 8."""
    result = good_story()
    result.steps.insert(STOP, StepSeen(T0 + 4.6, HOLDER, STOP + 1))
    result.steps = [s for s in result.steps if not (s.instance == STANDBY and s.step == STOP + 1)]
    assert "steps lost = 0" in failed_names(result)


def test_latest_json_moving_back_fails() -> None:
    result = good_story()
    result.latest_history.insert(2, LatestVersion(T0 + 15, 12, 1))
    names = failed_names(result)
    assert names == {"latest.json only moved forward"}


def test_a_step_folder_written_twice_fails() -> None:
    """A second version of one of step 16's objects with other bytes: a second writer of that step."""
    result = good_story()
    result.versions.append(ObjectVersion("step-16/model.pt", "again", T0 + 14.5, etag='"other bytes"'))
    assert failed_names(result) == {"no checkpoint step folder written twice"}


def test_one_file_uploaded_twice_with_the_same_bytes_is_shown_not_failed() -> None:
    """The holder's final flush redoing the upload its stop interrupted: the same file, the same bytes."""
    result = good_story()
    result.versions.append(ObjectVersion("step-16/model.pt", "again", T0 + 14.5, etag='"step-16/model.pt"'))
    check = next(c for c in checks(result) if c.name == "no checkpoint step folder written twice")
    assert check.passed and "uploaded again with the same bytes: step-16/model.pt" in check.detail


def test_the_handed_over_step_rewritten_after_the_take_over_fails() -> None:
    result = good_story()
    moved = [
        dataclasses.replace(v, written_at=T0 + 7) if v.key == f"step-{STOP}/model.pt" else v
        for v in result.versions
    ]
    result.versions = moved
    assert failed_names(result) == {"no checkpoint step folder written twice"}


def test_two_completions_fail() -> None:
    result = good_story()
    result.alerts.append({"Subject": "trainstack [demo]: training completed", "Message": "again"})
    assert failed_names(result) == {"one completion"}


@pytest.mark.parametrize(
    "change",
    [
        "instance 1 preempted",
        "no standby seconds",
        "no hand-over counted",
        "total is not the sum",
        "an interruption",
        "a third life",
    ],
)
def test_an_untruthful_ledger_fails(change: str) -> None:
    result = good_story()
    ledger = json.loads(json.dumps(result.ledger))
    first, second = ledger["lives"]
    if change == "instance 1 preempted":
        first["outcome"] = "preempted"
    elif change == "no standby seconds":
        del second["standby_seconds"]
    elif change == "no hand-over counted":
        ledger["handovers"] = 0
    elif change == "total is not the sum":
        ledger["total_cost_usd"] = 0.002
    elif change == "an interruption":
        ledger["interruptions"] = 1
    else:
        ledger["lives"].append({"instance_id": "i-3", "outcome": "surplus", "cost_usd": 0.0})
    result.ledger = ledger
    names = failed_names(result)
    assert "ledger: instance 1 handed_over, instance 2 completed after a standby wait" in names


def test_a_group_not_at_zero_or_a_decrement_fails() -> None:
    result = good_story()
    result.desired_capacity = 1
    assert "the group: launch before terminate, instance 1 left, then zero" in failed_names(result)
    result = good_story()
    result.events = [
        dataclasses.replace(e, fields={**e.fields, "decrement": True}) if e.matches(LEFT_GROUP) else e
        for e in result.events
    ]
    assert "the group: launch before terminate, instance 1 left, then zero" in failed_names(result)


def test_a_lease_that_skips_the_hand_over_fails() -> None:
    """Instance 2 took the lease with a token from nowhere (2 above instance 1's, not 1)."""
    result = good_story()
    result.events = [
        dataclasses.replace(e, fields={**e.fields, "token": 3}) if e.matches(LEASE_TAKEN_OVER) else e
        for e in result.events
    ]
    assert "the lease moved once, instance 1 → instance 2, token + 1" in failed_names(result)


def test_the_standby_saying_ready_after_the_holder_read_its_record_still_waited_warm() -> None:
    """The standby's "standby ready" line comes once its ready record is written: on a loaded machine the
    holder reads the record and says "handing over" first. The hand-over naming the standby is the proof."""
    result = good_story()
    result.events = [
        dataclasses.replace(e, time=4.6) if e.matches(STANDBY_READY) else e for e in result.events
    ]
    assert "instance 2 waited as the warm standby" not in failed_names(result)


def test_a_hand_over_to_another_instance_than_the_standby_fails() -> None:
    result = good_story()
    result.events = [
        dataclasses.replace(e, fields={**e.fields, "standby": "i-someone-else"}) if e.matches(HANDOVER) else e
        for e in result.events
    ]
    assert "instance 2 waited as the warm standby" in failed_names(result)


def test_rebalance_refuses_nodes_and_jobs() -> None:
    from demo.__main__ import _refuse_rebalance

    assert _refuse_rebalance(False, 2, None) is None
    assert _refuse_rebalance(True, 1, None) is None
    assert "--nodes" in (_refuse_rebalance(True, 2, None) or "")
    assert "built-in trainer" in (_refuse_rebalance(True, 1, Path("examples/charlm")) or "")


@pytest.mark.slow(seconds=45)
def test_rebalance_demo_hands_over_to_the_warm_standby_with_one_writer_at_a_time(
    tmp_path: Path, fork_server: ForkServer
) -> None:
    """The one real run: two agents and two trainers (forked from the worker's fork server); every check of
    the story must pass."""
    output = run_demo(tmp_path, "--rebalance", forked=fork_server)
    for check in (
        "instance 2 waited as the warm standby",
        "one trainer at a time",
        "no step trained twice",
        "steps lost = 0",
        "latest.json only moved forward",
        "no checkpoint step folder written twice",
        "one completion",
        "ledger: instance 1 handed_over, instance 2 completed after a standby wait",
        "the group: launch before terminate, instance 1 left, then zero",
    ):
        assert f"PASS {check}" in output, output[-6000:]
    assert "FAIL" not in output and "all checks passed" in output
    assert "hand-over gap (instance 1's last step → instance 2's first)" in output
    assert "rebalance → hand-over (instance 2 holds the lease)" in output
    numbers = json.loads((tmp_path / "demo" / "figures.json").read_text())
    assert numbers["checks_passed"] is True and numbers["steps_lost"] == 0
    assert numbers["handover_gap_s"] > 0 and numbers["rebalance_to_handover_s"] > 0
    assert numbers["standby_first_step"] == numbers["stop_step"] + 1
