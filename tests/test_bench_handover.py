"""The hand-over bench's arithmetic (bench/handover.py) on made-up timelines: which moments each figure is
read from, when a trial does not count, the summary and the paired ratio. No agent or trainer runs here."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.handover import (
    FIGURES,
    Trial,
    cold_figures,
    notice_problems,
    schedule,
    summarize,
    wait_for_calm,
    warm_figures,
    warm_over_cold,
)
from demo.rebalance import (
    HOLDER,
    LEASE_ACQUIRED,
    LEASE_RELEASED,
    LEASE_TAKEN_OVER,
    STANDBY,
    STANDBY_READY,
    STANDBY_WAITING,
    AgentEvent,
    Life,
    RebalanceResult,
    StepSeen,
)

T0 = 1_000_000.0
STOP, TOTAL = 10, 20
NOTICE = 20.0  # seconds after T0


def _event(at: float, instance: str, stage: str, message: str, **fields: object) -> AgentEvent:
    return AgentEvent(T0 + at, instance, stage, message, {"stage": stage, "message": message, **fields})


def _steps(instance: str, first: int, last: int, start: float) -> list[StepSeen]:
    """One step every 0.5 s from `start`."""
    return [StepSeen(T0 + start + 0.5 * i, instance, step) for i, step in enumerate(range(first, last + 1))]


def _ledger(standby: bool) -> dict[str, object]:
    second: dict[str, object] = {"instance_id": "i-2", "outcome": "completed"}
    if standby:
        second.update(standby_seconds=9.5, standby_cost_usd=0.0012)
    return {"status": "completed", "lives": [{"instance_id": "i-1", "outcome": "preempted"}, second]}


def warm_story() -> RebalanceResult:
    """Instance 1 trains 1-10 (steps at 16-20.5 s), the notice at 20 s, it releases the lease at step 10 at
    23 s; the standby, ready since 12 s, takes over at 23.5 s and trains 11-20 from 25 s."""
    result = RebalanceResult(started=T0, workdir=Path("/nonexistent"))
    result.lives = [
        Life(HOLDER, "i-1", "g6.xlarge", "us-east-1a", booted_at=T0, exited_at=T0 + 24, exit_code=0),
        Life(STANDBY, "i-2", "g5.xlarge", "us-east-1b", booted_at=T0 + 5, exited_at=T0 + 40, exit_code=0),
    ]
    result.total_steps = TOTAL
    result.steps = _steps(HOLDER, 1, STOP, start=16.0) + _steps(STANDBY, STOP + 1, TOTAL, start=25.0)
    result.events = [
        _event(1, HOLDER, *LEASE_ACQUIRED, token=1),
        _event(6, STANDBY, *STANDBY_WAITING, holder="i-1"),
        _event(12, STANDBY, "standby", "standby ready", warm_s=6.0),
        _event(20.5, HOLDER, "interruption", "spot termination notice"),
        _event(23, HOLDER, *LEASE_RELEASED, stop_step=STOP),
        _event(23.5, STANDBY, *LEASE_TAKEN_OVER, token=2, stop_step=STOP),
    ]
    result.ledger = _ledger(standby=True)
    return result


def cold_story() -> RebalanceResult:
    """The same instance 1; instance 2 booted at 25 s (after instance 1's exit at 24 s): data at 27 s,
    trainer starting at 28 s, first step at 31 s."""
    result = warm_story()
    result.lives[1] = Life(STANDBY, "i-2", "g5.xlarge", "us-east-1b", booted_at=T0 + 25.2, exit_code=0)
    result.steps = _steps(HOLDER, 1, STOP, start=16.0) + _steps(STANDBY, STOP + 1, TOTAL, start=31.0)
    result.events = [
        _event(1, HOLDER, *LEASE_ACQUIRED, token=1),
        _event(20.5, HOLDER, "interruption", "spot termination notice"),
        _event(23, HOLDER, *LEASE_RELEASED, stop_step=STOP),
        _event(26, STANDBY, *LEASE_ACQUIRED, token=2, stop_step=STOP),
        _event(26.1, STANDBY, "data", "syncing dataset"),
        _event(27, STANDBY, "data", "dataset synced"),
        _event(28, STANDBY, "train", "trainer starting", restored_step=STOP),
    ]
    result.ledger = _ledger(standby=False)
    return result


def test_warm_figures_are_read_from_the_notice_the_release_and_the_first_step() -> None:
    figures = warm_figures(warm_story(), notice_at=T0 + NOTICE)
    assert figures == {
        "notice_to_first_step_s": 5.0,  # first standby step at 25 s
        "notice_to_release_s": 3.0,
        "release_to_first_step_s": 2.0,
        "handover_gap_s": 4.5,  # instance 1's step 10 at 20.5 s
        "standby_seconds": 9.5,
        "standby_cost_usd": 0.0012,
    }
    assert set(figures) == {name for name, _ in FIGURES["warm"]}
    assert notice_problems(warm_story(), T0 + NOTICE, warm=True) == []


def test_cold_figures_split_the_notice_into_instance_1_going_and_the_replacement_starting() -> None:
    figures = cold_figures(cold_story(), notice_at=T0 + NOTICE, boot_at=T0 + 25)
    assert figures == {
        "notice_to_first_step_s": 11.0,
        "notice_to_release_s": 3.0,
        "notice_to_holder_gone_s": 4.0,
        "release_to_first_step_s": 8.0,  # released at 23 s, first step at 31 s
        "boot_to_first_step_s": 6.0,
        "boot_to_data_s": 2.0,  # "dataset synced", not the "syncing dataset" before it
        "boot_to_trainer_start_s": 3.0,
        "trainer_start_to_first_step_s": 3.0,
        "handover_gap_s": 10.5,
    }
    assert set(figures) == {name for name, _ in FIGURES["cold"]}
    assert notice_problems(cold_story(), T0 + NOTICE, warm=False) == []


def test_a_wrong_run_is_not_counted() -> None:
    late_ready = warm_story()  # the standby became ready only after the notice: not a warm trial
    late_ready.events[2] = _event(21, STANDBY, *STANDBY_READY)
    assert "the standby was not ready before the notice" in notice_problems(
        late_ready, T0 + NOTICE, warm=True
    )

    twice = warm_story()  # the standby restarted one step early: step 10 trained by both
    twice.steps = _steps(HOLDER, 1, STOP, 16.0) + _steps(STANDBY, STOP, TOTAL, 25.0)
    found = notice_problems(twice, T0 + NOTICE, warm=True)
    assert any("steps trained twice: [10]" in p for p in found)
    assert any("first step 10, instance 1 released at 10" in p for p in found)

    lost = cold_story()  # steps 11-12 never trained, an agent failed, the job did not complete
    lost.steps = [s for s in lost.steps if s.step not in (11, 12)]
    lost.lives[1].exit_code = 1
    lost.ledger["status"] = "failed"
    found = notice_problems(lost, T0 + NOTICE, warm=False)
    assert any(p.startswith("steps never trained: [11, 12]") for p in found)
    assert any(p.startswith("agents exited") for p in found)
    assert "job failed" in found

    waited = cold_story()  # the "cold" replacement found the lease held and waited: it was warm
    waited.events.append(_event(26.5, STANDBY, *STANDBY_WAITING, holder="i-1"))
    assert "the cold replacement waited as a standby" in notice_problems(waited, T0 + NOTICE, warm=False)


def _trial(scenario: str, round_index: int, ok: bool = True, **figures: float) -> Trial:
    return Trial(scenario, round_index, ok, [] if ok else ["x"], dict(figures), 0.5, 1.5, "", 60.0)


def test_summary_uses_counted_trials_only_and_pairs_the_ratio_by_round() -> None:
    trials = [
        _trial("cold", 0, notice_to_first_step_s=100.0),  # the warm-up: never counted
        _trial("warm", 1, notice_to_first_step_s=5.0),
        _trial("cold", 1, notice_to_first_step_s=10.0),
        _trial("cold", 2, notice_to_first_step_s=20.0),
        _trial("warm", 2, notice_to_first_step_s=4.0),
        _trial("warm", 3, notice_to_first_step_s=6.0),
        _trial("cold", 3, ok=False, notice_to_first_step_s=1.0),  # a failed run: not counted, unpaired
        _trial("rebalance", 1, rebalance_to_handover_s=15.0, handover_gap_s=3.0),
        _trial("rebalance", 2, rebalance_to_handover_s=19.0, handover_gap_s=4.0),
    ]
    summary = summarize(trials)
    warm = summary["warm"]["notice_to_first_step_s"]
    assert (warm.median, warm.low, warm.high, warm.n) == (5.0, 4.0, 6.0, 3)
    cold = summary["cold"]["notice_to_first_step_s"]
    assert (cold.median, cold.low, cold.high, cold.n) == (15.0, 10.0, 20.0, 2)
    assert summary["rebalance"]["rebalance_to_handover_s"].median == 17.0
    assert "notice_to_release_s" not in summary["warm"]  # no trial had it
    ratio, ratios = warm_over_cold(trials)
    assert ratios == [0.5, 0.2]
    assert ratio is not None
    assert (ratio.median, ratio.low, ratio.high, ratio.n) == (pytest.approx(0.35), 0.2, 0.5, 2)
    assert warm_over_cold([t for t in trials if t.scenario != "cold"]) == (None, [])
    trials += [
        _trial("warm", 4, notice_to_first_step_s=6.0, release_to_first_step_s=2.0),
        _trial("cold", 4, notice_to_first_step_s=12.0, release_to_first_step_s=8.0),
    ]
    assert warm_over_cold(trials, "release_to_first_step_s")[1] == [0.25]  # only round 4 has both


def test_the_schedule_rotates_the_order_and_starts_with_an_untimed_trial() -> None:
    assert schedule(3, warmup=True) == [
        (0, "cold"),
        (1, "warm"), (1, "cold"), (1, "rebalance"),
        (2, "cold"), (2, "rebalance"), (2, "warm"),
        (3, "rebalance"), (3, "warm"), (3, "cold"),
    ]  # fmt: skip
    assert schedule(1, warmup=False) == [(1, "warm"), (1, "cold"), (1, "rebalance")]


def test_wait_for_calm_waits_for_the_load_and_gives_up_after_the_limit() -> None:
    loads = iter([3.0, 2.0, 0.8, 0.5])
    slept: list[float] = []
    said: list[str] = []
    first, last, calm = wait_for_calm(
        1.0, 600, said.append, read=lambda: next(loads), sleep=slept.append, poll_s=10
    )
    assert (first, last, calm) == (3.0, 0.8, True)
    assert slept == [10, 10]
    assert said  # it says why it waits

    slept.clear()
    first, last, calm = wait_for_calm(1.0, 30, said.append, read=lambda: 4.0, sleep=slept.append, poll_s=10)
    assert (first, last, calm) == (4.0, 4.0, False)
    assert slept == [10, 10, 10]
