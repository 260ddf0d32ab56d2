"""Waits with a deadline of their own that fail with a message naming what did not happen.

pytest-timeout's global limit (`timeout` in pyproject.toml) is a last resort, not an oracle: a test it kills
says only that it ran too long, never what it was waiting for. tests/test_waits_have_deadlines.py keeps
unbounded waits out of the tests.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")


def join_all(threads: Iterable[threading.Thread], timeout: float, what: str) -> None:
    """Join every thread within `timeout` seconds in all; AssertionError naming `what` (and the threads still
    running) past it. A thread that hangs must fail its test here, not leave the test to the global limit."""
    threads = list(threads)
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    alive = [thread.name for thread in threads if thread.is_alive()]
    assert not alive, f"{what} did not finish within {timeout} s: {alive} still running"


def wait_until(condition: Callable[[], T], timeout: float, what: str, poll: float = 0.05) -> T:
    """`condition()`'s first truthy value, polled every `poll` seconds; AssertionError naming `what` once
    `timeout` seconds have passed without one."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(poll)
    return value
