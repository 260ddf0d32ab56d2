"""How a life ends: one enum from the trainer's exit to the agent's exit status; and only the lease's holder
ends a job (its results, status, e-mail and scale to zero), against moto."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bootstrap.eventlog import utc_now
from bootstrap.lifecycle import InstanceLife
from bootstrap.outcomes import FINAL_ENDS, Failure, LifeEnd, LifeFacts, LifeResult, Outcomes
from demo.stack import LocalStack
from trainstack_job.contract import LifeOutcome


def test_every_ledger_outcome_is_a_life_end_with_the_same_value() -> None:
    for outcome in LifeOutcome:
        assert LifeEnd(outcome.value).ledger_outcome() is outcome
    with pytest.raises(ValueError):
        LifeEnd.GAVE_UP.ledger_outcome()


@pytest.mark.parametrize(
    "end",
    [
        "completed",
        "preempted",
        "stopped",
        "cost_cap",
        "no_data",
        "replaced",
        "skipped",
        "gave_up",
        "handed_over",
        "superseded",
        "surplus",
        "standby_ended",
    ],
)
def test_a_final_end_exits_0_so_systemd_starts_no_other_life(end: str) -> None:
    assert LifeResult(LifeEnd(end)).exit_code == 0


@pytest.mark.parametrize("end", sorted(set(LifeEnd) - FINAL_ENDS))
def test_any_other_end_exits_1_so_systemd_starts_the_next_life(end: LifeEnd) -> None:
    assert LifeResult(end).exit_code == 1
    assert end in {"running", "interrupted", "failed", "stalled", "killed", "replace"}


# -- only the lease's holder ends a job (bootstrap/outcomes.py `not_the_holder`) ---------------------------


class Answers:
    """What `holds_lease` answers, one call after the other (the last answer repeats)."""

    def __init__(self, *answers: bool | None) -> None:
        self._answers = list(answers)
        self.calls = 0

    def __call__(self) -> bool | None:
        self.calls += 1
        return self._answers.pop(0) if len(self._answers) > 1 else self._answers[0]


@pytest.fixture()
def ending(make_life: Callable[..., InstanceLife], stack: LocalStack, tmp_path: Path) -> Callable[..., Any]:
    """The outcome handlers of a life that trained and holds (or held) the job's lease, against moto: its
    ledger life begun, the trainer's results on disk; `end(outcome, *answers)` ends it."""
    life = make_life()
    identity = life.identity = life.boot.identify()
    life.job.ledger_store.begin_life(identity, None, utc_now(), stale_after_seconds=60)
    output = tmp_path / "output"
    output.mkdir()
    (output / "model.pt").write_bytes(b"weights")
    (output / "metrics.json").write_text('{"val_acc": 0.5}')
    stack.alerts()

    def end(outcome: LifeEnd | Failure, *answers: bool | None) -> tuple[LifeResult, Answers]:
        holds = Answers(*answers)
        handlers = Outcomes(
            life.config,
            life.log,
            life.job,
            life.clients.s3,
            life.fleet,
            life.notifier,
            life.imds,
            builtin_trainer=True,
            release_wait_seconds=0,
            holds_lease=holds,
        )
        facts = LifeFacts(identity=identity, phase="final-upload", output_dir=output)
        return handlers.finish(outcome, facts), holds

    return end


def _results(stack: LocalStack) -> list[str]:
    listed = stack.client("s3").list_objects_v2(Bucket=stack.bucket, Prefix="results/")
    return [item["Key"] for item in listed.get("Contents", [])]


def test_a_completion_by_the_holder_uploads_writes_the_status_mails_once_and_scales_in(
    ending: Callable[..., Any], stack: LocalStack
) -> None:
    result, holds = ending(LifeEnd.COMPLETED, True)
    assert result.outcome is LifeEnd.COMPLETED and holds.calls == 2, (
        "proved before the end and before the status"
    )
    assert sorted(_results(stack)) == ["results/metrics.json", "results/model.pt"]
    ledger = stack.read_json("state/ledger.json")
    assert ledger is not None and ledger["status"] == "completed"
    assert [a["Subject"] for a in stack.alerts()] == ["trainstack [trainstack-test]: training completed"]
    assert stack.group()["DesiredCapacity"] == 0


