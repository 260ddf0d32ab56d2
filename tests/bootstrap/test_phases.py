"""bootstrap/phases/: a life's phases behind one interface, run in order until one ends the life, so a new
phase is a file and one entry in the list, never an edit of the life's class."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest

from bootstrap.lifecycle import InstanceLife
from bootstrap.outcomes import Failure, LifeEnd
from bootstrap.phases import Ended, Life, life_phases, run_phases
from bootstrap.phases.data import Data
from bootstrap.standby import Role
from demo.stack import LocalStack

MakeLife = Callable[..., InstanceLife]


class Step:
    """A phase that records its turn and ends the life or lets it go on."""

    def __init__(self, name: str, seen: list[str], end: Ended | None = None) -> None:
        self.name, self.seen, self.end = name, seen, end

    def run(self, life: Life) -> Ended | None:
        self.seen.append(self.name)
        return self.end


def test_the_phases_run_in_order_until_one_ends_the_life() -> None:
    seen: list[str] = []
    life = cast(Life, object())
    phases = [Step("a", seen), Step("b", seen, LifeEnd.SURPLUS), Step("c", seen, LifeEnd.COMPLETED)]
    assert run_phases(life, phases) is LifeEnd.SURPLUS
    assert seen == ["a", "b"], "a phase after the end ran"


def test_a_list_whose_last_phase_lets_the_life_go_on_is_a_bug_named_with_its_phases() -> None:
    seen: list[str] = []
    with pytest.raises(RuntimeError, match=r"no phase ended the life \(a, b\)"):
        run_phases(cast(Life, object()), [Step("a", seen), Step("b", seen)])
    assert seen == ["a", "b"]


def test_a_life_runs_the_gpu_check_scratch_one_writer_data_and_training_in_that_order() -> None:
    """The one writer is decided before the data sync: a surplus instance leaves before it syncs anything,
    a standby syncs the data while it waits."""
    assert [phase.name for phase in life_phases()] == [
        "gpu-check",
        "scratch",
        "one-writer",
        "data",
        "training",
    ]
    assert life_phases() is not life_phases()


def test_a_phase_added_to_one_lifes_list_runs_with_what_the_earlier_phases_set_up_and_its_end_is_the_lifes(
    make_life: MakeLife, stack: LocalStack
) -> None:
    seen: dict[str, Any] = {}

    class Check:
        name = "check"

        def run(self, life: Life) -> Ended | None:
            assert life.writer is not None and life.paths is not None
            seen.update(
                phase=life.phase, gpus=life.gpu_count, role=life.writer.role, scratch=life.paths.scratch
            )
            return Failure(LifeEnd.FAILED, "refused by a phase of its own", [], permanent=True)

    life = make_life(fake={"steps": 12})
    data = next(i for i, phase in enumerate(life.phases) if isinstance(phase, Data))
    life.phases.insert(data, Check())
    result = life.run()
    assert result.outcome is LifeEnd.GAVE_UP, "a permanent failure gives the job up at once"
    assert seen == {
        "phase": "gpu-check",
        "gpus": 0,
        "role": Role.HOLDER,
        "scratch": Path(str(life.config.scratch_dir)),
    }
    ledger = stack.read_json("state/ledger.json")
    assert ledger is not None and ledger["status"] == "failed"
    assert [life["outcome"] for life in ledger["lives"]] == ["failed"]
    (alert,) = stack.alerts()
    assert "training failed: refused by a phase of its own" in alert["Subject"]
    assert stack.read_json("state/progress.json") is None, "the data phase or the trainer ran after the end"
