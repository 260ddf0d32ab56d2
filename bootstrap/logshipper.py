"""Ships log lines to a CloudWatch Logs stream with boto3 — works on any AMI, no CloudWatch agent needed."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Any

_FLUSH_SECONDS = 5.0
_MAX_BATCH = 500  # well under PutLogEvents' 1 MB per call
# Lines kept while CloudWatch Logs is unreachable; beyond this the oldest go (journald still has them).
_MAX_BUFFERED = 20_000


class LogShipper:
    """Buffers lines and sends them from a background thread; never blocks or fails the agent.

    While the log group is unreachable the lines stay buffered (bounded) and still go to journald (stdout);
    one line says shipping paused and one says it resumed, and nothing sent twice or out of order.
    """

    def __init__(self, logs: Any, group: str, stream: str) -> None:
        self._logs = logs
        self.group = group
        self.stream = stream
        self._buffer: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._ready = False
        self.failing = False
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name=f"logs-{stream}", daemon=True)
        self._thread.start()

    def __call__(self, line: str) -> None:
        with self._lock:
            # Stamped under the lock: CloudWatch rejects a batch whose events are out of order.
            self._buffer.append({"timestamp": int(time.time() * 1000), "message": line})
            overflow = len(self._buffer) - _MAX_BUFFERED
            if overflow > 0:
                del self._buffer[:overflow]
                self.dropped += overflow

    def _ensure_stream(self) -> None:
        if self._ready:
            return
        with contextlib.suppress(self._logs.exceptions.ResourceAlreadyExistsException):
            self._logs.create_log_stream(logGroupName=self.group, logStreamName=self.stream)
        self._ready = True

    def flush(self) -> bool:
        """Send what is buffered; False when CloudWatch Logs refused (the lines stay for the next try)."""
        while True:
            with self._lock:
                batch = self._buffer[:_MAX_BATCH]
            if not batch:
                return True
            try:
                self._ensure_stream()
                self._logs.put_log_events(logGroupName=self.group, logStreamName=self.stream, logEvents=batch)
            except Exception as exc:  # best effort: journald has every line, the next flush retries
                if not self.failing:
                    self.failing = True
                    print(
                        f"CloudWatch Logs {self.group}/{self.stream}: shipping paused, retrying "
                        f"({str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__})",
                        file=sys.stderr,
                    )
                return False
            with self._lock:
                del self._buffer[: len(batch)]
            if self.failing:
                self.failing = False
                print(f"CloudWatch Logs {self.group}/{self.stream}: shipping resumed", file=sys.stderr)

    def _run(self) -> None:
        delay = _FLUSH_SECONDS
        while not self._closed:
            self._wake.wait(delay)
            self._wake.clear()
            # Back off while the service refuses; back to the normal pace once a batch goes through.
            delay = _FLUSH_SECONDS if self.flush() else min(delay * 2, 60.0)

    def begin_close(self) -> None:
        """Ask the shipping thread to send what is left and stop (several shippers close in parallel)."""
        self._closed = True
        self._wake.set()

    def close(self, timeout: float = 10.0) -> None:
        """Flush what is left, waiting at most `timeout` seconds (an unreachable service is not awaited)."""
        self.begin_close()
        self._thread.join(timeout=timeout)
        if not self._thread.is_alive():
            self.flush()


def close_all(shippers: list[LogShipper], timeout: float = 10.0) -> None:
    """Close every shipper within one shared `timeout`, not one timeout each."""
    deadline = time.monotonic() + timeout
    for shipper in shippers:
        shipper.begin_close()
    for shipper in shippers:
        shipper.close(timeout=max(0.0, deadline - time.monotonic()))
