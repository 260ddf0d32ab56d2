"""Stop and early-checkpoint requests: SIGTERM/SIGINT or the agent's files, agreed by all ranks."""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path
from types import FrameType

log = logging.getLogger(__name__)


class StopRequest:
    """Remembers a stop signal and polls the stop and checkpoint-request files at step boundaries."""

    def __init__(self, stop_file: str = "", checkpoint_request_file: str = "") -> None:
        self.stop_file = Path(stop_file) if stop_file else None
        self.checkpoint_request_file = Path(checkpoint_request_file) if checkpoint_request_file else None
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        if self._previous:
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def uninstall(self) -> None:
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