@pytest.mark.parametrize(
    "outcome",
    [
        LifeEnd.COMPLETED,
        LifeEnd.STOPPED,
        LifeEnd.COST_CAP,
        LifeEnd.CANCELLED,
        LifeEnd.NO_DATA,
        Failure(LifeEnd.FAILED, "trainer exited 1", [], permanent=True),
    ],
    ids=["completed", "stopped", "cost_cap", "cancelled", "no_data", "failed"],
)
def test_a_life_whose_lease_another_holds_ends_superseded_and_ends_nothing_of_the_job(
    ending: Callable[..., Any], stack: LocalStack, outcome: LifeEnd | Failure
) -> None:
    desired = stack.group()["DesiredCapacity"]
    result, _ = ending(outcome, False)
    assert result.outcome is LifeEnd.SUPERSEDED and result.exit_code == 0
    assert _results(stack) == [], "a superseded life uploaded results"
    ledger = stack.read_json("state/ledger.json")
    assert ledger is not None and ledger["status"] == "running", "a superseded life changed the job's status"
    assert ledger["lives"][-1]["outcome"] == "superseded" and ledger["consecutive_failures"] == 0
    assert stack.alerts() == [], "a superseded life sent an e-mail"
    assert stack.group()["DesiredCapacity"] == desired, "a superseded life scaled the group in"


def test_a_life_that_cannot_prove_its_lease_leaves_the_end_to_the_next_life_here(
    ending: Callable[..., Any], stack: LocalStack
) -> None:
    desired = stack.group()["DesiredCapacity"]
    before = stack.read_json("state/ledger.json")
    assert before is not None
    # A crash counter and interruptions from earlier lives: an expired lease says nothing of either.
    seeded = before | {"consecutive_failures": 1, "interruptions": 2}
    stack.client("s3").put_object(
        Bucket=stack.bucket, Key="state/ledger.json", Body=json.dumps(seeded).encode()
    )
    result, _ = ending(LifeEnd.COMPLETED, None)
    assert result.outcome is LifeEnd.LEASE_EXPIRED and result.again and result.next_job == "legacy"
    assert result.exit_code == 0
    assert _results(stack) == [] and stack.alerts() == []
    ledger = stack.read_json("state/ledger.json")
    assert ledger is not None and ledger["status"] == "running"
    assert ledger["lives"][-1]["outcome"] == "lease_expired"
    assert (ledger["consecutive_failures"], ledger["interruptions"]) == (1, 2), (
        "neither a failure nor a reset"
    )
    assert stack.group()["DesiredCapacity"] == desired


def test_a_lease_lost_during_the_results_upload_writes_no_status_mails_nothing_and_scales_nothing(
    ending: Callable[..., Any], stack: LocalStack
) -> None:
    """Proved before the end, lost by the time the results were up (only when S3 was unreachable from here
    for the lease's length): the status is the job's end, and it is the new holder's to write."""
    desired = stack.group()["DesiredCapacity"]
    result, holds = ending(LifeEnd.COMPLETED, True, False)
    assert result.outcome is LifeEnd.SUPERSEDED and holds.calls == 2
    ledger = stack.read_json("state/ledger.json")
    assert ledger is not None and ledger["status"] == "running"
    assert stack.alerts() == [] and stack.group()["DesiredCapacity"] == desired


@pytest.mark.parametrize(
    "end", [LifeEnd.HANDED_OVER, LifeEnd.PREEMPTED, LifeEnd.SURPLUS, LifeEnd.STANDBY_ENDED]
)
def test_ends_that_end_nothing_of_the_job_ask_for_no_proof(ending: Callable[..., Any], end: LifeEnd) -> None:
    result, holds = ending(end, False)
    assert result.outcome is end and holds.calls == 0
