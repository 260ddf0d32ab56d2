"""Stall watchdog: training progress (the step in progress.json) must advance within the stall timeout."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from bootstrap.safefiles import read_regular

# progress.json holds a step and a few numbers: anything larger is not the trainer's progress.
MAX_PROGRESS_BYTES = 2**20


def read_progress(path: Path) -> dict[str, object] | None:
    """The trainer's progress.json, or None while it is missing or mid-write.

    The job owns the folder and root polls this every tick: a FIFO there must not block the agent's loop, a
    link (to /dev/zero, to a JSON file of root's) is never followed, a huge file is never read whole. Each
    of those is simply no progress, said nowhere: a line per tick would flood the agent's log."""
    data = read_regular(path, MAX_PROGRESS_BYTES)
    if data is None:
        return None
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):  # mid-write, not JSON or not UTF-8, or nested past the parser
        return None
    return value if isinstance(value, dict) else None


class StallWatchdog:
    """Says when the step has not advanced for `stall_seconds` (time before the first step counts too)."""

    def __init__(self, stall_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._stall_seconds = stall_seconds
        self._clock = clock
        self._last_step: object = None
        self._last_change = clock()

    def reset(self) -> None:
        self._last_step = None
        self._last_change = self._clock()

    def observe(self, step: object) -> bool:
        """Record the current step; True when training has stalled."""
        now = self._clock()
        if step != self._last_step:
            self._last_step = step
            self._last_change = now
            return False
        return now - self._last_change > self._stall_seconds

    def idle_seconds(self) -> float:
        return self._clock() - self._last_change
