"""The demos' interruption checks on synthetic results: they pass only when the notice really interrupted the
job mid-run (before its last step, stopped early with exit 75); a job that finished first fails, saying to
lengthen it (issue 23: a run that was never interrupted passed "steps lost = 0"). No process, no AWS."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from demo import report, report_multinode
from demo.multinode import INTERRUPTED, MultiNodeResult, NodeEvent
from demo.run import DemoResult, Sample

TOTAL = 60


def _single(
    *, notice_step: int | None = 24, exit_code: int | None = 75, stopped: int | None = 25
) -> DemoResult:
    """Instance 1 trained to `stopped`; the notice came at `notice_step`; the agent logged `exit_code`."""
    result = DemoResult(started=0.0, total_steps=TOTAL, exit_codes=[0, 0])
    result.samples = [Sample(float(s), "instance-1", s) for s in range(1, (stopped or TOTAL) + 1)]
    if notice_step is not None:
        result.notice_at, result.notice_step = float(notice_step), notice_step
    if exit_code is not None:
        result.stop_event = {
            "exit_code": exit_code,
            "checkpoint_confirmed": exit_code == 75,
            "checkpoint_step": stopped,
            "newest_local_step": stopped,
            "reached_step": stopped,
        }
        result.trainer_stopped_step = stopped
    return result


def _check(result: DemoResult, name: str) -> report.Check:
    return next(c for c in report.checks(result) if c.name == name)


MID_RUN = "the notice interrupted the job mid-run"


def test_a_stop_mid_run_with_exit_75_passes() -> None:
    result = _single()
    assert report.interrupted_mid_run(result) == (
        True,
        f"notice at step 24/{TOTAL}, stopped at 25/60 with exit 75",
    )
    assert _check(result, MID_RUN).passed and _check(result, "steps lost = 0").passed
    assert _check(result, "instance 1 stopped with a confirmed checkpoint").passed


@pytest.mark.parametrize(
    "changes",
    [
        # The run: the job reached its last step, then the agent's stop found it done.
        {"exit_code": 0, "stopped": TOTAL},
        # ... or a job without a SIGTERM handler died of the signal after its last step (exit -15).
        {"exit_code": -15, "stopped": TOTAL},
        # The notice came when the job had already reported its last step.
        {"notice_step": TOTAL, "exit_code": 0, "stopped": TOTAL},
        # No notice at all: the job ended before the demo's injection point.
        {"notice_step": None, "exit_code": None, "stopped": TOTAL},
        # The agent logged no stop: the job completed before its poll saw the notice.
        {"exit_code": None, "stopped": TOTAL},
    ],
)
def test_a_job_that_finished_before_the_notice_fails_saying_to_lengthen_it(changes: dict[str, Any]) -> None:
    result = _single(**changes)
    passed, detail = report.interrupted_mid_run(result)
    assert not passed and "lengthen it (more steps) so the demo can interrupt it" in detail
    failed = {c.name for c in report.checks(result) if not c.passed}
    assert {MID_RUN, "steps lost = 0", "instance 1 stopped with a confirmed checkpoint"} <= failed


def test_a_job_killed_mid_run_by_the_signal_fails_naming_exit_75() -> None:
    passed, detail = report.interrupted_mid_run(_single(exit_code=-15, stopped=25))
    assert not passed and "did not stop with exit 75 (exit -15)" in detail and "Stopping" in detail


def _multi(*, notice_step: int = 20, exit_code: int = 75, stopped: int = 21) -> MultiNodeResult:
    result = MultiNodeResult(started=0.0, workdir=Path(), total_steps=TOTAL, notice_at=1.0)
    result.notice_step, result.stopped_step = notice_step, stopped
    result.events = [
        NodeEvent(2.0, INTERRUPTED, "stop", "stop requested", {"reason": "spot"}),
        NodeEvent(3.0, INTERRUPTED, "stop", "trainer stopped; ...", {"exit_code": exit_code}),
    ]
    return result


def test_the_multi_node_check_passes_a_stop_mid_run_and_fails_a_finished_job() -> None:
    assert report_multinode.interrupted_mid_run(_multi())[0]
    passed, detail = report_multinode.interrupted_mid_run(_multi(exit_code=0, stopped=TOTAL))
    assert not passed and "the job finished before the notice: lengthen it" in detail
    passed, detail = report_multinode.interrupted_mid_run(_multi(exit_code=1))
    assert not passed and "did not stop with exit 75 (exit 1" in detail


# -- the lives table: time to first step and data wait per life (issue 35) ---------------------------


def _lives_ledger() -> dict[str, Any]:
    """Instance 1 measured both; instance 2 (a user's job, no progress) measured neither."""
    first = {
        "instance_id": "i-1",
        "instance_type": "g6.xlarge",
        "started_at": "2026-12-06T10:00:00.000Z",
        "outcome": "preempted",
        "first_step_seconds": 6.25,
        "data_wait_fraction": 0.083,
    }
    second = {
        "instance_id": "i-2",
        "instance_type": "g4dn.xlarge",
        "started_at": "2026-12-06T10:05:00.000Z",
        "outcome": "completed",
    }
    return {"status": "completed", "lives": [first, second, "not a life", {"outcome": "no start"}]}


def _rows(text: str) -> dict[str, list[str]]:
    return {
        cells[1]: cells
        for line in text.splitlines()
        if len(cells := [c.strip() for c in line.strip("│┃ ").split("│")]) > 1 and cells[1].startswith("i-")
    }


def test_the_lives_table_shows_each_lifes_first_step_and_data_wait_and_a_dash_for_unknown() -> None:
    from rich.console import Console

    console = Console(width=160, record=True)
    console.print(report.lives_table([("job 1", _lives_ledger()), ("job 2", {"lives": None})]))
    text = console.export_text()
    rows = _rows(text)
    assert rows["i-1"] == ["job 1", "i-1", "g6.xlarge", "preempted", "6.2s", "8%"]
    assert rows["i-2"] == ["job 1", "i-2", "g4dn.xlarge", "completed", "–", "–"]
    assert set(rows) == {"i-1", "i-2"}, "what is not a life is left out"
    assert "first step after" in text and "data wait" in text


def test_the_demos_summary_ends_with_the_lives_table() -> None:
    from rich.console import Console

    result = _single()
    result.ledger = _lives_ledger()
    result.ledger["lives"] = result.ledger["lives"][:2]
    console = Console(width=200, record=True)
    report.print_timeline(result, console)
    text = console.export_text()
    assert text.index("estimated cost") < text.index("lives: time to first step and data wait")
    assert _rows(text)["i-1"][-2:] == ["6.2s", "8%"]
