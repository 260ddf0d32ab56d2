"""Runs a job script (argv[1:]) held at a step until its stop arrives: tests/job/runner.py's stop points.

The runner stops a job once its progress reaches a step. Raced against the job, the stop could land
anywhere from that step to the job's end (or after it), depending on how fast this machine is. Held, it
lands deterministically: once the job reports a step at or past TRAINSTACK_TEST_HOLD_AT_STEP, the report
does not return until the job's own `should_stop()` says the stop file or signal arrived, so the job answers
the stop at that very step. Nothing else of the job changes: the same contract, the same callbacks.
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any

from trainstack_job.job import Job

HOLD_ENV = "TRAINSTACK_TEST_HOLD_AT_STEP"
# Only a bound on a broken test (the runner's own timeout is shorter): the stop normally comes at once.
HOLD_LIMIT_SECONDS = 120.0


def hold_at(step_to_hold: int) -> None:
    report = Job.report_progress

    held: list[int] = []

    def report_then_hold(self: Job, step: int, total_steps: int | None = None, **metrics: Any) -> None:
        report(self, step, total_steps, **metrics)
        if step < step_to_hold or held:
            return
        # Said even when the stop is already here: the runner may have seen this step's progress and sent
        # it before this line runs; the job answers it at this step either way.
        held.append(step)
        print(f"test hold: at step {step} until the stop arrives", flush=True)
        deadline = time.monotonic() + HOLD_LIMIT_SECONDS
        while not self.should_stop() and time.monotonic() < deadline:
            time.sleep(0.01)

    Job.report_progress = report_then_hold  # type: ignore[method-assign]


def main() -> None:
    hold_at(int(os.environ[HOLD_ENV]))
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = str(Path(script).resolve().parent)  # as `python script.py` would have it
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
