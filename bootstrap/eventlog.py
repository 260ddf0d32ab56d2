"""Structured agent log: one JSON line per event on stdout (journald), fanned out to any extra sinks."""

from __future__ import annotations

import json
import sys
import threading
from collections import deque
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any, TextIO


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


def iso(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class EventLog:
    """Writes `{"time", "stage", "message", ...}` lines; keeps the last lines for failure reports."""

    def __init__(self, stream: TextIO | None = None, tail_lines: int = 40) -> None:
        self._stream = stream or sys.stdout
        self._sinks: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        self.tail: deque[str] = deque(maxlen=tail_lines)

    def add_sink(self, sink: Callable[[str], None]) -> None:
        self._sinks.append(sink)

    def event(self, stage: str, message: str, **fields: Any) -> None:
        record = {"time": iso(utc_now()), "stage": stage, "message": message, **fields}
        line = json.dumps(record, default=str)
        with self._lock:
            self._stream.write(line + "\n")
            self._stream.flush()
            self.tail.append(line)
        for sink in self._sinks:
            sink(line)
