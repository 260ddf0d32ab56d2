"""The stop checkpoint's trigger in-process: SIGTERM/SIGINT or the agent's stop file is remembered until the
next step boundary, a stop sent during start-up waits for the handler, and checkpoints fall due on time."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest

import training.stop
from training.checkpoint_policy import ASSUMED_CHECKPOINT_SECONDS, InterruptionRate, choose_interval
from training.stop import STOP_SIGNALS, AutoDeadline, Deadline, StopRequest, stop_signals_blocked


@pytest.fixture(autouse=True)
def default_stop_handlers() -> Iterator[list[int]]:
    """Each test starts with stop signals caught by a bystander handler (a stop the request under test
    missed fails its test, never kills the test process) and ends with the process's own handlers and mask,
    whatever a failure left. Yields the signals the bystander caught."""
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    missed: list[int] = []

    def bystander(signum: int, _frame: FrameType | None) -> None:
        missed.append(signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, bystander)
    yield missed
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def send(signum: signal.Signals) -> None:
    """The signal to this thread, as the agent's to the trainer's pid reaches its only thread: a test
    process with other threads (mutmut's) would otherwise have one of them take a blocked stop."""
    signal.pthread_kill(threading.get_ident(), signum)


def blocked() -> set[int]:
    """The signals this thread has blocked now."""
    return set(signal.pthread_sigmask(signal.SIG_BLOCK, []))


class FakeClock:
    """training.stop's `time`: a monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture()
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(training.stop, "time", fake)
    return fake


def test_sigterm_is_remembered_as_a_stop_and_named_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    """A stop signal only sets a flag: the loop sees it at its next step boundary and says which signal."""
    request = StopRequest()
    request.install()
    try:
        assert not request.stop_requested()
        with caplog.at_level(logging.WARNING, logger="training.stop"):
            send(signal.SIGTERM)
        assert request.stop_requested()
        assert request.reason() == "SIGTERM"
        assert caplog.messages == ["SIGTERM received: stopping after the current optimizer step"]
    finally:
        request.uninstall()


def test_the_first_stop_signal_is_the_one_named_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """A second signal (SIGINT after SIGTERM) neither renames the stop nor logs again."""
    request = StopRequest()
    request.install()
    try:
        with caplog.at_level(logging.WARNING, logger="training.stop"):
            send(signal.SIGTERM)
            send(signal.SIGINT)
        assert request.reason() == "SIGTERM"
        assert caplog.messages == ["SIGTERM received: stopping after the current optimizer step"]
    finally:
        request.uninstall()


def test_sigint_stops_without_a_keyboard_interrupt() -> None:
    """Ctrl-C is a stop at the next step boundary too, never a traceback mid-step."""
    request = StopRequest()
    request.install()
    try:
        send(signal.SIGINT)
        assert request.stop_requested() and request.reason() == "SIGINT"
    finally:
        request.uninstall()


def test_a_stop_sent_while_signals_are_blocked_waits_for_the_handler() -> None:
    """A SIGTERM sent while blocked stays pending and is delivered once the handler is installed."""
    request = StopRequest()
    with stop_signals_blocked():
        assert blocked() >= STOP_SIGNALS
        send(signal.SIGTERM)
        assert signal.SIGTERM in signal.sigpending()
        assert not request.stop_requested()
        request.install()
        try:
            assert request.stop_requested() and request.reason() == "SIGTERM"
            assert not STOP_SIGNALS & blocked()
        finally:
            request.uninstall()


def test_the_block_puts_back_the_mask_it_found() -> None:
    """Leaving `stop_signals_blocked` restores the caller's mask exactly: its own blocked signals stay."""
    signal.pthread_sigmask(signal.SIG_SETMASK, [signal.SIGUSR1])
    with stop_signals_blocked():
        assert blocked() == {signal.SIGUSR1, *STOP_SIGNALS}
    assert blocked() == {signal.SIGUSR1}


def test_nested_installs_keep_the_handler_until_the_outermost_uninstall() -> None:
    """Nested installs keep one handler until the last uninstall puts the previous ones back."""
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    request = StopRequest()
    request.install()
    request.install()
    request.uninstall()
    for sig in STOP_SIGNALS:
        assert signal.getsignal(sig) == request._on_signal
    request.uninstall()
    assert {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} == previous
    request.uninstall()
    assert {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} == previous
    # Installed again after all that, it catches a stop again.
    request.install()
    try:
        send(signal.SIGTERM)
        assert request.stop_requested()
    finally:
        request.uninstall()


def test_the_agents_stop_file_stops_and_is_named(tmp_path: Path) -> None:
    """The stop file is a stop while it exists, and the reason names it."""
    stop_file = tmp_path / "STOP"
    request = StopRequest(stop_file=str(stop_file))
    assert not request.stop_requested()
    stop_file.touch()
    assert request.stop_requested()
    assert request.reason() == f"stop file {stop_file}"


def test_a_stop_from_another_rank_is_said_so() -> None:
    """Without a signal or a stop file here, the stop came from another rank's agreement."""
    request = StopRequest()
    assert not request.stop_requested()
    assert request.reason() == "another rank"


def test_a_signal_caught_before_the_files_are_named_stays_caught(tmp_path: Path) -> None:
    """`watch` (once the config is read) never forgets a stop signal that arrived before it."""
    request = StopRequest()
    request.install()
    try:
        send(signal.SIGTERM)
        request.watch(str(tmp_path / "STOP"), str(tmp_path / "CHECKPOINT"))
        assert request.stop_requested() and request.reason() == "SIGTERM"
    finally:
        request.uninstall()


def test_a_checkpoint_request_is_seen_and_cleared_once_acted_on(tmp_path: Path) -> None:
    """The request file asks for a checkpoint while it exists; clearing it is safe to repeat."""
    request_file = tmp_path / "CHECKPOINT"
    request = StopRequest(checkpoint_request_file=str(request_file))
    assert not request.checkpoint_requested()
    request_file.touch()
    assert request.checkpoint_requested()
    assert not request.stop_requested()
    request.clear_checkpoint_request()
    assert not request_file.exists() and not request.checkpoint_requested()
    request.clear_checkpoint_request()
    unnamed = StopRequest()
    assert unnamed.checkpoint_request_file is None and not unnamed.checkpoint_requested()
    unnamed.clear_checkpoint_request()


def test_empty_file_names_watch_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unset stop or request file (the config's "") is no file, not the current directory."""
    monkeypatch.chdir(tmp_path)
    for request in (StopRequest("", ""), StopRequest()):
        assert request.stop_file is None and request.checkpoint_request_file is None
        assert not request.stop_requested() and not request.checkpoint_requested()


def test_a_deadline_falls_due_once_its_period_has_passed_and_restarts_on_reset(clock: FakeClock) -> None:
    """checkpoint.every_minutes: due at exactly the period, not before; reset starts a new period."""
    deadline = Deadline(2.5)
    assert deadline.seconds == 150
    clock.now += 149.9
    assert not deadline.due()
    clock.now += 0.1
    assert deadline.due()
    deadline.reset()
    assert not deadline.due()
    clock.now += 150
    assert deadline.due()


def test_a_sub_second_period_still_falls_due(clock: FakeClock) -> None:
    """However short, a positive period is a period (checkpoint.every_minutes=0.01: every 0.6 s)."""
    deadline = Deadline(0.01)
    clock.now += 0.59
    assert not deadline.due()
    clock.now += 0.01
    assert deadline.due()


def test_a_zero_period_never_falls_due(clock: FakeClock) -> None:
    """checkpoint.every_minutes=0 turns time-based checkpoints off."""
    deadline = Deadline(0)
    assert not deadline.due()
    clock.now += 10**6
    assert not deadline.due()


def test_auto_deadline_starts_from_the_assumed_checkpoint_time_and_says_so(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Until a checkpoint is timed, `auto` uses the assumed checkpoint time, announced once by rank 0."""
    rate = InterruptionRate(11.2, "the ledger's figure")
    assumed = choose_interval(ASSUMED_CHECKPOINT_SECONDS, rate)
    with caplog.at_level(logging.INFO, logger="training.stop"):
        deadline = AutoDeadline(rate, announce=True)
    assert deadline.interval == assumed
    assert deadline.seconds == pytest.approx(assumed.minutes * 60)
    assert caplog.messages == [f"{assumed.describe()}, until the first checkpoint is timed"]
    clock.now += deadline.seconds
    assert deadline.due()


def test_auto_deadline_follows_each_measured_checkpoint_and_announces_the_first(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Each measured checkpoint chooses the period again and restarts it; only the first is announced."""
    rate = InterruptionRate(11.2, "the ledger's figure")
    deadline = AutoDeadline(rate, announce=True)
    clock.now += 10**5
    assert deadline.due()
    with caplog.at_level(logging.INFO, logger="training.stop"):
        deadline.measured(40.0)
        first = choose_interval(40.0, rate)
        assert deadline.interval == first
        assert deadline.seconds == pytest.approx(first.minutes * 60)
        assert not deadline.due()  # the period restarted
        deadline.measured(90.0)
    second = choose_interval(90.0, rate)
    assert deadline.seconds == pytest.approx(second.minutes * 60) and deadline.seconds != first.minutes * 60
    assert caplog.messages == [first.describe()]


def test_an_unannounced_auto_deadline_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """Ranks other than 0 keep the same period silently."""
    with caplog.at_level(logging.INFO, logger="training.stop"):
        deadline = AutoDeadline(InterruptionRate(11.2, "x"), announce=False)
        deadline.measured(40.0)
    assert caplog.messages == []
