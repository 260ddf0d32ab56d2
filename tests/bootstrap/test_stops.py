"""A stop that comes before the trainer starts (bootstrap/stops.py, in the life's phases): the trainer is
never started, and the life ends with the stop's own outcome. The promise of docs/internals.md ("Agent
lives"): a stop is acted on the moment it is seen, in every phase. Unit tests of the stop request itself,
then the real agent (in-process, against moto) with the stop landing in each phase before the launch."""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from bootstrap.eventlog import EventLog
from bootstrap.lifecycle import InstanceLife
from bootstrap.outcomes import LifeEnd
from bootstrap.phases import training as training_phase
from bootstrap.stops import STOP_OUTCOMES, StopRequests
from bootstrap.watcher import RebalanceRecommendation, TerminationNotice
from demo.stack import LocalStack
from tests.waiting import join_all

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
    join_all([launcher, stopper], 10, "the launch and the stop that raced it")
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


class Watched(Trainer):
    """A trainer that also records early-checkpoint requests (a rebalance recommendation asks for one)."""

    def __init__(self) -> None:
        super().__init__()
        self.checkpoints = 0

    def request_checkpoint(self) -> None:
        self.checkpoints += 1


def _starting(trainer: Trainer) -> Callable[[], Any]:
    """A `start` for StopRequests.launch that "starts" the stand-in."""
    return lambda: trainer


def _events(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in lines]


def _logged() -> tuple[EventLog, list[str]]:
    log = EventLog(stream=io.StringIO())
    lines: list[str] = []
    log.add_sink(lines.append)
    return log, lines


def test_a_stop_is_one_line_naming_its_reason_phase_and_deadline_and_signals_the_running_trainer() -> None:
    log, lines = _logged()
    stops = StopRequests(log, deadline_seconds=42)
    assert stops.state() == (None, None) and not stops.is_set() and stops.reason is None
    trainer = Watched()
    assert stops.launch(_starting(trainer)) is True and stops.trainer is trainer
    stops.phase = "training"
    before = time.monotonic()
    stops.request("cost_cap", cost_usd=12.5)
    reason, seen_at = stops.state()
    assert reason == "cost_cap" and seen_at is not None and before <= seen_at <= time.monotonic()
    assert stops.is_set() and trainer.stops == 1
    (event,) = _events(lines)
    assert event["stage"] == "stop" and event["message"] == "stop requested from the trainer"
    assert (event["reason"], event["phase"], event["deadline_s"], event["cost_usd"]) == (
        "cost_cap",
        "training",
        42,
        12.5,
    )


def test_a_stop_before_any_trainer_says_so_and_the_report_names_reason_and_phase() -> None:
    log, lines = _logged()
    stops = StopRequests(log, deadline_seconds=5)
    stops.phase = "data-sync"
    stops.request("spot")
    assert _events(lines)[0]["message"] == "stop requested"
    assert stops.stopped_before_training() is LifeEnd.PREEMPTED
    report = _events(lines)[-1]
    assert (
        report["stage"] == "stop" and report["message"] == "stopped before training; nothing new to persist"
    )
    assert (report["reason"], report["phase"]) == ("spot", "data-sync")


def test_a_stop_before_any_phase_is_named_as_one_at_boot() -> None:
    """The watcher runs from boot: a notice before the life's first phase names the phase `boot`."""
    log, lines = _logged()
    stops = StopRequests(log, deadline_seconds=5)
    stops.request("spot")
    assert _events(lines)[0]["phase"] == "boot"


def test_wait_sleeps_until_its_timeout_and_wakes_at_once_on_a_stop() -> None:
    stops = StopRequests(EventLog(stream=io.StringIO()), deadline_seconds=5)
    started = time.monotonic()
    assert stops.wait(0.2) is False and time.monotonic() - started >= 0.2
    threading.Timer(0.1, stops.request, args=["control"]).start()
    started = time.monotonic()
    assert stops.wait(10) is True and time.monotonic() - started < 5


