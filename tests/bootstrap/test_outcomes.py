"""How a life ends: one enum from the trainer's exit to the agent's exit status."""

from __future__ import annotations

import pytest

from bootstrap.outcomes import FINAL_ENDS, LifeEnd, LifeResult
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
