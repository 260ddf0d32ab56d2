"""Stop and early-checkpoint requests: SIGTERM/SIGINT or the agent's files, agreed by all ranks."""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

from training.checkpoint_policy import ASSUMED_CHECKPOINT_SECONDS, InterruptionRate, choose_interval

log = logging.getLogger(__name__)

STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Start a trainer inside this block: it inherits SIGTERM/SIGINT blocked, so a stop sent while its
    interpreter is still starting stays pending until `StopRequest.install` unblocks it, instead of
    killing it by the default action (exit -15) before any handler exists."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class StopRequest:
    """Remembers a stop signal and polls the stop and checkpoint-request files at step boundaries."""

    def __init__(self, stop_file: str = "", checkpoint_request_file: str = "") -> None:
        self.watch(stop_file, checkpoint_request_file)
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}
        self._installs = 0

    def watch(self, stop_file: str, checkpoint_request_file: str) -> None:
        """Name the agent's files once the config is read; a signal caught before that stays caught."""
        self.stop_file = Path(stop_file) if stop_file else None
        self.checkpoint_request_file = Path(checkpoint_request_file) if checkpoint_request_file else None

    def install(self) -> None:
        # Nested installs (main, then the Trainer around its loop) keep one handler until the outermost
        # uninstall, so no moment between start-up and exit falls back to the default action.
        self._installs += 1
        if self._installs > 1:
            return
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        # A stop that arrived while a parent's `stop_signals_blocked` held it back is delivered here.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)

    def uninstall(self) -> None:
        if self._installs == 0:
            return
        self._installs -= 1
        if self._installs:
            return
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        # Only a flag: the loop stops at the next optimizer-step boundary, where the state is consistent.
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
            log.warning("%s received: stopping after the current optimizer step", self.signal_name)

    def stop_requested(self) -> bool:
        if self.signal_name is not None:
            return True
        return self.stop_file is not None and self.stop_file.exists()

    def checkpoint_requested(self) -> bool:
        return self.checkpoint_request_file is not None and self.checkpoint_request_file.exists()

    def clear_checkpoint_request(self) -> None:
        if self.checkpoint_request_file is not None:
            self.checkpoint_request_file.unlink(missing_ok=True)

    def reason(self) -> str:
        if self.signal_name:
            return self.signal_name
        return f"stop file {self.stop_file}" if self.stop_file else "another rank"


class Deadline:
    """Wall-clock period for time-based checkpoints."""

    def __init__(self, minutes: float) -> None:
        self.seconds = minutes * 60
        self.reset()

    def reset(self) -> None:
        self._start = time.monotonic()

    def due(self) -> bool:
        return self.seconds > 0 and time.monotonic() - self._start >= self.seconds


class AutoDeadline(Deadline):
    """`checkpoint.every_minutes: auto`: a period that follows the measured checkpoint time by Young/Daly.

    Every rank keeps one and is given the same measured time, so all agree on when a checkpoint is due.
    """

    def __init__(self, rate: InterruptionRate, announce: bool) -> None:
        self._rate = rate
        self._announce = announce
        self.interval = choose_interval(ASSUMED_CHECKPOINT_SECONDS, rate)
        self._measured = False
        super().__init__(self.interval.minutes)
        if announce:
            log.info("%s, until the first checkpoint is timed", self.interval.describe())

    def measured(self, checkpoint_seconds: float) -> None:
        """A checkpoint blocked training this long: choose the interval again and restart the period."""
        self.interval = choose_interval(checkpoint_seconds, self._rate)
        self.seconds = self.interval.minutes * 60
        if self._announce and not self._measured:
            log.info("%s", self.interval.describe())
        self._measured = True
        self.reset()