def test_a_notice_is_logged_with_its_action_and_time_and_stops_with_its_source() -> None:
    log, lines = _logged()
    stops = StopRequests(log, deadline_seconds=100)
    trainer = Watched()
    stops.launch(_starting(trainer))
    stops.on_notice(TerminationNotice("scale-in", "terminate", "2026-12-06T10:00:00Z"))
    notice, stop = _events(lines)
    assert notice["stage"] == "interruption" and notice["message"] == "scale-in termination notice"
    assert (notice["action"], notice["at"]) == ("terminate", "2026-12-06T10:00:00Z")
    assert stop["reason"] == "scale-in" and stops.reason == "scale-in" and trainer.stops == 1


def test_a_rebalance_recommendation_asks_the_running_trainer_for_an_early_checkpoint_only() -> None:
    log, lines = _logged()
    stops = StopRequests(log, deadline_seconds=100)
    stops.on_rebalance(RebalanceRecommendation("2026-12-06T10:00:00Z"))
    assert _events(lines)[-1]["message"] == "rebalance recommendation (no trainer running yet)"
    trainer = Watched()
    stops.launch(_starting(trainer))
    stops.on_rebalance(RebalanceRecommendation("2026-12-06T10:01:00Z"))
    event = _events(lines)[-1]
    assert event["stage"] == "rebalance"
    assert event["message"] == "rebalance recommendation: early checkpoint requested"
    assert event["notice_time"] == "2026-12-06T10:01:00Z"
    assert trainer.checkpoints == 1 and trainer.stops == 0 and not stops.is_set(), (
        "a recommendation is no stop"
    )


def test_sigterm_only_flips_a_flag_and_the_sentinel_turns_it_into_a_shutdown_stop() -> None:
    stops = StopRequests(EventLog(stream=io.StringIO()), deadline_seconds=100)
    done = threading.Event()
    sentinel = threading.Thread(target=stops.sentinel, args=[done])
    sentinel.start()
    time.sleep(0.3)
    assert not stops.is_set(), "the sentinel stopped a life nobody asked to stop"
    stops.request_shutdown()
    assert stops.wait(5), "the sentinel never acted on SIGTERM's flag"
    assert stops.reason == "shutdown"
    sentinel.join(5)
    assert not sentinel.is_alive(), "the sentinel goes once it has acted"
    quiet = StopRequests(EventLog(stream=io.StringIO()), deadline_seconds=100)
    finished = threading.Event()
    other = threading.Thread(target=quiet.sentinel, args=[finished])
    other.start()
    finished.set()
    other.join(5)
    assert not other.is_alive() and not quiet.is_set(), "the sentinel ends with the life, stopping nothing"


# -- the real agent: the stop lands in each phase before the launch -------------------------------------


def _stop_on_entry(life: InstanceLife, monkeypatch: pytest.MonkeyPatch, function: str, reason: str) -> None:
    """The stop arrives as `function` of the training phase (bootstrap/phases/training.py) begins; the
    phase runs on as it would."""
    original = getattr(training_phase, function)

    def stopped_first(*args: Any, **kwargs: Any) -> Any:
        life.stops.request(reason)
        return original(*args, **kwargs)

    monkeypatch.setattr(training_phase, function, stopped_first)


@pytest.mark.parametrize(
    ("phase", "method", "reason", "outcome"),
    [
        ("the data sync", "data", "spot", "preempted"),
        ("the restore", "restore", "cancel", "cancelled"),
        ("the job's set-up (venv build)", "job_process", "cost_cap", "cost_cap"),
        ("between the restore and the launch", "launch", "control", "stopped"),
    ],
)
def test_a_stop_in_any_phase_before_the_launch_means_the_trainer_never_starts(
    make_life: MakeLife,
    stack: LocalStack,
    monkeypatch: pytest.MonkeyPatch,
    phase: str,
    method: str,
    reason: str,
    outcome: str,
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
        _stop_on_entry(life, monkeypatch, method, reason)
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
