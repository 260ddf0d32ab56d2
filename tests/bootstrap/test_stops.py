"""A stop that comes before the trainer starts (bootstrap/stops.py, in the life's phases): the trainer is
never started, and the life ends with the stop's own outcome. The promise of docs/internals.md ("Agent
lives"): a stop is acted on the moment it is seen, in every phase. Unit tests of the stop request itself,
then the real agent (in-process, against moto) with the stop landing in each phase before the launch."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from bootstrap.eventlog import EventLog
from bootstrap.lifecycle import InstanceLife
from bootstrap.outcomes import LifeEnd
from bootstrap.stops import STOP_OUTCOMES, StopRequests
from demo.stack import LocalStack

MakeLife = Callable[..., InstanceLife]


class Trainer:
    """What StopRequests needs of a trainer: it records the stop requests it was sent."""

    def __init__(self) -> None:
        self.stops = 0

    def request_stop(self) -> None:
        self.stops += 1


def test_a_stop_before_the_launch_starts_nothing_and_ends_with_its_outcome() -> None:
    stops = StopRequests(EventLog(), deadline_seconds=100)
    stops.phase = "restore"
    stops.request("cancel")
    started: list[Trainer] = []

    def start() -> Any:
        started.append(Trainer())
        return started[-1]

    assert stops.launch(start) is False
    assert started == [] and stops.trainer is None, "a trainer was started after the stop"
    assert stops.stopped_before_training() is LifeEnd.CANCELLED


def test_the_first_reason_wins_and_a_stop_during_the_launch_signals_the_trainer_it_started() -> None:
    stops = StopRequests(EventLog(), deadline_seconds=100)
    trainer = Trainer()
    entered, release = threading.Event(), threading.Event()

    def start() -> Any:
        entered.set()
        release.wait(5)
        return trainer

    launcher = threading.Thread(target=lambda: stops.launch(start))
    launcher.start()
    assert entered.wait(5)
    stopper = threading.Thread(target=lambda: stops.request("spot"))
    stopper.start()  # blocks on the launch's lock: either before the start (nothing starts) or after it
    time.sleep(0.1)
    release.set()
    launcher.join(5)
    stopper.join(5)
    assert trainer.stops == 1, "a stop that raced the launch never reached the trainer"
    stops.request("control")
    assert stops.reason == "spot" and trainer.stops == 1, "a second stop replaced the first"


@pytest.mark.parametrize(
    ("reason", "outcome"),
    [
        ("spot", LifeEnd.PREEMPTED),
        ("scale-in", LifeEnd.PREEMPTED),
        ("shutdown", LifeEnd.PREEMPTED),
        ("control", LifeEnd.STOPPED),
        ("cost_cap", LifeEnd.COST_CAP),
        ("cancel", LifeEnd.CANCELLED),
        ("yield", LifeEnd.YIELDED),
        ("handover", LifeEnd.HANDED_OVER),
        ("lease_lost", LifeEnd.SUPERSEDED),
        ("lease_expiring", LifeEnd.LEASE_EXPIRED),
    ],
)
def test_each_reason_ends_the_life_its_own_way(reason: str, outcome: LifeEnd) -> None:
    stops = StopRequests(EventLog(), deadline_seconds=100)
    stops.request(reason)
    assert STOP_OUTCOMES[reason] is outcome and stops.stopped_before_training() is outcome


def test_the_leases_end_bounds_the_kill_whatever_stop_is_under_way() -> None:
    stops = StopRequests(EventLog(), deadline_seconds=100)
    assert stops.kill_at is None
    stops.request("spot")
    stops.kill_by(123.0)
    stops.kill_by(125.0)  # a renewal moved the lease's end: so moves the kill
    assert stops.kill_at == 125.0 and stops.reason == "spot"


# -- the real agent: the stop lands in each phase before the launch -------------------------------------


def _stop_on_entry(life: InstanceLife, method: str, reason: str) -> None:
    """The stop arrives as `method` (a phase of the life) begins; the phase runs on as it would."""
    original = getattr(life, method)

    def stopped_first(*args: Any, **kwargs: Any) -> Any:
        life.stops.request(reason)
        return original(*args, **kwargs)

    setattr(life, method, stopped_first)


@pytest.mark.parametrize(
    ("phase", "method", "reason", "outcome"),
    [
        ("the data sync", "data", "spot", "preempted"),
        ("the restore", "_restore", "cancel", "cancelled"),
        ("the job's set-up (venv build)", "_job_process", "cost_cap", "cost_cap"),
        ("between the restore and the launch", "launch", "control", "stopped"),
    ],
)
def test_a_stop_in_any_phase_before_the_launch_means_the_trainer_never_starts(
    make_life: MakeLife, stack: LocalStack, phase: str, method: str, reason: str, outcome: str
) -> None:
    life = make_life(fake={"steps": 10**9})
    lines: list[str] = []
    life.log.add_sink(lines.append)
    if method == "data":
        sync = life.boot.wait_for_dataset

        def stop_during_sync(*args: Any, **kwargs: Any) -> Any:
            ready = sync(*args, **kwargs)
            life.stops.request(reason)  # lands while the sync runs: it must abort, not finish and train
            return ready

        life.boot.wait_for_dataset = stop_during_sync  # type: ignore[method-assign]
    elif method == "launch":
        launch = life.stops.launch

        def stop_then_launch(start: Callable[[], Any]) -> bool:
            life.stops.request(reason)
            return launch(start)

        life.stops.launch = stop_then_launch  # type: ignore[method-assign]
    else:
        _stop_on_entry(life, method, reason)
    result = life.run()
    events = [json.loads(line) for line in lines]
    started = [
        e for e in events if e["message"] in ("trainer starting", "start gate opened: the standby trains")
    ]
    assert not started, f"a stop during {phase} still started the trainer"
    assert life.stops.trainer is None
    assert result.outcome == outcome, (phase, result.outcome)
    ledger = stack.read_json("state/ledger.json")
    assert ledger is not None and ledger["lives"][-1]["outcome"] == outcome
