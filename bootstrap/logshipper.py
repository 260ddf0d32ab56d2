"""Ships log lines to a CloudWatch Logs stream with boto3 — works on any AMI, no CloudWatch agent needed."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Any

_FLUSH_SECONDS = 5.0
_MAX_BATCH = 500  # well under PutLogEvents' 1 MB per call


class LogShipper:
    """Buffers lines and sends them from a background thread; never blocks or fails the agent.

    If the log group is unreachable the lines still go to journald (stdout); one warning says why.
    """

    def __init__(self, logs: Any, group: str, stream: str) -> None:
        self._logs = logs
        self.group = group
        self.stream = stream
        self._buffer: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._disabled = False
        self._ready = False
        self._thread = threading.Thread(target=self._run, name=f"logs-{stream}", daemon=True)
        self._thread.start()

    def __call__(self, line: str) -> None:
        if self._disabled:
            return
        with self._lock:
            # Stamped under the lock: CloudWatch rejects a batch whose events are out of order.
            self._buffer.append({"timestamp": int(time.time() * 1000), "message": line})

    def _ensure_stream(self) -> None:
        if self._ready:
            return
        with contextlib.suppress(self._logs.exceptions.ResourceAlreadyExistsException):
            self._logs.create_log_stream(logGroupName=self.group, logStreamName=self.stream)
        self._ready = True

    def flush(self) -> None:
        while not self._disabled:
            with self._lock:
                batch, self._buffer = self._buffer[:_MAX_BATCH], self._buffer[_MAX_BATCH:]
            if not batch:
                return
            try:
                self._ensure_stream()
                self._logs.put_log_events(logGroupName=self.group, logStreamName=self.stream, logEvents=batch)
            except Exception as exc:  # logs are best effort: journald still has every line
                self._disabled = True
                print(f"CloudWatch Logs {self.group}/{self.stream}: journald only ({exc})", file=sys.stderr)

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(_FLUSH_SECONDS)
            self._wake.clear()
            self.flush()

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=30)
        self.flush()
