"""The start gate (`train.start_gate_file`): a warm standby's trainer waits here, ready, until the agent hands
it the job by removing the file.

Standard library only: the wait is a file poll, so it costs no CPU worth counting while a standby waits
for minutes or hours, and it is testable without torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

# How often the gate and the stop request are looked at: a hand-over is at most this much later than the
# agent's removal of the gate, and a stop at most this much later than its signal.
POLL_SECONDS = 0.1


def wait_for_start_gate(
    gate: Path, stop_requested: Callable[[], bool], poll_seconds: float = POLL_SECONDS
) -> bool:
    """Until `gate` is gone (True) or a stop is requested while it is still there (False).

    A stop only counts as a standby's stop while the gate still exists: looked at again once the stop is
    seen, a gate already removed means the agent handed the job over first, so the trainer goes on, restores
    and meets the stop at its first step boundary like any ungated start. Several ranks each wait here on
    their own and then agree over the process group (training/loop.py), so one rank's view decides for all.
    """
    while True:
        if stop_requested():
            return not gate.exists()
        if not gate.exists():
            return True
        time.sleep(poll_seconds)
