"""Stall watchdog: training progress (the step in progress.json) must advance within the stall timeout."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path


def read_progress(path: Path) -> dict[str, object] | None:
    """The trainer's progress.json, or None while it is missing or mid-write."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
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
